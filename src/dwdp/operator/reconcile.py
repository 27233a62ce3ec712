"""The reconcile loop of one DwdpDeployment: gather -> plan -> apply, then wait.

One asyncio task per deployment runs :func:`reconcile_once` whenever it is woken (an event
of the deployment or of one of its pods, through :class:`Reconcilers`) or its plan's
requeue time passes. Invariants: one task per deployment at a time, so two cycles never
race on the same children; a failed write is logged, reported once as an Event and retried
on the next cycle, never in a tight loop; the task ends when the deployment is gone or being
deleted (the children go with it through their owner references: no finalizer is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

from dwdp.api.contract import RENDEZVOUS_SECRET_BYTES
from dwdp.api.defaults import SERVER_PORT
from dwdp.operator.builders import with_secret_value
from dwdp.operator.constants import LABEL_GROUP, Reason
from dwdp.operator.kube import OPTIONAL_KINDS, ApiError, Kube, now_rfc3339
from dwdp.operator.observe import Observed, pod_from_object
from dwdp.operator.plan import Plan, PlanOptions, plan
from dwdp.operator.probe import VERIFY_INTERVAL_S, probe_ranks, to_probe

__all__ = ["Reconcilers", "execute", "gather", "reconcile_once"]

log = logging.getLogger(__name__)

ERROR_REQUEUE_S = 5.0
"""Seconds to wait after a cycle that failed to read or write."""
MIN_INTERVAL_S = 0.3
"""Least seconds between two cycles of one deployment (wake-ups in between coalesce)."""

Key = tuple[str, str]
"""(namespace, name) of a DwdpDeployment."""


async def gather(kube: Kube, body: dict, memory: _Memory | None = None) -> Observed:
    """List the deployment's children and ask the ranks of starting groups; find out
    which optional APIs (gang PodGroup, ComputeDomain) the apiserver serves."""
    meta = body["metadata"]
    optional = tuple([kind for kind in OPTIONAL_KINDS if await kube.served(kind)])
    pods, others = await kube.list_children(meta["namespace"], meta["name"], optional)
    port = int(((body.get("spec") or {}).get("server") or {}).get("port", SERVER_PORT))
    summaries = [s for s in (pod_from_object(p) for p in pods) if s is not None]
    memory = memory or _Memory()
    verify = time.monotonic() - memory.verified_at >= VERIFY_INTERVAL_S
    if verify:
        memory.verified_at = time.monotonic()
    ranks = await probe_ranks(to_probe(summaries, verify=verify), base_port=port)
    return Observed.from_objects(
        pods=pods,
        children=others,
        ranks=ranks,
        gang="PodGroup" in optional,
        compute_domains="ComputeDomain" in optional,
        create_error=memory.create_error,
        create_blocked=memory.create_blocked(),
    )


CREATE_BACKOFF_INITIAL_S = 5.0
"""Wait before retrying a refused creation (quota, admission), in seconds; doubles."""
CREATE_BACKOFF_MAX_S = 60.0
"""Upper bound of the creation retry wait, in seconds."""


@dataclass
class _Memory:
    """What a deployment's loop remembers between cycles: failures already reported, and
    the retry backoff of refused creations (pacing only; the decisions come from the
    cluster)."""

    reported_errors: set[str] = field(default_factory=set)
    verified_at: float = float("-inf")
    """When the ranks of committed groups were last asked (monotonic seconds)."""
    create_error: str | None = None
    create_failures: int = 0
    create_retry_at: float = 0.0
    secrets_made: set[str] = field(default_factory=set)
    """Rendezvous Secrets this loop created and has not deleted: a refused creation's retry
    does not send them again (Secrets are never read back, so nothing else tells)."""

    def create_blocked(self) -> bool:
        """A refused creation waits for its retry time."""
        return self.create_error is not None and time.monotonic() < self.create_retry_at

    def create_wait_s(self) -> float:
        """Seconds until the next creation attempt (0 when none waits)."""
        return max(0.0, self.create_retry_at - time.monotonic()) if self.create_error else 0.0

    def creation_refused(self, message: str) -> None:
        self.create_failures += 1
        self.create_error = message
        wait = min(CREATE_BACKOFF_MAX_S, CREATE_BACKOFF_INITIAL_S * 2 ** (self.create_failures - 1))
        self.create_retry_at = time.monotonic() + wait

    def creation_worked(self) -> None:
        self.create_failures = 0
        self.create_error = None
        self.create_retry_at = 0.0


async def execute(kube: Kube, body: dict, p: Plan, memory: _Memory | None = None) -> bool:
    """Apply ``p`` in its order; returns False when some write failed (the rest still ran).
    A planned Secret (an incarnation's rendezvous Secret) gets its random value here, from
    :func:`secrets.token_bytes`, so the plan stays deterministic."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    ok = True
    errors: list[str] = []

    async def attempt(what: str, coro) -> None:
        nonlocal ok
        try:
            await coro
        except ApiError as exc:
            ok = False
            log.warning("%s/%s: cannot %s: %s", ns, name, what, exc)
            errors.append(f"cannot {what}: {exc.message}")

    for obj in p.apply:
        await attempt(f"apply {obj['kind']} {obj['metadata']['name']}", kube.apply(obj))
    refused: str | None = None
    not_created: set[str] = set()
    creations = (*p.create, *p.create_pods)
    for i, obj in enumerate(creations):
        # Creations stop at the first refusal (quota, admission): the rest would be refused
        # too; the loop retries after a backoff, so a refusal never becomes a write storm.
        # A refused PodGroup or ComputeDomain stops the pods that need it.
        if obj["kind"] == "Secret":
            if memory is not None and obj["metadata"]["name"] in memory.secrets_made:
                continue
            # The plan has no value: a fresh random one per Secret, generated here.
            obj = with_secret_value(obj, secrets.token_bytes(RENDEZVOUS_SECRET_BYTES))
        try:
            await kube.create(obj)
            if memory is not None and obj["kind"] == "Secret":
                memory.secrets_made.add(obj["metadata"]["name"])
        except ApiError as exc:
            ok = False
            refused = f"cannot create {obj['kind']} {obj['metadata']['name']}: {exc.message}"
            log.warning("%s/%s: %s", ns, name, refused)
            not_created = {
                (o["metadata"].get("labels") or {}).get(LABEL_GROUP, "") for o in creations[i:]
            }
            break
    if memory is not None and (p.create or p.create_pods):
        if refused is None:
            memory.creation_worked()
        else:
            memory.creation_refused(refused)
    for gate in p.gates:
        await attempt(
            f"set the gate of {gate.pod}",
            kube.set_gate(ns, gate.pod, ready=gate.ready, message=gate.message, reason=gate.reason),
        )
    for obj in p.slices:
        await attempt(f"apply EndpointSlice {obj['metadata']['name']}", kube.apply(obj))
    for d in p.delete:
        await attempt(
            f"delete {d.kind} {d.name}", kube.delete(d.kind, ns, d.name, grace_s=d.grace_s)
        )
        if memory is not None and d.kind == "Secret":
            memory.secrets_made.discard(d.name)
    if p.status is not None:
        await attempt("write the status", kube.apply_status(ns, name, p.status))
    for ev in p.events:
        if ev.reason is Reason.CREATED_GROUP and ev.group in not_created:
            continue  # its creation was refused: the ReplicaFailure condition says so
        log.info("%s/%s: %s: %s", ns, name, ev.reason.value, ev.message)
        await attempt(
            "post an Event", kube.event(body, reason=ev.reason, message=ev.message, type_=ev.type)
        )
    if memory is not None:
        for message in errors:
            if message in memory.reported_errors:
                continue
            memory.reported_errors.add(message)
            with contextlib.suppress(ApiError):
                await kube.event(body, reason=Reason.APPLY_FAILED, message=message, type_="Warning")
        if ok:
            memory.reported_errors.clear()
    return ok


async def reconcile_once(
    kube: Kube, key: Key, options: PlanOptions, memory: _Memory | None = None
) -> float | None:
    """One cycle for ``key``; returns seconds until the next one, or None when the
    deployment is gone or being deleted (the loop then ends)."""
    ns, name = key
    body = await kube.get_deployment(ns, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    observed = await gather(kube, body, memory)
    p = plan(body, observed, options=options, now=now_rfc3339())
    if p.writes:
        log.debug("%s/%s: plan with %d writes", ns, name, p.writes)
    ok = await execute(kube, body, p, memory)
    if memory is not None and memory.create_error is not None:
        # A refusal waits for its retry time (the status shows the condition meanwhile).
        wait = memory.create_wait_s()
        return max(MIN_INTERVAL_S, min(p.requeue_after_s, wait or ERROR_REQUEUE_S))
    return p.requeue_after_s if ok else ERROR_REQUEUE_S


class Reconcilers:
    """The loop tasks, one per deployment, and their wake-up events."""

    def __init__(self, kube: Kube, options: PlanOptions) -> None:
        self.kube = kube
        self.options = options
        self._tasks: dict[Key, asyncio.Task] = {}
        self._wake: dict[Key, asyncio.Event] = {}

    def known(self, key: Key) -> bool:
        """A loop runs for ``key``."""
        return key in self._tasks and not self._tasks[key].done()

    def wake(self, key: Key, *, start: bool = True) -> None:
        """Run a cycle for ``key`` soon; start its loop when none runs (and ``start``)."""
        if self.known(key):
            self._wake[key].set()
        elif start:
            self._wake[key] = asyncio.Event()
            self._tasks[key] = asyncio.create_task(self._loop(key), name=f"reconcile {key}")

    def stop(self, key: Key) -> None:
        """End the loop of ``key`` (the deployment was deleted)."""
        task = self._tasks.pop(key, None)
        self._wake.pop(key, None)
        if task is not None:
            task.cancel()

    async def stop_all(self) -> None:
        """Cancel every loop and wait for them."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._wake.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, key: Key) -> None:
        memory = _Memory()
        while True:
            event = self._wake.get(key)
            if event is None:
                return
            event.clear()
            try:
                delay = await reconcile_once(self.kube, key, self.options, memory)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s/%s: reconcile failed", *key)
                delay = ERROR_REQUEUE_S
            if delay is None:
                log.info("%s/%s: gone or being deleted; loop ends", *key)
                if self._tasks.get(key) is asyncio.current_task():
                    self._tasks.pop(key, None)
                    self._wake.pop(key, None)
                return
            await asyncio.sleep(MIN_INTERVAL_S)  # coalesce a burst of pod events
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=max(0.0, delay - MIN_INTERVAL_S))

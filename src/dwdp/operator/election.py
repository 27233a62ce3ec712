"""Leader election over a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers do.

Several operator replicas may run; exactly one reconciles. Each replica tries to hold the
Lease ``--leader-elect-name`` in its namespace: it takes the Lease when it is free or its
holder stopped renewing it for ``leaseDurationSeconds``, then renews it every
:data:`RETRY_PERIOD_S`. A replica without the Lease runs nothing but its liveness endpoint;
the holder runs the kopf operator. A holder that cannot renew for :data:`RENEW_DEADLINE_S`
stops at once (exit status 1; the kubelet restarts it as a standby), before any other
replica can take the Lease (``leaseDurationSeconds`` > the renew deadline), so two replicas
never act together. A holder stopped by SIGTERM releases the Lease, so the standby takes it
within one retry period; a killed one is replaced within ``leaseDurationSeconds`` + one
retry period (17 s with the defaults).

Writes go through ``PUT`` with the read ``resourceVersion``: of two replicas racing for a
free Lease, the apiserver accepts one (409 Conflict for the other). The decisions are the
pure :func:`claim`; only :class:`LeaderElector` does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dwdp.operator.kube import ApiError, Kube
from dwdp.operator.times import parse_time

__all__ = [
    "LEASE_DURATION_S",
    "RENEW_DEADLINE_S",
    "RETRY_PERIOD_S",
    "LeaderElector",
    "LostLease",
    "claim",
    "lead_then_run",
]

log = logging.getLogger(__name__)

LEASE_DURATION_S = 15
"""Seconds a Lease stays held without a renewal (client-go's default)."""
RENEW_DEADLINE_S = 10.0
"""Seconds the holder keeps acting without a successful renewal; then it stops."""
RETRY_PERIOD_S = 2.0
"""Seconds between two tries to take or renew the Lease."""


class LostLease(RuntimeError):
    """The holder could not renew its Lease within :data:`RENEW_DEADLINE_S`."""


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claim(spec: Mapping[str, Any] | None, identity: str, now: dt.datetime) -> dict[str, Any] | None:
    """The Lease ``spec`` to write for ``identity`` at ``now``, or None when another holder
    still holds it (renewed less than its ``leaseDurationSeconds`` ago). ``spec`` None: no
    Lease yet. Taking over from another holder counts a ``leaseTransitions``."""
    spec = spec or {}
    holder = spec.get("holderIdentity") or ""
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or LEASE_DURATION_S
    others = holder and holder != identity
    if others and renewed is not None and (now - renewed).total_seconds() < duration:
        return None
    mine = holder == identity
    transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine or not holder else 1)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": LEASE_DURATION_S,
        "acquireTime": spec.get("acquireTime") if mine else _micro(now),
        "renewTime": _micro(now),
        "leaseTransitions": transitions,
    }


@dataclass
class LeaderElector:
    """Holds the Lease ``namespace/name`` for ``identity`` (the pod's name plus a random
    suffix, so a restarted container is a new candidate)."""

    kube: Kube
    namespace: str
    name: str
    identity: str

    @property
    def _path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    async def _try(self) -> bool:
        """One attempt to take or renew the Lease; True when this replica holds it."""
        try:
            lease = await self.kube.request("GET", self._path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            lease = None
        now = dt.datetime.now(dt.UTC)
        spec = claim((lease or {}).get("spec"), self.identity, now)
        if spec is None:
            return False
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta}
        body["spec"] = spec
        try:
            if lease is None:
                path = self._path.rsplit("/", 1)[0]
                await self.kube.request("POST", path, kind="Lease", body=body)
            else:
                meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
                await self.kube.request("PUT", self._path, kind="Lease", body=body)
        except ApiError as exc:
            if exc.status in (409, 422):  # another replica wrote first
                return False
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease (logs who holds it meanwhile)."""
        told = False
        while True:
            try:
                if await self._try():
                    log.info(
                        "leader election: %s holds lease %s/%s",
                        self.identity,
                        self.namespace,
                        self.name,
                    )
                    return
            except Exception as exc:  # the apiserver is down: keep trying
                log.warning("leader election: lease %s/%s: %s", self.namespace, self.name, exc)
            if not told:
                log.info(
                    "leader election: waiting for lease %s/%s (held by another replica)",
                    self.namespace,
                    self.name,
                )
                told = True
            await asyncio.sleep(RETRY_PERIOD_S)

    async def keep(self) -> None:
        """Renew the Lease every :data:`RETRY_PERIOD_S` for as long as this runs; raise
        :class:`LostLease` when no renewal succeeded for :data:`RENEW_DEADLINE_S`."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(RETRY_PERIOD_S)
            try:
                ok = await self._try()
            except Exception as exc:
                log.warning("leader election: renewing %s/%s: %s", self.namespace, self.name, exc)
                ok = False
            if ok:
                last = loop.time()
            elif loop.time() - last > RENEW_DEADLINE_S:
                raise LostLease(
                    f"lease {self.namespace}/{self.name} not renewed for "
                    f"{RENEW_DEADLINE_S:.0f} s; stopping so that another replica can lead"
                )

    async def release(self) -> None:
        """Give the Lease up (a graceful stop): the standby takes it at its next try."""
        try:
            lease = await self.kube.request("GET", self._path)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            await self.kube.request("PUT", self._path, kind="Lease", body=lease)
            log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except Exception as exc:  # best effort: the Lease expires anyway
            log.warning(
                "leader election: release of %s/%s failed: %s", self.namespace, self.name, exc
            )


async def _standby_liveness(url: str | None) -> Any:
    """While waiting for the Lease, answer the liveness probe at ``url`` (kopf serves it
    once this replica leads); returns the aiohttp runner to clean up, or None."""
    if not url:
        return None
    import urllib.parse

    from aiohttp import web

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    parts = urllib.parse.urlsplit(url)
    app = web.Application()
    app.router.add_get(parts.path or "/", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port or 80).start()
    return runner


async def lead_then_run(elector: LeaderElector, operator: Any, *, liveness: str | None) -> None:
    """Wait for the Lease (answering liveness meanwhile), then run ``operator()`` (a
    coroutine function: kopf's operator) while renewing the Lease; release it when the
    operator ends. Raises :class:`LostLease` (after stopping the operator) when a renewal
    deadline passed."""
    runner = await _standby_liveness(liveness)
    try:
        await elector.acquire()
    finally:
        if runner is not None:
            await runner.cleanup()
    keep = asyncio.create_task(elector.keep())
    run = asyncio.create_task(operator())
    try:
        done, _ = await asyncio.wait({keep, run}, return_when=asyncio.FIRST_COMPLETED)
        if keep in done:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run
            keep.result()  # raises LostLease
        run.result()
    finally:
        keep.cancel()
        with contextlib.suppress(asyncio.CancelledError, LostLease):
            await keep
        await elector.release()

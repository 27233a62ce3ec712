"""The kopf side of the operator: settings and thin handlers over the reconcile loops.

:func:`build_registry` registers, on a registry of its own (no import-time globals):
login through the ``kubernetes`` client; an event handler on DwdpDeployments that wakes
(or stops) the deployment's loop; an event handler on the operator's pods that wakes their
owner's loop; cleanup; and, when a webhook is configured, the validating admission handler
that applies every rule of :func:`dwdp.api.deployment.deployment_problems`. No handler needs
a finalizer and none writes: all writes happen in the loops (:mod:`dwdp.operator.reconcile`).
A liveness probe ``writes`` reports the client's write counters (:attr:`Kube.writes`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf

from dwdp.api.deployment import deployment_problems
from dwdp.operator import constants as c
from dwdp.operator.certs import CertFiles
from dwdp.operator.reconcile import Reconcilers

__all__ = ["OperatorConfig", "WebhookConfig", "build_registry", "build_settings"]

log = logging.getLogger(__name__)

WATCH_SERVER_TIMEOUT_S = 300
"""The apiserver ends a watch after this long (seconds); kopf then restarts it."""
WATCH_CLIENT_TIMEOUT_S = 330
"""The client gives up on a silent watch after this long (seconds)."""
CONNECT_TIMEOUT_S = 30
WEBHOOK_PATH = "/validate"


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Where the validating webhook listens and how the apiserver reaches it."""

    listen_host: str
    port: int
    url_host: str
    """Host (name or address) in the webhook URL kopf writes when it manages the config."""
    certs: CertFiles
    managed: str | None = None
    """Name of the ValidatingWebhookConfiguration kopf keeps up to date; None: the
    configuration comes from elsewhere (the Helm chart)."""


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """The command-line settings of ``dwdp operator``."""

    webhook: WebhookConfig | None = None


def build_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Fill kopf's settings: own finalizer and annotation prefix, progress in status,
    watch timeouts, no CRD scanning (least privilege), no kopf peering (high availability
    is the Lease of :mod:`dwdp.operator.election`),
    the webhook server when configured."""
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field=c.KOPF_PROGRESS_FIELD)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.request_timeout = 60
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = True
    settings.peering.standalone = True
    hook = config.webhook
    if hook is not None:
        settings.admission.server = kopf.WebhookServer(
            addr=hook.listen_host,
            port=hook.port,
            host=hook.url_host,
            path=WEBHOOK_PATH,
            certfile=str(hook.certs.cert),
            pkeyfile=str(hook.certs.key),
            cafile=str(hook.certs.ca),
        )
        settings.admission.managed = hook.managed


def build_registry(reconcilers: Reconcilers, config: OperatorConfig) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers (see the module docstring)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.event(c.API_GROUP, c.API_VERSION, c.RESOURCE_PLURAL, registry=registry)
    async def deployment_event(
        *, event: kopf.RawEvent, namespace: str | None, name: str, meta: kopf.Meta, **_: Any
    ) -> None:
        if namespace is None:  # DwdpDeployments are namespaced: never the case
            return
        key = (namespace, name)
        if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
            reconcilers.stop(key)
        else:
            reconcilers.wake(key)

    @kopf.on.event(
        "",
        "v1",
        "pods",
        labels={c.LABEL_DEPLOYMENT: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY},
        registry=registry,
    )
    async def pod_event(*, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        if namespace is None:  # pods are namespaced: never the case
            return
        reconcilers.wake((namespace, labels[c.LABEL_DEPLOYMENT]), start=False)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await reconcilers.stop_all()

    @kopf.on.probe(id="writes", registry=registry)
    def writes(**_: Any) -> dict[str, Any]:
        # The operator's API write counters on the liveness endpoint (kopf caches probe
        # results for 10 s): total, by "VERB Kind", and the wall time they were read at.
        counts = reconcilers.kube.writes
        return {
            "total": sum(counts.values()),
            "by": {f"{verb} {kind}": n for (verb, kind), n in sorted(counts.items())},
            "at": time.time(),
        }

    if config.webhook is not None:

        @kopf.on.validate(
            c.API_GROUP,
            c.API_VERSION,
            c.RESOURCE_PLURAL,
            id="spec-rules",
            operations=["CREATE", "UPDATE"],
            ignore_failures=True,
            side_effects=False,
            registry=registry,
        )
        def validate(*, body: kopf.Body, **_: Any) -> None:
            problems = deployment_problems({k: v for k, v in dict(body).items() if k != "status"})
            if problems:
                raise kopf.AdmissionError("; ".join(str(p) for p in problems)[:4000], code=422)

    return registry

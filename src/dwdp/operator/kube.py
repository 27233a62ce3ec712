"""The one place that talks to the Kubernetes API (besides kopf's own watches).

Reads list the children of a deployment; writes are server-side applies with the fixed
field manager :data:`~dwdp.operator.constants.FIELD_MANAGER`, pod creations, strategic
merge patches of the commit-gate condition, deletes and Events. Every write is counted in
:attr:`Kube.writes` (by verb and kind), which the steady-state bench reads. The client is
the synchronous ``kubernetes`` package run in worker threads; nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from dwdp.api.deployment import API_VERSION, KIND
from dwdp.operator import constants as c
from dwdp.operator.conditions import gate_condition

__all__ = ["ApiError", "Kube", "api_request", "now_rfc3339"]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
"""Timeout of one API request, in seconds."""

_PATHS = {
    "Pod": ("/api/v1", "pods"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "Event": ("/api/v1", "events"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    KIND: (f"/apis/{API_VERSION}", c.RESOURCE_PLURAL),
    "PodGroup": (f"/apis/{c.PODGROUP_API}", "podgroups"),
    "ComputeDomain": (f"/apis/{c.COMPUTE_DOMAIN_API}", "computedomains"),
}
CHILD_KINDS = ("ConfigMap", "Service", "EndpointSlice", "NetworkPolicy", "Deployment")
"""Kinds of the non-pod children the operator lists and may delete. Never Secrets: the
operator creates and deletes the rendezvous Secrets by name and cannot read any Secret."""
OPTIONAL_KINDS = {"PodGroup": c.PODGROUP_API, "ComputeDomain": c.COMPUTE_DOMAIN_API}
"""Children whose API a cluster may not serve: listed only where served."""
DISCOVERY_TTL_S = 60.0
"""Seconds a discovery answer (is an optional API served?) is reused."""


def now_rfc3339() -> str:
    """The current UTC time in the API's seconds format (``2026-01-02T03:04:05Z``)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """A non-2xx answer of the apiserver: ``status`` (HTTP code) and ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def api_request(
    client: Any,
    method: str,
    path: str,
    body: Any = None,
    query: dict[str, Any] | None = None,
    content_type: str = "application/json",
    *,
    timeout: float | None = REQUEST_TIMEOUT_S,
    stream: bool = False,
) -> Any:
    """Send one request over ``client`` (a ``kubernetes.client.ApiClient``); return the decoded
    JSON body, or with ``stream`` the open 2xx response (the caller reads it and releases its
    connection). Raises :class:`ApiError` on a non-2xx answer, naming the Status's message;
    the client's own errors (no answer) pass through. Also the raw request of the local
    cluster's process kubelet (``dwdp_dev.devcluster.kubelet``)."""
    headers = {"Accept": "application/json", "Content-Type": content_type}
    method_, url, headers, body, _ = client.param_serialize(
        method,
        path,
        query_params=list((query or {}).items()),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    resp = client.call_api(method_, url, header_params=headers, body=body,
                           _request_timeout=timeout)
    raw = resp.response
    ok = 200 <= resp.status <= 299
    if ok and stream:
        return raw
    data = raw.data
    raw.release_conn()
    if not ok:
        message = data.decode(errors="replace") if data else str(resp.reason)
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(message).get("message", message)
        raise ApiError(resp.status, message)
    return json.loads(data) if data else None


def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = _PATHS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    """A small JSON client: dicts in, dicts out; raises :class:`ApiError`."""

    def __init__(self, api_client: Any) -> None:
        self.client = api_client
        self.writes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._served: dict[str, tuple[float, bool]] = {}

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> Kube:
        """In-cluster credentials when running in a pod (service-account token present),
        else ``kubeconfig`` (default: ``$KUBECONFIG`` or ``~/.kube/config``)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        token = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and token.exists():
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        cfg.connection_pool_maxsize = 16
        return cls(client.ApiClient(cfg))

    # -- transport ------------------------------------------------------------------
    async def request(self, method: str, path: str, *, kind: str = "", **kwargs: Any) -> Any:
        """Send one request in a worker thread; return the decoded JSON body. Every
        non-GET request counts in :attr:`writes` under ``(method, kind)``."""
        if method != "GET":
            self.writes[(method, kind)] += 1
        return await asyncio.to_thread(api_request, self.client, method, path, **kwargs)

    # -- reads ------------------------------------------------------------------------
    async def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DwdpDeployment, or None when it does not exist."""
        try:
            return await self.request("GET", _path(KIND, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def served(self, kind: str) -> bool:
        """The apiserver serves the optional kind ``kind`` (PodGroup, ComputeDomain);
        asked through discovery at most every :data:`DISCOVERY_TTL_S` seconds."""
        import time

        stamp, ok = self._served.get(kind, (-1e9, False))
        if time.monotonic() - stamp < DISCOVERY_TTL_S:
            return ok
        plural = _PATHS[kind][1]
        try:
            answer = await self.request("GET", f"/apis/{OPTIONAL_KINDS[kind]}")
            ok = any(r.get("name") == plural for r in (answer or {}).get("resources") or ())
        except ApiError as exc:
            if exc.status not in (403, 404):
                raise
            ok = False
        self._served[kind] = (time.monotonic(), ok)
        return ok

    async def list_children(
        self, namespace: str, deployment: str, optional: tuple[str, ...] = ()
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Pods, and the other children (each with ``kind`` set), labelled with the
        deployment's name; ``optional``: served optional kinds to list too."""
        query = {"labelSelector": f"{c.LABEL_DEPLOYMENT}={deployment}"}
        kinds = ("Pod", *CHILD_KINDS, *optional)
        answers = await asyncio.gather(
            *(self.request("GET", _path(kind, namespace), query=query) for kind in kinds)
        )
        out: dict[str, list[dict[str, Any]]] = {}
        for kind, answer in zip(kinds, answers, strict=True):
            items = answer.get("items") or []
            for item in items:
                item["kind"] = kind
            out[kind] = items
        others = [o for kind in (*CHILD_KINDS, *optional) for o in out[kind]]
        return out["Pod"], others

    # -- writes -----------------------------------------------------------------------
    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (forced, field manager ``dwdp-operator``)."""
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            _path(obj["kind"], meta["namespace"], meta["name"]),
            kind=obj["kind"],
            body=obj,
            query={"fieldManager": c.FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def apply_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Server-side apply the operator's part of a DwdpDeployment's status."""
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": {k: v for k, v in status.items() if v is not None},
        }
        await self.request(
            "PATCH",
            _path(KIND, namespace, name, "status"),
            kind=f"{KIND}/status",
            body=body,
            query={"fieldManager": c.FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; False when it already exists (409)."""
        try:
            await self.request(
                "POST",
                _path(obj["kind"], obj["metadata"]["namespace"]),
                kind=obj["kind"],
                body=obj,
                query={"fieldManager": c.FIELD_MANAGER},
            )
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def set_gate(
        self, namespace: str, pod: str, *, ready: bool, message: str, reason: str | None = None
    ) -> None:
        """Set the pod's ``dwdp.io/group-ready`` condition (strategic merge on status:
        the kubelet's own conditions are kept). A pod already gone is not an error."""
        body = {
            "status": {
                "conditions": [
                    gate_condition(ready=ready, message=message, reason=reason, now=now_rfc3339())
                ]
            }
        }
        try:
            await self.request(
                "PATCH",
                _path("Pod", namespace, pod, "status"),
                kind="Pod/status",
                body=body,
                query={"fieldManager": c.FIELD_MANAGER},
                content_type="application/strategic-merge-patch+json",
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def delete(
        self, kind: str, namespace: str, name: str, *, grace_s: int | None = None
    ) -> None:
        """Delete one object (background propagation); gone already is not an error."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_s is not None:
            body["gracePeriodSeconds"] = grace_s
        try:
            await self.request("DELETE", _path(kind, namespace, name), kind=kind, body=body)
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def event(
        self, owner: dict[str, Any], *, reason: str, message: str, type_: str = "Normal"
    ) -> None:
        """Post a core/v1 Event about the DwdpDeployment ``owner``."""
        meta = owner["metadata"]
        stamp = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": c.FIELD_MANAGER},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await self.request("POST", _path("Event", meta["namespace"]), kind="Event", body=body)

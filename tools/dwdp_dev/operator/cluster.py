"""Helpers of the operator's cluster tests: install the CRD, run ``dwdp operator`` as a
process for a test module, and read a DwdpDeployment's status and pods.

``cluster`` is a ``dwdp_dev.devcluster.testing.TestCluster`` (the ``cluster`` fixture of
tests/cluster); nothing here imports pytest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dwdp_dev.operator.process import OperatorProcess

GATE = "dwdp.io/group-ready"
"""The readiness gate condition the operator sets on the pods of a committed group."""


def install_crd(cluster: Any) -> None:
    """Apply the generated DwdpDeployment CRD and wait (30 s at most) until it is served."""
    from dwdp.api.crd import crd_yaml

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd_yaml())

    wait_established(cluster, "dwdpdeployments.dwdp.io", timeout=30)


def wait_established(cluster: Any, name: str, timeout: float = 60) -> None:
    """Wait until CRD ``name`` is Established. Not `kubectl wait`: on a CRD created a moment
    ago it fails on the absent .status.conditions instead of waiting for them."""

    def established() -> bool:
        conditions = cluster.get("crd", name).get("status") or {}
        return any(
            c.get("type") == "Established" and c.get("status") == "True"
            for c in conditions.get("conditions") or ()
        )

    cluster.wait_for(established, timeout=timeout, message=f"the CRD {name} Established")


@contextmanager
def running_operator(cluster: Any, log: Path, **options: Any) -> Iterator[OperatorProcess]:
    """Install the CRD, start ``dwdp operator`` (``options`` go to ``OperatorProcess``),
    yield it, stop it and print the tail of its log (shown by pytest on failure)."""
    install_crd(cluster)
    op = OperatorProcess(cluster.env, log, **options)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(op.log()[-4000:])


STANDIN_IMAGE = "dwdp-rank-standin:dev"
"""The image the test deployments' worker pods name: the test rank program's
(``tools/images/rank-standin``). The process kubelet does not find it in the local store and
runs the pods' command from the host's .venv; a real node runs them from the image, which it
imports under this name too (``dwdp_dev.devcluster.images.LOCAL_NAMES``)."""


def deployment(
    name: str,
    *,
    replicas: int,
    ranks_per_pod: int,
    dwdp_size: int,
    env: dict[str, str] | None = None,
    **spec: Any,
) -> dict:
    """A DwdpDeployment of ``replicas`` context groups of ``dwdp_size`` ranks,
    ``ranks_per_pod`` per pod, run by the test rank program (image :data:`STANDIN_IMAGE`,
    1 s graceful shutdown, 30 s rendezvous timeout); ``env`` goes to every rank, ``spec``
    overrides top-level fields."""
    body: dict[str, Any] = {
        "model": {"path": "/models/tiny"},
        "image": STANDIN_IMAGE,
        "context": {
            "replicas": replicas,
            "ranksPerPod": ranks_per_pod,
            "dwdp": {"dwdpSize": dwdp_size},
        },
        "rendezvous": {"timeoutSeconds": 30},
        "gracefulShutdownTimeoutSeconds": 1,
    }
    if env:
        body["env"] = [{"name": k, "value": v} for k, v in env.items()]
    body.update(spec)
    return {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": name},
        "spec": body,
    }


def status(cluster: Any, ns: str, name: str) -> dict:
    """The status of DwdpDeployment ``ns/name`` (empty before the operator wrote one)."""
    return cluster.get("dwdpdeployment", name, ns).get("status") or {}


def pods(cluster: Any, ns: str, selector: str = "dwdp.io/deployment") -> list[dict]:
    """Every pod of ``ns`` matching the label ``selector``, as JSON objects."""
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json")
    return json.loads(out.stdout)["items"]


def event_messages(cluster: Any, ns: str, reason: str) -> list[str]:
    """The messages of the Events of ``ns`` with ``reason`` (``GroupFailed``, ...)."""
    out = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"reason={reason}", "-o", "json"
    )
    return [e["message"] for e in json.loads(out.stdout)["items"]]


def gated(pod: dict) -> bool:
    """True when the pod's ``dwdp.io/group-ready`` condition is True."""
    return any(
        c.get("type") == GATE and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or ()
    )

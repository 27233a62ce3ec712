"""The pods the operator builds against the real apiserver's Pod validation.

Every valid case of tests/cases/deployments.yaml is built into the worker pods of each role
(pod 0 of group 0, with the ComputeDomain channel claim and the rendezvous Secret where the
operator would add them) and, when the spec runs the router, its Deployment; each object is
created by server-side dry-run with strict field validation. So a spec the API accepts
(pull Secrets, affinity terms, DRA claims, tolerations, security contexts) gives pods the
apiserver accepts too, not a pod refused only when the operator creates it. Uses the
``cluster`` and ``namespace`` fixtures of tests/cluster/conftest.py; no CRD is needed.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import caselib
import pytest
import yaml

from dwdp.api.deployment import parse_deployment
from dwdp.api.enums import HandleType, Role
from dwdp.operator import builders, kube, naming, router
from dwdp.operator import constants as c

REPO = Path(__file__).resolve().parents[2]


VALID = [case for case in caselib.load_cases() if case.valid]
SERVERS = router.RouterServers(prefill=("http://10.0.0.1:8000",), decode=("http://10.0.0.2:8000",))


def _objects(document: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
    """The worker pods (pod 0 of group 0 of every role) and the router Deployment that the
    operator would create for ``document`` in ``namespace``."""
    spec = parse_deployment(document).spec
    owner = builders.Owner(document["metadata"]["name"], namespace, "0a1b2c3d-uid")
    objs = []
    for role, shape in builders.role_shapes(spec).items():
        group = naming.group_name(owner.name, role, 0)
        fabric = (
            role is Role.CONTEXT
            and spec.context.handle_type is HandleType.FABRIC
            and shape.pods_per_group > 1
        )
        secret = naming.rendezvous_secret(group, 0)
        objs.append(
            builders.worker_pod(
                spec,
                owner,
                role=role,
                group_index=0,
                incarnation=0,
                pod_index=0,
                revision=builders.revisions(spec)[role],
                channel_template=naming.channel_claim_template(group, 0) if fabric else None,
                secret=secret if builders.rendezvous_secret_needed(spec, role) else None,
            )
        )
    if spec.router_enabled:
        objs.append(router.router_deployment(spec, owner, SERVERS))
    return objs


def _dry_run_create(cluster, obj: dict[str, Any]) -> dict[str, Any]:
    """Create ``obj`` by server-side dry-run through the operator's own client (dicts, JSON
    as the operator sends it); the object as the apiserver would store it.

    Raises:
        dwdp.operator.kube.ApiError: the apiserver's refusal.
    """
    api = kube.Kube(cluster.api_client())
    path = kube._path(obj["kind"], obj["metadata"]["namespace"])
    query = {"dryRun": "All", "fieldValidation": "Strict", "fieldManager": c.FIELD_MANAGER}
    return asyncio.run(api.request("POST", path, kind=obj["kind"], body=obj, query=query))


def test_every_valid_case_builds_objects_the_apiserver_accepts(cluster, namespace) -> None:
    refused = []
    claims = 0
    for case in VALID:
        for obj in _objects(case.document, namespace):
            claims += len(obj["spec"].get("resourceClaims", ()))
            try:
                _dry_run_create(cluster, obj)
            except kube.ApiError as exc:
                refused.append(f"{case.name} {obj['kind']} {obj['metadata']['name']}: {exc}")
    assert not refused, "\n".join(refused)
    assert claims > 0  # the DRA case (and any fabric group) reached the apiserver with claims


def test_a_dra_pod_keeps_its_claims_pull_secrets_and_affinity(cluster, namespace) -> None:
    """The apiserver's dry-run answer (the pod as it would be stored) holds the GPU claim on
    the pod and its container, no extended GPU resource, the pull Secrets and the affinity
    exactly as built."""
    (case,) = [c for c in VALID if c.name == "affinity-every-kind"]
    patch = {
        "spec": {
            "gpu": {"resourceClaimTemplateName": "h200-x1"},
            "imagePullSecrets": [{"name": "regcred"}],
        }
    }
    document = caselib.merge_patch(case.document, patch)
    (pod,) = [o for o in _objects(document, namespace) if o["kind"] == "Pod"]
    spec = _dry_run_create(cluster, pod)["spec"]
    assert spec["resourceClaims"] == [
        {"name": c.GPU_CLAIM, "resourceClaimTemplateName": "h200-x1"}
    ]
    resources = spec["containers"][0]["resources"]
    assert resources["claims"] == [{"name": c.GPU_CLAIM}]
    assert c.GPU_RESOURCE not in {**resources.get("limits", {}), **resources.get("requests", {})}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["affinity"] == pod["spec"]["affinity"]


def test_the_apiserver_refuses_a_pod_claim_without_its_container_claim(cluster, namespace):
    """The check above has teeth: a pod whose container names a claim the pod does not
    declare is refused (so claims on both levels are what the apiserver needs)."""
    (case,) = [c for c in VALID if c.name == "gpu-dra-claim-template"]
    (pod,) = _objects(case.document, namespace)
    pod["spec"]["resourceClaims"] = []
    with pytest.raises(kube.ApiError, match="claims"):
        _dry_run_create(cluster, pod)


def test_the_dra_section_of_install_md_passes_the_apiserver(cluster, namespace) -> None:
    """docs/install.md's ResourceClaimTemplates (resource.k8s.io/v1, the context pods' and
    the generation pods') and the worker pods of its DRA DwdpDeployment, moved to the test
    namespace, pass server-side dry-run, each role's pod claiming its own template."""
    text = (REPO / "docs" / "install.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    templates = [b for b in blocks if b["kind"] == "ResourceClaimTemplate"]
    for template in templates:
        template["metadata"]["namespace"] = namespace
        cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(template))
    (document,) = [b for b in blocks if b["kind"] == "DwdpDeployment" and "gpu" in b["spec"]]
    gpu = document["spec"]["gpu"]
    wanted = {
        Role.CONTEXT.value: gpu["resourceClaimTemplateName"],
        Role.GENERATION.value: gpu["generationResourceClaimTemplateName"],
    }
    assert set(wanted.values()) == {t["metadata"]["name"] for t in templates}
    pods = [o for o in _objects(document, namespace) if o["kind"] == "Pod"]
    assert {p["metadata"]["labels"][c.LABEL_ROLE] for p in pods} == set(wanted)
    for pod in pods:
        stored = _dry_run_create(cluster, pod)["spec"]
        name = wanted[pod["metadata"]["labels"][c.LABEL_ROLE]]
        claims = [{"name": c.GPU_CLAIM, "resourceClaimTemplateName": name}]
        assert stored["resourceClaims"] == claims

"""The case table against the real apiserver: the CRD's schema and CEL rules.

The generated CRD is applied to the local control plane; every case of
tests/cases/deployments.yaml is then created by server-side dry-run (strict field
validation, as ``kubectl apply`` asks for) and must get the table's verdict, with the
error naming the case's field. A few cases also go through ``kubectl apply
--dry-run=server``, the path a user takes. Uses the ``cluster`` and ``namespace``
fixtures of tests/cluster/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import caselib
import pytest

from dwdp.api.crd import crd_manifest, crd_yaml
from dwdp.api.deployment import GROUP, PLURAL, VERSION
from dwdp_dev.operator.cluster import wait_established

REPO = Path(__file__).resolve().parents[2]


CASES = caselib.load_cases()
CRD_NAME = crd_manifest()["metadata"]["name"]


@pytest.fixture(scope="module")
def crd_installed(cluster):
    """The generated CRD, applied and Established (left installed: later tests use it)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd_yaml())
    wait_established(cluster, CRD_NAME)
    # Discovery lags the Established condition a little; wait until the kind resolves.
    cluster.wait_for(
        lambda: cluster.kubectl("get", PLURAL, "-A", check=False).returncode == 0,
        timeout=30,
        message=f"{PLURAL} served",
    )
    return cluster


def _dry_run_create(cluster, namespace: str, document: dict) -> tuple[bool, str]:
    """Create ``document`` by server-side dry-run; (accepted, error text)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.CustomObjectsApi(cluster.api_client())
    try:
        api.create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            document,
            dry_run="All",
            field_validation="Strict",
        )
    except ApiException as exc:
        return False, _error_text(exc)
    return True, ""


def _error_text(exc) -> str:
    """The apiserver's message and every cause's field and message, as one text."""
    try:
        status = json.loads(exc.body)
    except (TypeError, ValueError):
        return str(exc.body or exc)
    parts = [status.get("message", "")]
    for cause in (status.get("details") or {}).get("causes") or []:
        parts.append(f"{cause.get('field', '')}: {cause.get('message', '')}")
    return "\n".join(parts)


def test_crd_is_established_with_subresources(crd_installed) -> None:
    crd = crd_installed.get("crd", CRD_NAME)
    (version,) = crd["spec"]["versions"]
    assert set(version["subresources"]) == {"status", "scale"}
    assert crd["spec"]["names"]["shortNames"] == ["dwdp"]
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"


def test_every_case_by_server_side_dry_run(crd_installed, namespace) -> None:
    mismatches = []
    for case in CASES:
        accepted, text = _dry_run_create(crd_installed, namespace, case.document)
        if accepted != case.valid:
            mismatches.append(f"{case.name} ({case.rule}): want valid={case.valid}: {text}")
        elif not case.valid and not case.verdict_in(text):
            mismatches.append(f"{case.name}: {case.field} or its message not in: {text}")
    assert not mismatches, "\n".join(mismatches)


def test_kubectl_apply_dry_run_matches(crd_installed, namespace) -> None:
    picked = [c for c in CASES if c.valid][:2] + [c for c in CASES if not c.valid][::15]
    for case in picked:
        proc = crd_installed.kubectl(
            "apply",
            "--dry-run=server",
            "-n",
            namespace,
            "-f",
            "-",
            input=json.dumps(case.document),
            check=False,
        )
        assert (proc.returncode == 0) == case.valid, (case.name, proc.stderr)
        if not case.valid:
            assert case.verdict_in(proc.stderr), (case.name, proc.stderr)


def test_defaults_are_filled_by_the_apiserver(crd_installed, namespace) -> None:
    """The schema defaults reach the object (what the operator reads back)."""
    from kubernetes import client

    (base,) = [c for c in CASES if c.name == "defaults"]
    api = client.CustomObjectsApi(crd_installed.api_client())
    obj = api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, base.document, dry_run="All"
    )
    dwdp = obj["spec"]["context"]["dwdp"]
    assert dwdp["dwdpSize"] == 1 and dwdp["numPrefetchSlots"] == 2
    assert dwdp["enableExperts"] is True and dwdp["enableDense"] is False
    assert obj["spec"]["rendezvous"] == {"port": 29500, "timeoutSeconds": 1800}


def _case_document(name: str) -> dict:
    (case,) = [c for c in CASES if c.name == name]
    return case.document


def test_a_dropped_field_is_refused_strictly_and_pruned_otherwise(crd_installed, namespace):
    """docs/operations.md: under strict field validation (kubectl's default) the apiserver
    refuses a dropped field as unknown; without it the field is dropped from the object."""
    from kubernetes import client

    document = _case_document("dropped-tensor-parallel")
    accepted, text = _dry_run_create(crd_installed, namespace, document)
    assert not accepted and 'unknown field "spec.context.parallel"' in text, text
    proc = crd_installed.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(document), check=False,
    )
    assert proc.returncode != 0 and "unknown field" in proc.stderr, proc.stderr
    for validation in ("Warn", "Ignore"):
        api = client.CustomObjectsApi(crd_installed.api_client())
        obj = api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, document, dry_run="All",
            field_validation=validation,
        )
        assert "parallel" not in obj["spec"]["context"], (validation, obj["spec"]["context"])
        assert obj["spec"]["context"]["maxBatchSize"] == 4  # the rest is kept


def test_an_object_stored_with_a_dropped_field_is_read_without_it(crd_installed, namespace):
    """An object stored while the CRD still declared ``spec.context.parallel`` is read back
    without it once the generated CRD is applied (the apiserver prunes on reads too), so the
    operator's models, which forbid unknown fields, never see it."""
    older = crd_manifest()
    context = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["context"]
    context["properties"]["parallel"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True
    }
    document = caselib.merge_patch(
        _case_document("dropped-tensor-parallel"), {"spec": {"context": {"replicas": 0}}}
    )  # no group: an operator watching the namespace starts no pod
    name = document["metadata"]["name"]
    try:
        crd_installed.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                              input=json.dumps(older))
        crd_installed.wait_for(
            lambda: _dry_run_create(crd_installed, namespace, document)[0],
            timeout=30, message="the older schema served",
        )
        crd_installed.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(document))
        stored = crd_installed.get(PLURAL, name, namespace)
        assert stored["spec"]["context"]["parallel"] == {"tensorParallelSize": 2}
    finally:
        crd_installed.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                              input=crd_yaml())
    crd_installed.wait_for(
        lambda: "parallel" not in crd_installed.get(PLURAL, name, namespace)["spec"]["context"],
        timeout=30, message="the stored object read without the dropped field",
    )
    crd_installed.kubectl("delete", "-n", namespace, PLURAL, name)

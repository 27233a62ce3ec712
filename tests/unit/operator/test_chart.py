"""The Helm chart: lints clean (strict), renders the least-privilege RBAC the README
explains, and carries the same CRD as the generator."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from dwdp.api.crd import crd_manifest

CHART = Path(__file__).resolve().parents[3] / "charts" / "dwdp-operator"


@pytest.fixture(scope="module")
def helm() -> str:
    try:
        from dwdp.devcluster.tools import ensure_tools

        return str(ensure_tools() / "helm")
    except Exception as exc:  # no network and no cached tools
        pytest.skip(f"helm is not available: {exc}")


def render(helm: str, *sets: str) -> list[dict]:
    args = [helm, "template", "t", str(CHART), "--namespace", "ops"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("sets", [(), ("webhook.enabled=true", "watchNamespaces[0]=a")])
def test_lint_strict(helm: str, sets: tuple[str, ...]) -> None:
    args = [helm, "lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_values_schema_refuses_unknown_values(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "t", str(CHART), "--set", "webhook.failurePolicy=Maybe"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "failurePolicy" in proc.stderr


def test_rbac_is_exactly_the_documented_set(helm: str) -> None:
    role = next(d for d in render(helm) if d["kind"] == "ClusterRole")
    got = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    want = {
        ("dwdp.io", "dwdpdeployments", "get"),
        ("dwdp.io", "dwdpdeployments", "list"),
        ("dwdp.io", "dwdpdeployments", "watch"),
        ("dwdp.io", "dwdpdeployments/status", "patch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods/status", "patch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "create"),
        ("discovery.k8s.io", "endpointslices", "patch"),
        ("discovery.k8s.io", "endpointslices", "delete"),
        ("networking.k8s.io", "networkpolicies", "list"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("networking.k8s.io", "networkpolicies", "patch"),
        ("networking.k8s.io", "networkpolicies", "delete"),
        ("apps", "deployments", "list"),
        ("apps", "deployments", "create"),
        ("apps", "deployments", "patch"),
        ("apps", "deployments", "delete"),
        ("scheduling.k8s.io", "podgroups", "list"),
        ("scheduling.k8s.io", "podgroups", "create"),
        ("scheduling.k8s.io", "podgroups", "delete"),
        ("resource.nvidia.com", "computedomains", "list"),
        ("resource.nvidia.com", "computedomains", "create"),
        ("resource.nvidia.com", "computedomains", "delete"),
        ("", "secrets", "create"),
        ("", "secrets", "delete"),
        ("", "events", "create"),
    } | {
        ("", kind, verb)
        for kind in ("configmaps", "services")
        for verb in ("list", "create", "patch", "delete")
    }
    assert got == want
    readme = (CHART / "README.md").read_text()
    for _, resource, verb in want:
        assert f"`{resource.split('/')[0]}" in readme and f"`{verb}`" in readme


def test_deployment_runs_dwdp_operator_under_the_service_account(helm: str) -> None:
    docs = render(helm, "webhook.enabled=true", "workerCommand=python -m x")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert ctr["command"] == ["dwdp", "operator"]
    assert pod["serviceAccountName"] == "t-dwdp-operator"
    assert ctr["args"][:2] == ["--liveness", "http://$(POD_IP):8080/healthz"]
    assert ctr["args"][2:5] == ["--leader-elect", "--leader-elect-name", "t-dwdp-operator"]
    assert ctr["args"][5:7] == ["--worker-command", "python -m x"]
    assert "--webhook-cert-dir" in ctr["args"]
    hook = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    assert hook["webhooks"][0]["clientConfig"]["service"]["path"] == "/validate/spec-rules"
    assert {d["kind"] for d in render(helm)} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
    }


def test_chart_crd_is_the_generated_crd() -> None:
    files = list((CHART / "crds").glob("*.yaml"))
    assert [f.name for f in files] == ["dwdp.io_dwdpdeployments.yaml"]
    assert yaml.safe_load(files[0].read_text()) == crd_manifest()


def test_leader_election_is_a_namespaced_role_on_leases_only(helm: str) -> None:
    docs = render(helm)
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args
    single = render(helm, "leaderElection=false", "replicas=1")
    assert not any(d["kind"] == "Role" for d in single)
    deployment = next(d for d in single if d["kind"] == "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"

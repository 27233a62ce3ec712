"""The Helm chart: lints clean (strict), renders the least-privilege RBAC the README
explains, carries the same CRD as the generator, renders the placement and image values of
a real cluster (ci/gpu-cluster-values.yaml), and its values schema refuses wrong types
naming the field."""

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
        from dwdp_dev.devcluster.tools import ensure_tools

        return str(ensure_tools() / "helm")
    except Exception as exc:  # no network and no cached tools
        pytest.skip(f"helm is not available: {exc}")


GPU_VALUES = CHART / "ci" / "gpu-cluster-values.yaml"


def render(helm: str, *sets: str, values: Path | None = None) -> list[dict]:
    args = [helm, "template", "t", str(CHART), "--namespace", "ops"]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize(
    "options",
    [
        (),
        ("--set", "webhook.enabled=true", "--set", "watchNamespaces[0]=a"),
        ("-f", str(GPU_VALUES)),
    ],
    ids=["defaults", "webhook", "gpu-cluster"],
)
def test_lint_strict(helm: str, options: tuple[str, ...]) -> None:
    proc = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *options], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_values_schema_refuses_unknown_values(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "t", str(CHART), "--set", "webhook.failurePolicy=Maybe"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "failurePolicy" in proc.stderr


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("image.tag=3", "/image/tag"),  # a number: --set-string is needed for such tags
        ("image.digest=latest", "/image/digest"),
        ("image.repository=reg.io/op:1.0", "/image/repository"),  # the tag has its own value
        ("imagePullSecrets[0]=regcred", "/imagePullSecrets/0"),
        ("imagePullSecrets[0].secret=regcred", "/imagePullSecrets/0"),
        ("replicas=two", "/replicas"),
        ("nodeSelector.gpu=true", "/nodeSelector/gpu"),
        ("tolerations[0].operator=Maybe", "/tolerations/0/operator"),
        ("tolerations[0].effect=NoRun", "/tolerations/0/effect"),
        ("tolerations[0].tolerationSeconds=soon", "/tolerations/0/tolerationSeconds"),
        ("affinity.nodeSelector.a=b", "/affinity"),
        ("resources.requests.cpu=true", "/resources/requests/cpu"),
        ("resources.limit.cpu=1", "/resources"),
        ("podSecurityContext.runAsUser=root", "/podSecurityContext/runAsUser"),
        ("securityContext.readOnlyRootFilesystem=yes", "/securityContext/readOnlyRootFilesystem"),
        ("priorityClassName[0]=high", "/priorityClassName"),
        ("leaderElection=maybe", "/leaderElection"),
    ],
)
def test_values_schema_refuses_wrong_types_naming_the_field(
    helm: str, value: str, field: str
) -> None:
    proc = subprocess.run(
        [helm, "template", "t", str(CHART), "--set", value],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0, proc.stdout[:400]
    assert field in proc.stderr, proc.stderr


def test_values_have_no_kopf_peering_the_lease_is_the_only_ha(helm: str) -> None:
    proc = subprocess.run(
        [helm, "template", "t", str(CHART), "--set", "peering=dwdp"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0, proc.stdout[:400]
    assert "peering" in proc.stderr, proc.stderr


def test_image_defaults_to_the_app_version_and_a_digest_wins(helm: str) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())

    def image(*sets: str) -> str:
        dep = next(d for d in render(helm, *sets) if d["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["image"]

    assert image() == f"ghcr.io/dwdp/dwdp-operator:{chart['appVersion']}"
    assert image("image.repository=reg.io:5000/ml/op", "image.tag=v1") == "reg.io:5000/ml/op:v1"
    digest = "sha256:" + "ab" * 32
    assert image("image.tag=v1", f"image.digest={digest}") == f"ghcr.io/dwdp/dwdp-operator@{digest}"


def test_gpu_cluster_values_reach_the_operator_pod(helm: str) -> None:
    values = yaml.safe_load(GPU_VALUES.read_text())
    dep = next(d for d in render(helm, values=GPU_VALUES) if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert ctr["image"] == "registry.example.com/ml/dwdp-operator:0.1.0"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert ctr["resources"] == values["resources"]
    defaults = render(helm)
    pod = next(d for d in defaults if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in pod and "priorityClassName" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    sc = pod["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}


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

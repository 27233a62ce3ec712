"""The Helm chart on the local control plane: it renders objects the apiserver accepts, and
an installed release runs ``dwdp operator`` as a pod under the chart's ServiceAccount, which
reconciles an example (so the RBAC is enough) and is refused a verb the chart does not grant.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dwdp.devcluster.testing import TestCluster
from dwdp.operator.testing.process import RANKPROG_COMMAND

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "dwdp-operator"
RELEASE = "dwdp"
SA = f"{RELEASE}-dwdp-operator"


def test_helm_template_passes_server_dry_run(cluster: TestCluster, namespace: str) -> None:
    rendered = cluster.helm(
        "template",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--include-crds",
        "--set",
        "webhook.enabled=true",
    ).stdout
    out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered)
    kinds = {line.split("/")[0] for line in out.stdout.splitlines()}
    assert {
        "customresourcedefinition.apiextensions.k8s.io",
        "serviceaccount",
        "clusterrole.rbac.authorization.k8s.io",
        "clusterrolebinding.rbac.authorization.k8s.io",
        "deployment.apps",
        "secret",
        "service",
        "validatingwebhookconfiguration.admissionregistration.k8s.io",
    } <= kinds


def token_kubeconfig(cluster: TestCluster, token: str, folder: Path) -> Path:
    """A kubeconfig for the admin's cluster entry with only ``token`` as credentials."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    entry = admin["clusters"][0]
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [entry],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": entry["name"], "user": "sa"}}],
        "current-context": "sa",
    }
    path = folder / "sa.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_helm_install_runs_the_operator_under_its_rbac(
    cluster: TestCluster, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        ns,
        "--set",
        f"workerCommand={RANKPROG_COMMAND}",
        "--set",
        f"watchNamespaces[0]={ns}",
        "--set",
        "computeDomains=off",  # 02-small is fabric across 2 pods; no ComputeDomain CRD here
        "--wait",
        "--timeout",
        "120s",
    )
    try:
        pod = cluster.wait_for(
            lambda: next(
                (
                    p
                    for p in json.loads(
                        cluster.kubectl(
                            "get",
                            "pods",
                            "-n",
                            ns,
                            "-l",
                            f"app.kubernetes.io/instance={RELEASE}",
                            "-o",
                            "json",
                        ).stdout
                    )["items"]
                    if p["status"].get("phase") == "Running"
                ),
                None,
            ),
            timeout=60,
            message="operator pod running",
        )
        assert pod["spec"]["serviceAccountName"] == SA
        assert pod["spec"]["containers"][0]["command"] == ["dwdp", "operator"]

        doc = yaml.safe_load((REPO / "examples" / "02-small.yaml").read_text())
        cluster.apply(ns, doc)

        def ready() -> bool:
            status = cluster.get("dwdp", "small", ns).get("status") or {}
            return status.get("phase") == "Ready" and status.get("readyGroups") == 1

        try:
            cluster.wait_for(ready, timeout=120, interval=0.5, message="small Ready")
        except AssertionError:
            log = cluster.pod_log(ns, pod["metadata"]["name"])
            raise AssertionError(f"not Ready; operator log:\n{log[-4000:]}") from None

        # The chart's ServiceAccount, with its own token: granted verbs work, others do not.
        token = cluster.kubectl("create", "token", SA, "-n", ns).stdout.strip()
        as_sa = ("--kubeconfig", str(token_kubeconfig(cluster, token, tmp_path)))
        allowed = cluster.kubectl("get", "dwdp", "-n", ns, *as_sa, check=False)
        assert allowed.returncode == 0, allowed.stderr
        for verb in (
            ("delete", "dwdp", "small", "-n", ns),
            ("get", "secrets", "-n", ns),
            ("patch", "dwdp", "small", "-n", ns, "--type=merge", "-p", '{"spec":{"image":"x"}}'),
        ):
            denied = cluster.kubectl(*verb, *as_sa, check=False)
            assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), (
                verb,
                denied.stderr,
            )
        assert cluster.exists("dwdp", "small", ns)
        can = cluster.kubectl(
            "auth",
            "can-i",
            "patch",
            "pods",
            "--subresource=status",
            "-n",
            ns,
            f"--as=system:serviceaccount:{ns}:{SA}",
            check=False,
        )
        assert can.stdout.strip() == "yes"
        cluster.kubectl("delete", "dwdp", "small", "-n", ns, "--wait=true", "--timeout=60s")
    finally:
        cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", check=False)

"""The operator image from the daemonless cached build (dwdp_dev.devcluster.images), run as an
image: as its non-root user its ``dwdp --version`` is the repository's, and the kubelet runs a
pod naming it from its root filesystem (entrypoint, user, working directory, environment,
volumes and the service-account token inside). A pod naming an image the store lacks does not
start (``ErrImageNeverPull``: nothing is pulled from outside)."""

from __future__ import annotations

import dwdp
from dwdp_dev.devcluster import images
from dwdp_dev.devcluster.testing import TestCluster, run_in_image


def test_image_runs_as_non_root_and_its_dwdp_is_the_repository_version(
    operator_image: images.StoredImage,
) -> None:
    config = images.image_config(operator_image)
    user = str(config["User"])
    assert int(user.split(":")[0]) != 0 and int(user.split(":")[1]) != 0, user
    assert config["Entrypoint"] == ["dwdp"] and config["Cmd"] == ["operator"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == dwdp.__version__
    out = run_in_image(operator_image, "sh", "-c", 'id -u; cd "$HOME"; dwdp --version')
    assert out.returncode == 0, out
    uid, version = out.stdout.split("\n", 1)
    assert uid == user.split(":")[0]
    assert version.strip() == f"dwdp {dwdp.__version__}"


def test_kubelet_runs_a_pod_from_its_image(
    cluster: TestCluster, namespace: str, operator_image: images.StoredImage
) -> None:
    ns = namespace
    script = (
        "id -u; id -g; pwd; echo $PATH; cat /etc/cfg/greeting; echo;"
        " cat /var/run/secrets/kubernetes.io/serviceaccount/namespace; echo;"
        " test -s /var/run/secrets/kubernetes.io/serviceaccount/token && echo token;"
        " touch /scratch/x && echo scratch; touch /tmp/x 2>/dev/null || echo read-only;"
        " dwdp --version"
    )
    cluster.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg"},
            "data": {"greeting": "hi"},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "from-image"},
            "spec": {
                "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": True},
                "containers": [
                    {
                        "name": "main",
                        "image": operator_image.reference,
                        "command": ["sh", "-c", script],
                        "workingDir": "/srv",
                        "securityContext": {
                            "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": [
                            {"name": "cfg", "mountPath": "/etc/cfg"},
                            {"name": "scratch", "mountPath": "/scratch"},
                        ],
                    },
                    {"name": "version", "image": operator_image.reference, "args": ["--version"]},
                ],
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "scratch", "emptyDir": {}},
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "no-image"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "dwdp-not-stored:1",
                        "imagePullPolicy": "Never",
                        "command": ["python", "-c", "import dwdp; print(dwdp.__file__)"],
                    }
                ],
            },
        },
    )

    def done(name: str) -> dict | None:
        pod = cluster.get("pod", name, ns)
        return pod if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    pod = cluster.wait_for(lambda: done("from-image"), timeout=120, message="from-image done")
    logs = cluster.pod_log(ns, "from-image", "main")
    assert pod["status"]["phase"] == "Succeeded", logs
    for status in pod["status"]["containerStatuses"]:
        assert status["imageID"] == operator_image.image_id
    lines = logs.splitlines()
    assert lines[:3] == ["1000", "1000", "/srv"], logs
    assert lines[3].startswith("/opt/dwdp/bin:"), logs
    assert lines[4:] == [
        "hi",
        ns,
        "token",
        "scratch",
        "read-only",
        f"dwdp {dwdp.__version__}",
    ], logs
    version = cluster.pod_log(ns, "from-image", "version").strip()
    assert version == f"dwdp {dwdp.__version__}"

    def never_pulled() -> bool:
        statuses = cluster.get("pod", "no-image", ns).get("status", {}).get("containerStatuses")
        waiting = (statuses or [{}])[0].get("state", {}).get("waiting") or {}
        return waiting.get("reason") == "ErrImageNeverPull"

    cluster.wait_for(never_pulled, timeout=60, message="no-image: ErrImageNeverPull")

"""The worker image from the daemonless cached build (dwdp_dev.devcluster.images) serving a CPU
DWDP group (issue 19): a DwdpDeployment naming the stored worker image, one context group of
2 ranks in one pod (cpu backend, shm handles, expert DWDP) over the tiny demo checkpoint, run
by the real worker (``dwdp launch``) from the image's root filesystem. Its pod reports the
stored digest as its imageID, the group commits, every rank answers the demo's greedy
requests as a single process with replicated weights does, and the rank processes run as
the image's non-root user 1000.

The first run builds the image (about 6 GB of torch and CUDA wheels: minutes); later runs
reuse it while its inputs are unchanged.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dwdp_dev.devcluster import images
from dwdp_dev.devcluster.testing import TestCluster, demo_driver, run_in_image
from dwdp_dev.operator.cluster import pods, running_operator

pytestmark = pytest.mark.timeout(1800)
demo = demo_driver()
NAME = "img"
WORKER = "dwdp launch --host $(DWDP_POD_IP)"
"""The operator's default worker command (the module's other operators run the rank program)."""


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[Path, list[str]]]:
    """The demo checkpoint in a folder every user can read, and the reference's answers."""
    models = Path(tempfile.mkdtemp(prefix="dwdp-img-models-"))
    models.chmod(0o755)  # the ranks read it as uid 1000 (the model's copy is readable by all)
    model_dir = demo.make_model(models)
    yield models, demo.reference_answers(model_dir)


def manifest(models: Path, image: str) -> dict:
    return {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {
                "hostPath": str(models),
                "mountPath": "/models",
                "path": f"/models/{demo.MODEL_DIR}",
                "servedName": demo.MODEL_DIR,
            },
            "image": image,
            "env": [
                {"name": "OMP_NUM_THREADS", "value": "1"},
                {"name": "MKL_NUM_THREADS", "value": "1"},
            ],
            "context": {
                "replicas": 1,
                "ranksPerPod": 2,
                "handleType": "shm",
                "dwdp": {"dwdpSize": 2},
                "maxBatchSize": 4,
            },
            "rendezvous": {"timeoutSeconds": 300},
            "gracefulShutdownTimeoutSeconds": 5,
        },
    }


def processes_of(group: str) -> dict[int, int]:
    """pid -> real uid of every process whose environment names DWDP group ``group``."""
    want = f"DWDP_GROUP={group}".encode()
    out: dict[int, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if want not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        out[int(proc.name)] = int(uid)
    return out


def test_the_worker_image_ships_the_router(worker_image: images.StoredImage) -> None:
    """The operator runs a deployment's router from the deployment's image (the router gate
    starts ``vllm-router``): the image's user finds it on the image's PATH and it runs."""
    out = run_in_image(worker_image, "vllm-router", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: vllm-router"), out


def test_a_cpu_group_of_two_ranks_serves_from_the_worker_image(
    cluster: TestCluster,
    namespace: str,
    worker_image: images.StoredImage,
    model: tuple[Path, list[str]],
    tmp_path: Path,
) -> None:
    models, want = model
    ns = namespace
    start = time.monotonic()
    rootfs = images.unpack(worker_image)  # once per digest; the kubelet reuses it
    cluster.import_images()  # built after the cluster started: a real node imports it now
    print(f"worker image unpacked at {rootfs} in {time.monotonic() - start:.0f} s")
    log = tmp_path / "operator.log"
    with running_operator(cluster, log, extra_args=("--worker-command", WORKER)):
        cluster.apply(ns, manifest(models, worker_image.reference))
        try:
            took = demo.wait_ready(cluster, ns, NAME, groups=1, timeout=900, show=print)
        except AssertionError:
            for p in pods(cluster, ns):
                print(cluster.kubectl("logs", p["metadata"]["name"], "-n", ns, check=False).stdout)
            raise
        print(f"apply -> Ready: {took:.1f} s")

        (pod,) = [p for p in pods(cluster, ns) if not p["metadata"].get("deletionTimestamp")]
        statuses = pod["status"]["containerStatuses"]
        # the operator asked for the image by its reference, and the node ran that image (its
        # manifest digest; a real node reports one of the image's names as ``image``, the
        # local name dwdp-worker:dev too)
        assert all(c["image"] == worker_image.reference for c in pod["spec"]["containers"])
        assert [s["imageID"] for s in statuses] == [worker_image.image_id] * len(statuses)
        group = pod["metadata"]["labels"]["dwdp.io/group"]
        status = cluster.get("dwdp", NAME, ns)["status"]
        assert [(g["name"], g["phase"], g["ranksReady"]) for g in status["groups"]] == [
            (group, "Serving", 2)
        ]

        endpoints = demo.service_endpoints(cluster, ns, NAME)
        assert len(endpoints) == 2, endpoints  # one port per rank
        res = demo.ask_everyone(endpoints, want)
        bad = [(ep.url, path, got) for ep, path, got, same in res.rows if not same]
        assert not bad, f"answers differ from the reference {want}: {bad}"
        assert len(res.rows) == 2 * len(want)

        procs = processes_of(group)
        # the launcher and its 2 rank processes (at least), every one as the image's user
        assert len(procs) >= 3, procs
        assert set(procs.values()) == {1000}, procs
        assert os.getuid() == 0  # the kubelet dropped them from root
        cluster.kubectl("delete", "dwdp", NAME, "-n", ns, "--wait=true", "--timeout=60s")

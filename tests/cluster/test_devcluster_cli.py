"""The ``dwdp dev`` command line and the cluster's served APIs, against the test cluster."""

from __future__ import annotations

import json
import subprocess
import sys

from dwdp_dev.devcluster.cluster import routed_pod_nets
from dwdp_dev.devcluster.testing import TestCluster


def dwdp_dev(cluster: TestCluster, *args: str) -> subprocess.CompletedProcess:
    """Run ``dwdp dev ARGS --state-dir <test cluster>`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "dwdp", "dev", *args, "--state-dir", str(cluster.state_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_status_reports_running_cluster(cluster: TestCluster) -> None:
    """``dwdp dev status`` exits 0 and lists every component with a pid and a Ready node."""
    proc = dwdp_dev(cluster, "status")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["apiserver_ready"] is True
    assert all(st["components"].values()), st["components"]
    assert st["nodes_ready"] and all(st["nodes_ready"].values())


def test_up_is_idempotent(cluster: TestCluster) -> None:
    """A second ``dwdp dev up`` on a running cluster starts nothing new."""
    before = cluster.cluster.running()
    proc = dwdp_dev(cluster, "up")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cluster.cluster.running() == before


def test_kubeconfig_command_prints_path(cluster: TestCluster) -> None:
    """``dwdp dev kubeconfig`` prints the admin kubeconfig that kubectl uses."""
    proc = dwdp_dev(cluster, "kubeconfig")
    assert proc.returncode == 0
    assert proc.stdout.strip() == str(cluster.kubeconfig)


def test_served_apis_and_tools(cluster: TestCluster) -> None:
    """The Workload/PodGroup API is served, the node has GPU capacity, helm talks to it."""
    res = cluster.kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name").stdout
    assert "podgroups.scheduling.k8s.io" in res.split()
    assert "workloads.scheduling.k8s.io" in res.split()
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert nodes and all(int(n["status"]["capacity"]["nvidia.com/gpu"]) > 0 for n in nodes)
    assert cluster.helm("list", "-A").returncode == 0
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.3")


def test_api_client_fixture(cluster: TestCluster, namespace: str) -> None:
    """``api_client()`` is an admin kubernetes client; the namespace fixture made a namespace
    with its default ServiceAccount."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())
    assert core.read_namespace(namespace).status.phase == "Active"
    assert core.read_namespaced_service_account("default", namespace).metadata.name == "default"


def test_clusters_side_by_side_get_their_own_pod_networks(tmp_path) -> None:
    """Two clusters started one after the other (real nodes, beside the session's: each in a
    network namespace of its own), neither given a pod network, route /16s that differ and
    both get Ready, and ``down`` of the second leaves the first one's route in place."""

    def dev(state, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dwdp", "dev", *args, "--state-dir", str(state)],
            capture_output=True, text=True, timeout=180, check=False,
        )

    first, second = tmp_path / "first", tmp_path / "second"
    try:
        for state in (first, second):
            up = dev(state, "up", "--images", "")  # no image: no pod runs here
            assert up.returncode == 0, up.stdout + up.stderr
        nets = [json.loads((s / "cluster.json").read_text())["pod_net"] for s in (first, second)]
        assert nets[0] != nets[1]
        assert set(nets) <= routed_pod_nets()
        down = dev(second, "down", "--purge")
        assert down.returncode == 0, down.stdout + down.stderr
        assert nets[0] in routed_pod_nets() and nets[1] not in routed_pod_nets()
    finally:
        for state in (second, first):
            dev(state, "down", "--purge")

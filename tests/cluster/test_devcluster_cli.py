"""The ``dwdp dev`` command line and the cluster's served APIs, against the test cluster."""

from __future__ import annotations

import json
import subprocess
import sys

from dwdp.devcluster.testing import TestCluster


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

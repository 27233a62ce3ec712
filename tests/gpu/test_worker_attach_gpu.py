"""DWDP attached to real transformers models on CUDA: 4 rank processes on one GPU share
their stores through POSIX file descriptors; greedy tokens and logits must be bitwise those
of the replicated model on the same GPU, for expert + dense DWDP, every copy mode (per_slice,
batched, gather) and both gather kernels (register, tma), with 2 and 3 slots; and for
block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-MoE) served through the FP8 GEMMs, whose
stores hold the FP8 tables and their scales.

The gather kernel is resolved once per manager (dense, expert) from ``attach``'s
``gather_kernel``; each rank reports the kernel its managers hold, and torch's SM carveout
is the gather's SM reserve while DWDP is attached with ``reserve_model_sms`` (the gather
scenarios) and unset after ``close``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from ports import free_port

torch = pytest.importorskip("torch")

from dwdp.worker.transport.base import make_secret_file  # noqa: E402

WORLD = 4
ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
MODES = (
    (2, "per_slice", None),
    (3, "batched", None),
    (2, "gather", "register"),
    (3, "gather", "tma"),
)
SCENARIOS = [(arch, slots, mode, kernel) for arch in ARCHS for slots, mode, kernel in MODES]
# block-scaled FP8 checkpoints (hidden 256, experts of 128) served through the GPU path's FP8
# GEMMs (``use_cuda_kernels``): their stores and gathers move FP8 bytes and scales
FP8_ARCHS = ("deepseek_v3", "qwen3_moe")
SCENARIOS += [(f"{a}-fp8", 2, "gather", "register") for a in FP8_ARCHS]
SCENARIOS += [(f"{a}-fp8", 3, "batched", None) for a in FP8_ARCHS]

CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from pathlib import Path
    from dwdp.api.enums import CopyMode, GatherKernel, HandleType
    from dwdp.api.partition import expert_partition
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.engine.protocol import SamplingParams

    rank, port, group, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    scenarios = json.loads(sys.argv[5])
    ckpts = json.loads(sys.argv[6])
    prompts = ["Hello world, the", "What is the capital of France? Paris", "a", "The quick"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    torch.cuda.set_device(0)

    def prepared(arch):
        model, tok = load_checkpoint(ckpts[arch])
        model.to("cuda:0")
        if arch.endswith("-fp8"):
            from dwdp.worker.gpu.cuda_path import use_cuda_kernels
            use_cuda_kernels(model)
        return model, tok

    def run(model, tok):
        engine = ContinuousEngine(model, tok, model_name="x")
        ids = [tok(p)["input_ids"] for p in prompts]
        res = engine.run_batch(ids, params, keep_logits=True)
        return [(r.token_ids, torch.stack(r.logits)) for r in res]

    if rank == "ref":
        for arch in sorted(ckpts):
            model, tok = prepared(arch)
            torch.save(run(model, tok), out / f"ref.{arch}.pt")
        sys.exit(0)

    from dwdp.worker.bringup import attach
    from dwdp.worker.backend.cuda import CudaBackend
    from dwdp.worker.models import adapter_for
    from dwdp.worker.settings import CopySettings
    from dwdp.worker.transport.base import RendezvousConfig, read_secret
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    rank = int(rank)
    config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=4,
                              secret=read_secret(os.environ), address=("127.0.0.1", port),
                              timeout_s=240)
    backend = CudaBackend(device=0, handle_type=HandleType.POSIX_FD)
    with TcpStoreTransport(config) as transport:
        for index, (arch, slots, mode, kernel) in enumerate(scenarios):
            model, tok = prepared(arch)
            adapter = adapter_for(model)
            e = adapter.moe_layers(model)[0].num_experts
            att = attach(model, adapter, backend=backend, transport=transport,
                         partition=expert_partition(e, 4), enable_dense=True,
                         num_slots=slots,
                         settings=CopySettings(copy_mode=CopyMode(mode),
                                               gather_kernel=GatherKernel(kernel) if kernel
                                               else None,
                                               reserve_model_sms=mode == "gather"))
            torch.save(run(model, tok), out / f"dwdp.{index}.{rank}.pt")
            status = att.status()
            status["gather_kernels"] = [str(m.gather.kernel) for m in (att.dense, att.experts)]
            status["carveout"] = torch._C._get_sm_carveout_experimental()
            status["expert_dtypes"] = sorted({str(t.dtype) for m in adapter.moe_layers(model)
                                              for t in m.expert_tensors().values()})
            torch.cuda.synchronize()
            transport.barrier(label=f"done{index}")
            att.close()
            status["carveout_after_close"] = torch._C._get_sm_carveout_experimental()
            (out / f"status.{index}.{rank}.json").write_text(json.dumps(status))
    backend.close()
    """
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dwdp_dev.worker.checkpoint import make_checkpoint
    from dwdp_dev.worker.fp8_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("gpu")
    ckpts = {a: str(make_checkpoint(a, root / a, num_experts=6, seed=9)) for a in ARCHS}
    for a in FP8_ARCHS:
        src = make_checkpoint(a, root / f"{a}-bf16", num_experts=6, seed=9, hidden_size=256,
                              moe_width=128, dtype="bfloat16")
        ckpts[f"{a}-fp8"] = str(quantize_checkpoint(src, root / f"{a}-fp8"))
    script = root / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "DWDP_RENDEZVOUS_SECRET_FILE": str(make_secret_file(root))}
    args = [json.dumps(SCENARIOS), json.dumps(ckpts)]
    ref = subprocess.run(
        [sys.executable, str(script), "ref", "0", "-", str(root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    port, group = free_port(), f"g{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), group, str(root), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    for p, (_o, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return root


@pytest.mark.parametrize(("arch", "slots", "mode", "kernel"), SCENARIOS)
def test_bitwise_equal_to_replicated_on_gpu(run, arch, slots, mode, kernel):
    index = SCENARIOS.index((arch, slots, mode, kernel))
    want = torch.load(run / f"ref.{arch}.pt")
    digests = set()
    for rank in range(WORLD):
        got = torch.load(run / f"dwdp.{index}.{rank}.pt")
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
            assert tokens == ref_tokens, (arch, rank)
            assert torch.equal(logits, ref_logits), (arch, rank, (logits - ref_logits).abs().max())
        status = json.loads((run / f"status.{index}.{rank}.json").read_text())
        assert status["backend"] == "cuda" and status["leaks"] == 0
        assert status["bytes_moved_remote"] > 0
        # both managers hold the kernel asked for (register: the backend's default)
        assert status["gather_kernels"] == [kernel or "register"] * 2
        # the SMs that kernel holds (it copies this rank's own rows in every mode)
        assert 1 <= status["sm_reserve"] < torch.cuda.get_device_properties(0).multi_processor_count
        # with reserve_model_sms (the gather scenarios) the model's persistent GEMMs leave
        # those SMs free while attached; close gives them back
        assert status["carveout"] == (status["sm_reserve"] if mode == "gather" else None)
        assert status["sm_reserve_model"] == (status["sm_reserve"] if mode == "gather" else 0)
        assert status["carveout_after_close"] is None
        fp8 = ["torch.float32", "torch.float8_e4m3fn"]
        assert (status["expert_dtypes"] == fp8) == arch.endswith("-fp8")
        digests.add(status["layout_digest"])
    assert len(digests) == 1

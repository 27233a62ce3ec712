"""What the GPU benches share: rank processes on one GPU and DWDP attached to a loaded model.

``spawn_ranks`` starts ``world`` copies of a bench script (``--rank r`` plus the group's
arguments) that share the GPU through POSIX fds and one TCP store; ``load`` puts a checkpoint on
the GPU and attaches DWDP to it when asked (a collective: every rank calls it alike).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any


def spawn_ranks(script: str, world: int, work: Path, extra: list[str]) -> list[int]:
    """Run ``world`` rank processes of ``script`` to their end; returns their exit codes."""
    from dwdp.worker.transport.base import make_secret_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "DWDP_RENDEZVOUS_SECRET_FILE": str(make_secret_file(work))}
    common = ["--world", str(world), "--group", f"b{uuid.uuid4().hex[:8]}", "--port", str(port),
              *extra]
    procs = [subprocess.Popen([sys.executable, script, "--rank", str(r), *common], env=env)
             for r in range(world)]
    return [p.wait() for p in procs]


def group_transport(rank: int, world: int, group: str, port: int) -> Any:
    """The rank's TCP store transport (a context manager) of the bench's group."""
    from dwdp.worker.transport.base import RendezvousConfig, read_secret
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    config = RendezvousConfig(group=group, incarnation="bench", rank=rank, world_size=world,
                              secret=read_secret(os.environ), address=("127.0.0.1", port),
                              timeout_s=600)
    return TcpStoreTransport(config)


def load(ckpt: str, *, backend: Any = None, transport: Any = None, world: int = 1,
         dense: bool = False, slots: int = 2, mode: str | None = None,
         kernel: str | None = None, kernels: str = "fused",
         copy_settings: dict | None = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, attachment)``: the checkpoint on cuda:0 with the worker's GPU
    kernels and attention (``use_cuda_kernels``, ``use_paged_attention``; ``kernels``:
    ``fused`` (the worker's), ``compiled-combine`` = fused but the experts' combine through
    ``torch.compile`` instead of the Triton kernel, ``eager`` = without the
    compiled ones, ``transformers`` = its own), with DWDP
    attached when a ``backend`` is given (expert DWDP, dense too when ``dense``;
    ``copy_settings``: other ``CopySettings`` fields, e.g. ``gather_blocks``); attachment
    ``None`` else."""
    from dwdp.api.enums import CopyMode, GatherKernel
    from dwdp.api.partition import expert_partition
    from dwdp.worker.bringup import attach
    from dwdp.worker.engine.paged import use_paged_attention
    from dwdp.worker.gpu.cuda_path import use_cuda_kernels
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.models import adapter_for
    from dwdp.worker.settings import CopySettings

    model, tok = load_checkpoint(ckpt)
    model.to("cuda:0")
    if kernels != "transformers":
        use_cuda_kernels(model, fuse=kernels != "eager",
                         triton_combine=kernels != "compiled-combine")
        use_paged_attention(model)
    if backend is None:
        return model, tok, None
    adapter = adapter_for(model)
    experts = adapter.moe_layers(model)[0].num_experts
    settings = CopySettings(copy_mode=CopyMode(mode or "gather"),
                            gather_kernel=GatherKernel(kernel) if kernel else None,
                            **(copy_settings or {}))
    att = attach(model, adapter, backend=backend, transport=transport,
                 partition=expert_partition(experts, world), enable_dense=dense,
                 num_slots=slots, settings=settings)
    return model, tok, att


def add_group_arguments(ap: Any, *, layers: int) -> None:
    """The arguments every GPU bench takes (``--layers``, ``--world``, ``--out``,
    ``--workdir``) and the hidden ones its rank processes get from ``run_group``."""
    import argparse

    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    for hidden in ("--group", "--ckpt", "--ckpt-fp8", "--result"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)


def run_group(script: str, args: Any, extra: list[str], before: Any = None,
              fp8: bool = False) -> tuple[Any, Any]:
    """Write the seeded Qwen3-MoE checkpoint of ``args.layers`` layers (drawn on cuda:0; with
    ``fp8`` also its block-scaled FP8 twin, passed as ``--ckpt-fp8``), call
    ``before()`` (a measurement of the parent process, or ``None``), run ``args.world`` rank
    processes of ``script`` with ``extra`` and read what rank 0 wrote; the work folder goes
    either way. Returns ``(result, before's value)``; raises ``RuntimeError`` when a rank
    failed (naming the exit codes)."""
    import json
    import shutil
    import tempfile

    from dwdp_dev.worker.large_checkpoint import Qwen3MoeShape, write_qwen3_moe_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dwdp-gpu-bench-"))
    try:
        ckpt = write_qwen3_moe_checkpoint(
            work / "ck", Qwen3MoeShape(num_layers=args.layers), seed=3, device="cuda:0"
        )
        if fp8:
            from dwdp_dev.worker.fp8_checkpoint import quantize_checkpoint

            fp8_ckpt = quantize_checkpoint(ckpt, work / "ck-fp8", device="cuda:0")
            extra = [*extra, "--ckpt-fp8", str(fp8_ckpt)]
        measured = before() if before is not None else None
        extra = [*extra, "--ckpt", str(ckpt), "--result", str(work / "result.json")]
        codes = spawn_ranks(script, args.world, work, extra)
        if any(codes):
            raise RuntimeError(f"rank exit codes {codes}")
        return json.loads((work / "result.json").read_text()), measured
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_result(args: Any, name: str, text: str, payload: dict[str, Any]) -> None:
    """Print ``text`` and write it to ``OUT/name.txt``, ``payload`` (with the bench's name,
    host and arguments) to ``OUT/name.json``."""
    import json
    import platform

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(text + "\n")
    body = {"bench": name, "host": platform.node(), "args": vars(args), **payload}
    (out / f"{name}.json").write_text(json.dumps(body, indent=1) + "\n")
    print(text)

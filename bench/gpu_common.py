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
         kernel: str | None = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, attachment)``: the checkpoint on cuda:0, with DWDP attached when a
    ``backend`` is given (expert DWDP, dense too when ``dense``); attachment ``None`` else."""
    from dwdp.api.enums import CopyMode, GatherKernel
    from dwdp.api.partition import expert_partition
    from dwdp.worker.attach import attach
    from dwdp.worker.engine.loader import load_checkpoint
    from dwdp.worker.models import adapter_for
    from dwdp.worker.settings import CopySettings

    model, tok = load_checkpoint(ckpt)
    model.to("cuda:0")
    if backend is None:
        return model, tok, None
    adapter = adapter_for(model)
    experts = adapter.moe_layers(model)[0].num_experts
    settings = CopySettings(copy_mode=CopyMode(mode or "gather"),
                            gather_kernel=GatherKernel(kernel) if kernel else None)
    att = attach(model, adapter, backend=backend, transport=transport,
                 partition=expert_partition(experts, world), enable_dense=dense,
                 num_slots=slots, settings=settings)
    return model, tok, att

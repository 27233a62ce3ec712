"""Forward time of a prompt batch on CPU: expert + dense DWDP against replicated weights.

One run, one group of ``--world`` forked rank processes over the cpu backend and a TCP store.
Every rank first times the prefill forward of the same prompt batch with replicated weights,
then attaches DWDP and times it again; all ranks time each phase together (a collective
between phases), so both phases see the same CPU contention. Reported per rank: the median
forward time of each phase and the ratio DWDP / replicated (docs/design.md §7: a ratio measured in
the same run, never a hard-coded time). On CPU every copy runs synchronously on the compute
thread, so the ratio shows the cost of the copies DWDP adds, with no overlap to hide them.

Usage: python bench/cpu_forward.py [--arch deepseek_v3] [--world 4] [--hidden-size 128]
                                   [--num-experts 8] [--batch 4] [--prompt-len 32]
                                   [--repeats 5] [--slots 2] [--no-dense] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_forward(model, ids, mask, repeats: int) -> list[float]:
    import torch

    times = []
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)  # warm-up (and, with DWDP, the first fill)
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, args: argparse.Namespace, ckpt: str, group: str, port: int, out: Path,
          secret: bytes) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from dwdp.api.partition import expert_partition
    from dwdp.worker.backend.cpu import CpuBackend
    from dwdp.worker.bringup import attach
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.models import adapter_for
    from dwdp.worker.transport.base import RendezvousConfig
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    model, _tok = load_checkpoint(ckpt)
    gen = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    config = RendezvousConfig(
        group=group,
        incarnation="bench",
        rank=rank,
        world_size=args.world,
        secret=secret,
        address=("127.0.0.1", port),
        timeout_s=600,
    )
    with TcpStoreTransport(config) as transport:
        transport.exchange(None, label="bench.replicated")
        replicated = _time_forward(model, ids, mask, args.repeats)
        adapter = adapter_for(model)
        num_experts = adapter.moe_layers(model)[0].num_experts
        attachment = attach(
            model,
            adapter,
            backend=CpuBackend(group=group, incarnation="bench", rank=rank),
            transport=transport,
            partition=expert_partition(num_experts, args.world),
            enable_dense=not args.no_dense,
            num_slots=args.slots,
        )
        transport.exchange(None, label="bench.dwdp")
        dwdp = _time_forward(model, ids, mask, args.repeats)
        status = attachment.status()
        transport.exchange(None, label="bench.done")
        attachment.close()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "replicated_s": replicated,
                "dwdp_s": dwdp,
                "bytes_moved_per_forward": status["bytes_moved"] // (args.repeats + 1),
                "bytes_stored": status["bytes_stored"],
                "bytes_freed": status["bytes_freed"],
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arch", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe", "mixtral")
    )
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-dense", action="store_true", help="expert DWDP only")
    ap.add_argument("--out", default="bench/results/cpu_forward.json")
    args = ap.parse_args(argv)

    from dwdp.worker.backend.cpu import leftover_segments
    from dwdp_dev.worker.checkpoint import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="dwdp-bench-"))
    ckpt = str(
        make_checkpoint(
            args.arch,
            work / "ck",
            num_experts=args.num_experts,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
        )
    )
    group, port = f"b{uuid.uuid4().hex[:8]}", _free_port()
    secret = os.urandom(32)  # the group's rendezvous secret, shared by the forked ranks
    pids = []
    for rank in range(args.world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(rank, args, ckpt, group, port, work, secret)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if any(codes) or leftover_segments(group):
        print(
            f"rank exit codes {codes}; leftover segments {leftover_segments(group)}",
            file=sys.stderr,
        )
        return 1
    rows = []
    for rank in range(args.world):
        rec = json.loads((work / f"rank{rank}.json").read_text())
        rep, dw = statistics.median(rec["replicated_s"]), statistics.median(rec["dwdp_s"])
        rows.append(
            {
                "rank": rank,
                "replicated_ms": rep * 1e3,
                "dwdp_ms": dw * 1e3,
                "ratio": dw / rep,
                **{k: v for k, v in rec.items() if k.startswith("bytes")},
            }
        )
    result = {
        "bench": "cpu_forward",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "args": vars(args),
        "ranks": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    mode = "expert" if args.no_dense else "expert+dense"
    print(
        f"\n{args.arch}, {args.world} ranks, {mode} DWDP, batch {args.batch}x{args.prompt_len} "
        f"tokens, hidden {args.hidden_size}, {args.num_experts} experts, {args.slots} slots, "
        f"{args.threads} thread(s) per rank on {os.cpu_count()} CPUs"
    )
    print(f"{'rank':>4} {'replicated ms':>14} {'DWDP ms':>10} {'ratio':>7} {'moved/fwd B':>12}")
    for r in rows:
        print(
            f"{r['rank']:>4} {r['replicated_ms']:>14.2f} {r['dwdp_ms']:>10.2f} "
            f"{r['ratio']:>7.3f} {r['bytes_moved_per_forward']:>12}"
        )
    print(f"median ratio DWDP / replicated: {result['median_ratio']:.3f}  (JSON: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gather bandwidth on one GPU: register and TMA gathers, the batched copy-engine path,
torch per-source copies, and one large device-to-device copy (the ceiling).

For 2/4/8 sources and layer-sized totals (64 MiB .. 2 GiB), and the gathers at 8, 16, 32,
66 and 132 resident blocks (the SM reserve), it times each path with CUDA events and
reports bytes read per second and the ratio to the ceiling measured in the same run
(docs/design.md §7: ratios, never a hard-coded time). It prints the table last and writes JSON.

Usage: python bench/gather.py [--out PATH] [--totals-mib 64,256,1024,2048]
                              [--sources 2,4,8] [--blocks 8,16,32,66,132] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dwdp.api.enums import CopyMode
from dwdp.kernels.loader import GatherConfig, GatherModule, compile_cubin, device_arch
from dwdp.kernels.table import GatherEntry, pack_table
from dwdp.worker.backend.base import Buffer, CopyDescriptor, CopyPlan

MIB = 1 << 20


class TensorBuffer(Buffer):
    """A torch tensor as a backend buffer (bench sources and slot)."""

    def __init__(self, t: torch.Tensor, rank: int | None = None) -> None:
        self.t = t
        self.nbytes = t.numel()
        if rank is not None:
            self.rank = rank

    def tensor(self) -> torch.Tensor:
        return self.t

    def close(self) -> None:
        pass


def timed(fn, *, total_bytes: int, min_s: float = 0.05) -> float:
    """Bytes read per second of ``fn`` (which enqueues one copy of ``total_bytes``)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = max(3, min(200, int(min_s / one)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return total_bytes * iters / (start.elapsed_time(end) / 1e3)


def load(config: GatherConfig, arch: str) -> GatherModule:
    cubin, _, cached = compile_cubin(config, arch)
    return GatherModule(config, arch, cubin, cached)


SWEEP = {
    "reg-512x8-cs": GatherConfig("register", 512, 65536, unroll=8, store_cs=True),
    "reg-512x8-cs-pf": GatherConfig(
        "register", 512, 65536, unroll=8, store_cs=True, l2_prefetch=True
    ),
    "reg-512x8-pf": GatherConfig("register", 512, 65536, unroll=8, l2_prefetch=True),
    "reg-1024x4-cs-pf": GatherConfig(
        "register", 1024, 65536, unroll=4, store_cs=True, l2_prefetch=True
    ),
    "reg-512x16-cs-pf": GatherConfig(
        "register", 512, 131072, unroll=16, store_cs=True, l2_prefetch=True
    ),
    "reg-1024x8-cs-pf": GatherConfig(
        "register", 1024, 131072, unroll=8, store_cs=True, l2_prefetch=True
    ),
    "tma-4x48k-lag2": GatherConfig("tma", 128, 48 * 1024, stages=4, store_lag=2),
    "tma-4x48k-lag2-ef": GatherConfig(
        "tma", 128, 48 * 1024, stages=4, store_lag=2, evict_first=True
    ),
    "tma-4x48k-lag1-ef": GatherConfig("tma", 128, 48 * 1024, stages=4, evict_first=True),
    "tma-3x64k-lag1-ef": GatherConfig("tma", 128, 64 * 1024, stages=3, evict_first=True),
    "tma-4x24k-lag2-ef": GatherConfig(
        "tma", 128, 24 * 1024, stages=4, store_lag=2, evict_first=True
    ),
    "tma-2x96k-lag1-ef": GatherConfig("tma", 128, 96 * 1024, stages=2, evict_first=True),
}


def sweep(out: Path, total: int = 1 << 30, n_src: int = 8) -> None:
    """Kernel shapes x grid sizes at one layer size; ratios to the same-run ceiling."""
    arch, sms = device_arch(0)
    blocks_list = [16, 33, 66, 99, 132, 264]
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ceiling = timed(lambda: dst.copy_(src), total_bytes=total)
    per = total // n_src
    entries = [GatherEntry(src.data_ptr() + i * per, i * per, per) for i in range(n_src)]
    stream = torch.cuda.current_stream().cuda_stream
    res: dict[str, dict[int, float]] = {}
    for name, cfg in SWEEP.items():
        try:
            mod = load(cfg, arch)
        except Exception as e:
            print(f"{name}: {e}")
            continue
        packed = pack_table(entries, chunk_bytes=cfg.chunk_bytes)
        table = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).cuda()
        per_sm = mod.max_blocks_per_sm()
        res[name] = {}
        for blocks in blocks_list:
            if blocks > sms * per_sm:
                continue

            def run(mod=mod, packed=packed, table=table, blocks=blocks):
                mod.launch(
                    table_ptr=table.data_ptr(),
                    rows=packed.rows,
                    total_chunks=packed.total_chunks,
                    dst_base=dst.data_ptr(),
                    blocks=blocks,
                    stream=stream,
                )

            dst.zero_()
            res[name][blocks] = timed(run, total_bytes=total) / ceiling
            torch.cuda.synchronize()
            assert torch.equal(dst, src), name
        mod.close()
    out.write_text(
        json.dumps(
            {
                "ceiling_Bps": ceiling,
                "total": total,
                "sources": n_src,
                "configs": {k: repr(v) for k, v in SWEEP.items()},
                "ratios": res,
            },
            indent=1,
        )
    )
    print(
        f"sweep at {total // MIB} MiB x{n_src}, ceiling {ceiling / 1e9:.1f} GB/s; ratio by blocks"
    )
    print(f"{'config':>20} " + " ".join(f"{b:>6}" for b in blocks_list))
    for name, r in res.items():
        print(f"{name:>20} " + " ".join(f"{r.get(b, float('nan')):>6.3f}" for b in blocks_list))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/gather.json")
    ap.add_argument("--totals-mib", default="64,256,1024,2048")
    ap.add_argument("--sources", default="2,4,8")
    ap.add_argument("--blocks", default="8,16,32,66,132")
    ap.add_argument("--quick", action="store_true", help="64 and 256 MiB only")
    ap.add_argument("--sweep", metavar="JSON", help="only sweep kernel shapes, write JSON here")
    args = ap.parse_args()
    if args.sweep:
        torch.cuda.set_stream(torch.cuda.Stream())
        sweep(Path(args.sweep))
        return
    totals = [int(x) * MIB for x in args.totals_mib.split(",")]
    if args.quick:
        totals = [t for t in totals if t <= 256 * MIB]
    source_counts = [int(x) for x in args.sources.split(",")]
    block_counts = [int(x) for x in args.blocks.split(",")]

    from cuda.bindings import driver

    from dwdp.worker.backend.cuda import CudaBackend

    backend = CudaBackend(device=0)
    # Every path on one created stream: cuMemcpyBatchAsync refuses the legacy NULL stream.
    torch.cuda.set_stream(torch.cuda.Stream())
    arch, sms = device_arch(0)
    variants = {
        "register": load(GatherConfig.default("register"), arch),
        "tma": load(GatherConfig.default("tma"), arch),
        # Alternative shapes, to see what the defaults leave on the table.
        "register-1024x4": load(
            GatherConfig("register", 1024, 1024 * 16 * 4, unroll=4, store_cs=True), arch
        ),
        "tma-2x96k": load(GatherConfig("tma", 128, 96 * 1024, stages=2), arch),
    }
    stream = torch.cuda.current_stream()
    cstream = backend.current_stream()
    max_total = max(totals)
    pool_src = torch.randint(0, 256, (max_total,), dtype=torch.uint8, device="cuda")
    pool_dst = torch.empty(max_total, dtype=torch.uint8, device="cuda")
    rows = []
    t0 = time.time()
    for total in totals:
        ceiling = timed(lambda t=total: pool_dst[:t].copy_(pool_src[:t]), total_bytes=total)
        for n_src in source_counts:
            per = total // n_src
            srcs = [pool_src[i * per : (i + 1) * per] for i in range(n_src)]
            dst = pool_dst[: per * n_src]
            moved = per * n_src
            row = {"total_bytes": moved, "sources": n_src, "ceiling_Bps": ceiling, "paths": {}}

            def torch_copies(srcs=srcs, dst=dst, per=per):
                for i, s in enumerate(srcs):
                    dst[i * per : (i + 1) * per].copy_(s)

            row["paths"]["torch_per_source"] = timed(torch_copies, total_bytes=moved)
            slot = TensorBuffer(dst)
            plan = CopyPlan(
                remote=tuple(
                    CopyDescriptor(TensorBuffer(s, rank=i), 0, slot, i * per, per)
                    for i, s in enumerate(srcs)
                )
            )
            row["paths"]["batched"] = timed(
                lambda p=plan: backend.launch_copies(p, cstream, mode=CopyMode.BATCHED),
                total_bytes=moved,
            )
            entries = [GatherEntry(s.data_ptr(), i * per, per) for i, s in enumerate(srcs)]
            for name, mod in variants.items():
                if name.endswith(("x4", "96k")) and total != 1024 * MIB:
                    continue
                packed = pack_table(entries, chunk_bytes=mod.config.chunk_bytes)
                table = torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).cuda()
                for blocks in block_counts:

                    def gather(mod=mod, packed=packed, table=table, blocks=blocks, dst=dst):
                        mod.launch(
                            table_ptr=table.data_ptr(),
                            rows=packed.rows,
                            total_chunks=packed.total_chunks,
                            dst_base=dst.data_ptr(),
                            blocks=blocks,
                            stream=stream.cuda_stream,
                        )

                    row["paths"][f"{name}@{blocks}"] = timed(gather, total_bytes=moved)
                    # Every byte arrived (cheap check on the last configuration).
                torch.cuda.synchronize()
                assert torch.equal(dst, pool_src[:moved]), f"{name} copied wrong bytes"
                dst.fill_(0)
            row["ratios"] = {k: v / ceiling for k, v in row["paths"].items()}
            rows.append(row)
            print(
                f"[{time.time() - t0:6.1f}s] {moved / MIB:6.0f} MiB x{n_src}: ceiling "
                f"{ceiling / 1e9:7.1f} GB/s, best "
                f"{max(v for k, v in row['ratios'].items() if '@' in k):.3f}",
                flush=True,
            )

    # SMs (resident blocks) each variant needs for 90% of the ceiling, per configuration.
    needs = {}
    for name in variants:
        per_cfg = {}
        for row in rows:
            ok = [b for b in block_counts if row["ratios"].get(f"{name}@{b}", 0.0) >= 0.9]
            if f"{name}@{block_counts[0]}" in row["ratios"]:
                per_cfg[f"{row['total_bytes'] // MIB}MiBx{row['sources']}"] = (
                    min(ok) if ok else None
                )
        needs[name] = per_cfg
    best = max(
        (v, k, r["total_bytes"], r["sources"])
        for r in rows
        for k, v in r["ratios"].items()
        if "@" in k
    )
    result = {
        "device": torch.cuda.get_device_name(0),
        "arch": arch,
        "sms": sms,
        "torch": torch.__version__,
        "cuda_bindings": __import__("cuda.bindings").bindings.__version__,
        "driver": driver.cuDriverGetVersion()[1],
        "host": platform.node(),
        "configs": {k: m.config.__repr__() for k, m in variants.items()},
        "rows": rows,
        "sms_for_90pct": needs,
        "best_gather": {
            "ratio": best[0],
            "path": best[1],
            "total_bytes": best[2],
            "sources": best[3],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    backend.close()

    # The table, last.
    cols = ["torch_per_source", "batched"] + [
        f"{v}@{b}" for v in ("register", "tma") for b in block_counts
    ]
    print(
        f"\nbytes read per second / ceiling (one D2D copy, same run); {result['device']}, {sms} SMs"
    )
    print(f"{'MiB':>6} {'src':>3} {'ceil GB/s':>9} " + " ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(
            f"{r['total_bytes'] // MIB:>6} {r['sources']:>3} {r['ceiling_Bps'] / 1e9:>9.1f} "
            + " ".join(f"{r['ratios'].get(c, float('nan')):>12.3f}" for c in cols)
        )
    extra = [k for r in rows for k in r["ratios"] if k.startswith(("register-", "tma-"))]
    if extra:
        print("alternative shapes (1 GiB):")
        for r in rows:
            parts = [f"{k}={v:.3f}" for k, v in r["ratios"].items() if k in extra]
            if parts:
                print(f"  {r['total_bytes'] // MIB} MiB x{r['sources']}: " + " ".join(parts))
    print(f"SMs for 90% of the ceiling: {json.dumps(needs)}")
    b = result["best_gather"]
    print(
        f"best gather: {b['path']} at {b['total_bytes'] // MIB} MiB x{b['sources']}: "
        f"{b['ratio']:.3f} of the ceiling (target >= 0.95)"
    )
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()

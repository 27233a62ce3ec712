"""One process of the device-memory measurements (``tests/gpu/test_sharded_load_gpu.py``,
``bench/gpu_memory.py``): load a checkpoint as a replicated or a DWDP rank, generate, and
record what it holds.

``python -m dwdp_dev.worker.memory_probe replicated OUT CHECKPOINT [--device D]``: the
whole checkpoint (``load_checkpoint``, then ``model.to(device)``, the worker's path without
DWDP). ``python -m dwdp_dev.worker.memory_probe rank OUT CHECKPOINT --rank R --world N
--group G --port P [--scenarios expert,expert+dense]``: a DWDP rank of ``N``; for each
scenario in turn it loads through ``load_sharded`` (its quarter of the experts), attaches
expert DWDP (``expert+dense``: and dense DWDP), generates, closes and frees everything, so each
scenario's peak is its own. On CUDA every rank uses device 0 (several ranks share one GPU
through POSIX fds); on ``cpu`` the cpu backend (a tiny checkpoint, to check this code).
``run_probes`` runs the replicated process alone, then the ranks, and returns the records.

Writes ``OUT/<role>.<rank>.json``: a list of records, one per scenario, each with, in bytes:
``load_peak`` / ``peak`` (torch's ``max_memory_allocated`` after the load / after setup and
generation, the counter reset when the scenario starts; ``None`` on cpu), ``reserved``
(``max_memory_reserved``), ``loaded_weights`` (the model's materialised tensors after the
load: the replicated part), ``weights`` (after setup: the model's tensors outside DWDP's
buffers), ``vmm`` (the stores, the allocations torch does not count: ``store_allocated_bytes``
of every kind), ``stores``/``slots`` (``bytes_stored``/``bytes_slots`` of the status),
``resident`` (the status' per-kind numbers), ``range`` (the rank's ``[start, end)``),
``device_total`` (``None`` on cpu), ``tokens`` (greedy, one list per prompt) and
``kv_cache`` (the bytes of the serving engine's KV pool that generated them: part of ``peak``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dwdp.api.defaults import MAX_NUM_TOKENS
from dwdp.worker.memory import MemoryWatch, size_rank_memory, weight_bytes

if TYPE_CHECKING:
    from dwdp.worker.backend.base import Backend
    from dwdp.worker.transport.base import GroupTransport

PROMPTS: tuple[str, ...] = (
    "Hello world, the",
    "What is the capital of France? Paris",
    "The quick brown fox jumps over the lazy dog and",
    "a",
)
SCENARIOS: tuple[str, ...] = ("expert", "expert+dense")


def _peaks(device: str) -> dict[str, int | None]:
    import torch

    if not device.startswith("cuda"):
        return {"peak": None, "reserved": None}
    return {
        "peak": int(torch.cuda.max_memory_allocated(device)),
        "reserved": int(torch.cuda.max_memory_reserved(device)),
    }


def _reset(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _device_total(device: str) -> int | None:
    import torch

    return int(torch.cuda.mem_get_info(device)[1]) if device.startswith("cuda") else None


def tensor_bytes(model: Any, exclude: list[tuple[int, int]] | None = None) -> int:
    """Bytes of the model's materialised parameters and buffers, host and device
    (``dwdp.worker.memory.weight_bytes``), ``exclude``'s ``(address, nbytes)`` left out."""
    placed = weight_bytes(model, exclude or ())
    return (placed.host or 0) + (placed.device or 0)


def kv_record(model: Any, dwdp: Any, watch: MemoryWatch, max_model_len: int) -> dict[str, Any]:
    """The product's KV pool and ledger for this rank (``size_rank_memory``, default
    ``kvCache`` and ``maxNumTokens``): ``kv_pool`` and ``ledger`` as ``/dwdp/status``
    shows them. Runs a profiling forward on a GPU: call it after the peaks are read."""
    from dwdp.api.launch import KvCacheConfig

    pool, ledger = size_rank_memory(model, dwdp, watch, kv=KvCacheConfig(),
                                    max_num_tokens=MAX_NUM_TOKENS, max_model_len=max_model_len)
    return {"kv_pool": pool.as_dict(), "ledger": ledger.as_dict()}


def generate(model: Any, tok: Any, max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``PROMPTS`` (one batch, EOS ignored) through the serving engine, and
    the bytes its KV cache pool held (``PagedKVCache.nbytes``)."""
    from dwdp.worker.engine.continuous import ContinuousEngine
    from dwdp.worker.engine.protocol import SamplingParams

    engine = ContinuousEngine(model, tok, model_name="probe")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = engine.run_batch([tok(p)["input_ids"] for p in PROMPTS], params)
    return [r.token_ids for r in results], engine.runner.cache.nbytes


def replicated(path: str, device: str, max_tokens: int) -> dict[str, Any]:
    """The replicated reference: the whole model on ``device``."""
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.status_source import NoDwdp

    _reset(device)
    watch = MemoryWatch(device)
    watch.start()
    model, tok = load_checkpoint(path)
    model.to(device)
    watch.end()
    load = _peaks(device)
    weights = tensor_bytes(model)
    tokens, kv_cache = generate(model, tok, max_tokens)
    record: dict[str, Any] = {"scenario": "replicated", "load_peak": load["peak"], **_peaks(device),
              "loaded_weights": weights, "weights": weights, "vmm": 0, "stores": 0,
              "slots": 0, "resident": {}, "range": None, "device_total": _device_total(device),
              "tokens": tokens, "kv_cache": kv_cache}
    return {**record, **kv_record(model, NoDwdp(), watch, _max_model_len(model))}


def _max_model_len(model: Any) -> int:
    return int(model.config.get_text_config().max_position_embeddings)


def dwdp_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every scenario of ``args.scenarios`` on this rank, in turn."""
    import torch

    from dwdp.api.enums import HandleType
    from dwdp.worker.transport.base import RendezvousConfig, read_secret
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    backend: Backend
    if args.device.startswith("cuda"):
        from dwdp.worker.backend.cuda import CudaBackend

        torch.cuda.set_device(args.device)
        backend = CudaBackend(device=torch.device(args.device).index or 0,
                              handle_type=HandleType.POSIX_FD)
    else:
        from dwdp.worker.backend.cpu import CpuBackend

        backend = CpuBackend(group=args.group, incarnation="probe", rank=args.rank)
    config = RendezvousConfig(group=args.group, incarnation="i0", rank=args.rank,
                              world_size=args.world, secret=read_secret(os.environ),
                              address=("127.0.0.1", args.port), timeout_s=args.timeout)
    records = []
    try:
        with TcpStoreTransport(config) as transport:
            for scenario in args.scenarios:
                records.append(_scenario(scenario, args, backend, transport))
                transport.barrier(label=f"probe.{scenario}")
    finally:
        backend.close()
    return records


def _scenario(scenario: str, args: argparse.Namespace, backend: Backend,
              transport: GroupTransport) -> dict[str, Any]:
    from dwdp.api.partition import expert_partition
    from dwdp.worker.bringup import attach
    from dwdp.worker.loading.sharded import load_sharded
    from dwdp.worker.loading.validate import expert_count, load_config
    from dwdp.worker.models import require_adapter

    dense = scenario == "expert+dense"
    _reset(args.device)
    config = load_config(args.checkpoint)
    adapter = require_adapter(config, dense=dense)
    partition = expert_partition(expert_count(config), args.world)
    watch = MemoryWatch(args.device)
    watch.start()
    model, tok, loaded = load_sharded(args.checkpoint, adapter=adapter, partition=partition,
                                      rank=args.rank, device=args.device)
    watch.end()
    load = _peaks(args.device)
    loaded_weights = tensor_bytes(model)
    attachment = attach(model, adapter, backend=backend, transport=transport,
                        partition=partition, enable_dense=dense, num_slots=args.slots,
                        loaded=loaded)
    del loaded
    tokens, kv_cache = generate(model, tok, args.max_tokens)
    status = attachment.status()
    record = {
        "scenario": scenario, "load_peak": load["peak"], **_peaks(args.device),
        "loaded_weights": loaded_weights,
        "weights": tensor_bytes(model, attachment.buffer_ranges()),
        "vmm": sum(r["store_allocated_bytes"] for r in status["resident"].values()),
        "stores": status["bytes_stored"], "slots": status["bytes_slots"],
        "resident": status["resident"], "leaks": status["leaks"],
        "range": list(partition.ranges[args.rank]), "device_total": _device_total(args.device),
        "tokens": tokens, "kv_cache": kv_cache,
    }
    record.update(kv_record(model, attachment, watch, _max_model_len(model)))
    transport.barrier(label=f"probe.{scenario}.measured")  # no peer unmaps a live store
    attachment.close()
    del model, attachment
    _reset(args.device)
    return record


def run_probes(
    checkpoint: str | Path,
    out: Path,
    *,
    world: int = 4,
    device: str = "cuda:0",
    slots: int = 2,
    max_tokens: int = 8,
    timeout_s: float = 400.0,
) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """Run the replicated process alone, then ``world`` rank processes (every scenario), each
    a fresh interpreter writing into ``out``; returns ``(replicated record, records of every
    rank)``. Raises ``RuntimeError`` naming the exit codes when a process fails or outlives
    ``timeout_s`` seconds (it is killed)."""
    import os
    import socket
    import subprocess
    import uuid

    from dwdp.api.contract import Env
    from dwdp.worker.transport.base import make_secret_file

    probe = [sys.executable, "-m", "dwdp_dev.worker.memory_probe"]
    common = ["--device", device, "--slots", str(slots), "--max-tokens", str(max_tokens)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    _wait([subprocess.Popen([*probe, "replicated", str(out), str(checkpoint), *common],
                            env=env)], timeout_s)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = f"p{uuid.uuid4().hex[:8]}"
    secret_file = make_secret_file(out)  # the group's rendezvous secret, as a pod gets it
    env[Env.RENDEZVOUS_SECRET_FILE] = str(secret_file)
    try:
        _wait([subprocess.Popen([*probe, "rank", str(out), str(checkpoint), *common, "--rank",
                                 str(r), "--world", str(world), "--group", group, "--port",
                                 str(port)], env=env)
               for r in range(world)], timeout_s)
    finally:
        secret_file.unlink()
    reference = json.loads((out / "replicated.0.json").read_text())[0]
    return reference, [json.loads((out / f"rank.{r}.json").read_text()) for r in range(world)]


def _wait(procs: list[Any], timeout_s: float) -> None:
    import subprocess

    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * len(procs):
        raise RuntimeError(f"memory probe processes exited with {codes} (None: timed out)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("role", choices=("replicated", "rank"))
    ap.add_argument("out", type=Path)
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--group", default="probe")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0, help="rendezvous timeout, s")
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS))
    args = ap.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: {unknown} not among {', '.join(SCENARIOS)}")
    if args.role == "replicated":
        records = [replicated(args.checkpoint, args.device, args.max_tokens)]
    else:
        records = dwdp_rank(args)
    (args.out / f"{args.role}.{args.rank}.json").write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())

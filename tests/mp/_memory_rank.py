"""One process of the sharded-loading memory test, a fresh interpreter (forked processes would
inherit the test's heap, whose freed pages can hide new allocations from ``VmHWM``).

``python _memory_rank.py ROLE OUT CHECKPOINT [GROUP PORT RANK]``, ROLE one of:
``baseline`` (imports what a rank imports and does what every rank does before it reads a
weight: the header check, the meta-device model, which imports the architecture's code),
``rank`` (a DWDP rank of 4:
``load_sharded`` then ``attach`` with expert DWDP over the cpu backend, then generates),
``whole`` (``load_checkpoint``, the whole model, then generates). Writes
``OUT/<role>.<rank>.json``: ``VmHWM``/``VmRSS``/``RssAnon``/``RssFile``/``RssShmem`` (bytes)
after the load and after setup, the generated tokens, the expert store and slot bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dwdp.api.partition import expert_partition
from dwdp.worker.backend.cpu import CpuBackend
from dwdp.worker.bringup import attach
from dwdp.worker.engine.continuous import ContinuousEngine
from dwdp.worker.engine.protocol import SamplingParams
from dwdp.worker.loading.checkpoint import load_checkpoint
from dwdp.worker.loading.sharded import load_sharded
from dwdp.worker.loading.tokenizer import load_tokenizer
from dwdp.worker.loading.validate import load_config, validate_checkpoint
from dwdp.worker.models import require_adapter
from dwdp.worker.transport.base import RendezvousConfig, read_secret
from dwdp.worker.transport.tcp_store import TcpStoreTransport

WORLD = 4
NUM_EXPERTS = 16
SLOTS = 2
PROMPTS = ("Hello world, the", "The quick brown fox jumps over the lazy dog and")
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def memory() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile and RssShmem of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def generate(model, tok) -> list[list[int]]:
    engine = ContinuousEngine(model, tok, model_name="m")
    return [r.token_ids for r in engine.run_batch([tok(p)["input_ids"] for p in PROMPTS], PARAMS)]


def rank_main(path: str, group: str, port: int, rank: int) -> dict:
    config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                              secret=read_secret(os.environ), address=("127.0.0.1", port),
                              timeout_s=120)
    with TcpStoreTransport(config) as transport:
        adapter = require_adapter(load_config(path), dense=False)
        partition = expert_partition(NUM_EXPERTS, WORLD)
        model, tok, loaded = load_sharded(path, adapter=adapter, partition=partition, rank=rank)
        after_load = memory()
        backend = CpuBackend(group=group, incarnation="s0", rank=rank)
        attachment = attach(model, adapter, backend=backend, transport=transport,
                            partition=partition, enable_dense=False, num_slots=SLOTS,
                            loaded=loaded)
        del loaded
        after_setup = memory()
        tokens = generate(model, tok)
        resident = attachment.status()["resident"]["expert"]
        attachment.close()
        return {"load": after_load, "setup": after_setup, "tokens": tokens,
                "store_bytes": resident["store_bytes"], "slot_bytes": resident["slot_bytes"]}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    role, out, path = argv[0], Path(argv[1]), argv[2]
    rank = 0
    if role == "baseline":
        config = validate_checkpoint(path)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
        load_tokenizer(Path(path))
        record: dict = {"load": memory()}
    elif role == "whole":
        model, tok = load_checkpoint(path)
        record = {"load": memory(), "tokens": generate(model, tok)}
    else:
        group, port, rank = argv[3], int(argv[4]), int(argv[5])
        record = rank_main(path, group, port, rank)
    (out / f"{role}.{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Expert + dense DWDP on 4 real rank processes over the cpu backend, on real transformers
models loaded sharded (each rank reads only its experts, ``dwdp.worker.loading.sharded``):
greedy tokens and logits bitwise equal to one process with replicated weights (loaded whole).

Every architecture (DeepSeek-V3, Qwen3-MoE, Mixtral) with 2 and 3 expert prefetch slots and
6 experts (4 does not divide it: balanced partition 2, 2, 1, 1). Each rank serves its own
batch (the prompts rotated by its rank, of different lengths) and is compared with the
replicated model on that same batch. Per-rank resident bytes after commit are checked
against the partition. All scenarios run in one group of 4 forked processes over one TCP
store, one incarnation per scenario.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from conftest import RENDEZVOUS_SECRET, read_records, run_group  # noqa: E402
from ports import free_port  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.loading.sharded import load_sharded  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

WORLD = 4
NUM_EXPERTS = 6
ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
SLOTS = (2, 3)
SCENARIOS = [(arch, slots) for arch in ARCHS for slots in SLOTS]
PROMPTS = (
    "Hello world, the",
    "What is the capital of France? Paris is",
    "a",
    "The quick brown fox jumps over the lazy dog and",
)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
ALIGN = 64


def _batch(tokenizer, rank: int) -> list[list[int]]:
    order = PROMPTS[rank:] + PROMPTS[:rank]
    return [tokenizer(p)["input_ids"] for p in order]


def _rank_main(rank: int, out: Path, group: str, port: int, checkpoints: dict[str, str]) -> None:
    torch.set_num_threads(1)
    from dwdp.worker.backend.cpu import CpuBackend
    from dwdp.worker.bringup import attach
    from dwdp.worker.loading.validate import load_config
    from dwdp.worker.models import adapter_for
    from dwdp.worker.transport.base import RendezvousConfig
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    config = RendezvousConfig(
        group=group,
        incarnation="i0",
        rank=rank,
        world_size=WORLD,
        secret=RENDEZVOUS_SECRET,
        address=("127.0.0.1", port),
        timeout_s=120,
    )
    with TcpStoreTransport(config) as transport:
        for index, (arch, slots) in enumerate(SCENARIOS):
            adapter = adapter_for(load_config(checkpoints[arch]))
            partition = expert_partition(NUM_EXPERTS, WORLD)
            # the sharded load: this rank's experts only, as the worker loads them
            model, tok, loaded = load_sharded(
                checkpoints[arch], adapter=adapter, partition=partition, rank=rank
            )
            full = {
                f"{m.prefix}/{p}": (tuple(t.shape), t.element_size())
                for m in adapter.moe_layers(model)
                for p, t in m.expert_tensors().items()
            }
            backend = CpuBackend(group=group, incarnation=f"s{index}", rank=rank)
            attachment = attach(
                model,
                adapter,
                backend=backend,
                transport=transport,
                partition=partition,
                enable_dense=True,
                num_slots=slots,
                loaded=loaded,
            )
            # every expert table now reads from a prefetch slot, not from a full copy
            slot_ptrs = [s.tensor().data_ptr() for s in attachment.experts.slots]
            in_slots = all(
                any(
                    p <= getattr(m.experts, name).data_ptr() < p + s.nbytes
                    for p, s in zip(slot_ptrs, attachment.experts.slots, strict=True)
                )
                for m in adapter.moe_layers(model)
                for name in ("gate_up_proj", "down_proj")
            )
            engine = ContinuousEngine(model, tok, model_name=arch)
            results = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
            status = attachment.status()
            torch.save(
                [(r.token_ids, torch.stack(r.logits)) for r in results],
                out / f"out.{index}.{rank}.pt",
            )
            (out / f"s{index}.{rank}.json").write_text(
                json.dumps({"status": status, "full": full, "in_slots": in_slots})
            )
            attachment.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {a: str(make_checkpoint(a, root / a, num_experts=NUM_EXPERTS, seed=11)) for a in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    torch.set_num_threads(1)
    refs = {}
    for arch in ARCHS:
        model, tok = load_checkpoint(checkpoints[arch])
        for rank in range(WORLD):
            # a fresh engine per rank, as each rank's: a prefix one rank's batch left cached
            # would change another's logits in the last bits (tokens stay equal)
            engine = ContinuousEngine(model, tok, model_name=arch)
            results = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
            refs[(arch, rank)] = [(r.token_ids, torch.stack(r.logits)) for r in results]
    return refs


@pytest.fixture(scope="module")
def run(tmp_path_factory, checkpoints):
    import uuid

    out = tmp_path_factory.mktemp("ranks")
    group = f"w{uuid.uuid4().hex[:10]}"
    port = free_port()
    run_group(
        out, group, WORLD, lambda rank, out: _rank_main(rank, out, group, port, checkpoints)
    )
    return out


@pytest.mark.parametrize(("arch", "slots"), SCENARIOS)
def test_bitwise_equal_to_replicated(run, references, arch, slots):
    index = SCENARIOS.index((arch, slots))
    for rank in range(WORLD):
        got = torch.load(run / f"out.{index}.{rank}.pt")
        want = references[(arch, rank)]
        assert len(got) == len(want) == len(PROMPTS)
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
            assert tokens == ref_tokens, (arch, slots, rank)
            assert torch.equal(logits, ref_logits), (arch, slots, rank)


@pytest.mark.parametrize(("arch", "slots"), SCENARIOS)
def test_resident_bytes_match_the_partition(run, arch, slots):
    index = SCENARIOS.index((arch, slots))
    records = read_records(run, f"s{index}", WORLD)
    partition = expert_partition(NUM_EXPERTS, WORLD)
    assert [partition.local_count(r) for r in range(WORLD)] == [2, 2, 1, 1]
    digests = {rec["status"]["layout_digest"] for rec in records}
    assert len(digests) == 1 and None not in digests
    for rank, rec in enumerate(records):
        status, full = rec["status"], rec["full"]
        assert rec["in_slots"]
        assert status["phase"] == "committed" and status["leaks"] == 0
        assert status["partition"]["ranks"][rank]["count"] == partition.local_count(rank)
        assert status["slots"] == {"expert": slots, "attention": 2, "moe_dense": 3}
        expert = status["resident"]["expert"]
        local = partition.local_count(rank)

        def table_bytes(shape, elem):
            return elem * int(torch.Size(shape).numel())

        def aligned(nbytes):
            return -(-nbytes // ALIGN) * ALIGN

        # the store: this rank's experts of every (layer, table), each block 64-byte aligned
        expected_store = sum(
            aligned(local * table_bytes(shape, elem) // shape[0]) for shape, elem in full.values()
        )
        assert expert["store_bytes"] == expected_store
        full_tables = sum(table_bytes(shape, elem) for shape, elem in full.values())
        assert expert["sharded_bytes"] == full_tables
        # a slot: one layer's full tables (every MoE layer has the same shapes)
        per_layer: dict[str, int] = {}
        for key, (shape, elem) in full.items():
            layer = key.split("/")[0]
            per_layer[layer] = per_layer.get(layer, 0) + aligned(table_bytes(shape, elem))
        assert expert["slot_bytes"] == slots * max(per_layer.values())
        dense = status["resident"]["dense"]
        n = dense["world_size"]
        assert n == WORLD
        assert dense["store_bytes"] * n >= dense["sharded_bytes"]
        assert dense["store_bytes"] * n - dense["sharded_bytes"] < n * ALIGN * 4 * len(full)
        # the sharded load read only this rank's expert rows: those are what the repoint freed
        loaded_rows = sum(
            local * table_bytes(shape, elem) // shape[0] for shape, elem in full.values()
        )
        assert status["bytes_freed"] == dense["sharded_bytes"] + loaded_rows
        assert status["bytes_stored"] == expert["store_bytes"] + dense["store_bytes"]
        assert status["bytes_moved"] > 0 and status["bytes_moved_remote"] > 0

"""The seed rules on the worker's own path, 2 real rank processes over the TCP store.

``run_worker`` (what ``dwdp worker`` and each rank of ``dwdp launch`` run) for the scalar
exchange's refusals: every rank exits with a termination message naming the layer and the
parameter. ``setup_dwdp`` (the setup ``run_worker`` calls, from a launch config) on real
checkpoints for the rest: a one-ULP scalar installed from rank 0; storages under 1 MiB kept
replicated while larger ones move (dense DWDP, 3 expert slots, with the INFO line for more
than two slots); an MoE layer DWDP cannot manage kept whole, warned about once and counted
in the status; a declared repeated layer keeping its slot; reload guards after teardown.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from conftest import RENDEZVOUS_SECRET, run_group, run_worker_rank  # noqa: E402
from ports import free_port  # noqa: E402

from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.settings import DENSE_MIN_BYTES  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

WORLD = 2
PROMPTS = ("Hello world, the", "What is the capital")
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
SCALAR = "model.layers.1.post_attention_layernorm.weight"
SLOTS_INFO = "expert prefetch slots: each expert copy runs ahead of its layer's dense copy"


# -- checkpoints -----------------------------------------------------------------------------


def _shift(src: Path, dst: Path, ulps: int, *, config: dict | None = None) -> Path:
    """A copy of checkpoint ``src`` whose ``SCALAR`` is ``ulps`` bfloat16 ULPs away from the
    bfloat16 cast of the original (stored in the checkpoint's dtype)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    value = tensors[SCALAR]
    bits = value.to(torch.bfloat16).view(torch.int16) + ulps
    tensors[SCALAR] = bits.view(torch.bfloat16).to(value.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    fp32 = make_checkpoint("qwen3_moe", root / "fp32", num_experts=4, seed=3)
    bf16 = make_checkpoint("qwen3_moe", root / "bf16", num_experts=4, seed=3, dtype="bfloat16")
    repeated = _shift(fp32, root / "repeated", 0, config={"dwdp_repeated_layers": [2]})
    return {
        "fp32": fp32,
        "fp32+1": _shift(fp32, root / "fp32+1", 1),
        "fp32+2": _shift(fp32, root / "fp32+2", 2),
        "bf16": bf16,
        "bf16+1": _shift(bf16, root / "bf16+1", 1),
        "repeated": repeated,
        # q_proj/o_proj of a 8192-wide layer are 1 MiB; norms and the router are smaller
        "wide": make_checkpoint("qwen3_moe", root / "wide", num_experts=4, seed=5,
                                hidden_size=8192),
    }


def _launch(path: Path, *, dtype: str = "auto", dense: bool = False, slots: int = 2) -> dict:
    return {
        "model": {"path": str(path), "dtype": dtype},
        "handleType": "shm",
        "transport": "tcpStore",
        "dwdp": {"dwdpSize": WORLD, "enableDense": dense, "numPrefetchSlots": slots},
        "serverPort": free_port(),
    }


# -- the scalar exchange's refusal through run_worker -------------------------------------------

REFUSALS = {
    # (rank 1's checkpoint, model dtype): a float32 checkpoint cast to bfloat16 two ULPs
    # apart, and a bfloat16 checkpoint one ULP apart
    "two-ulps-from-fp32": ("fp32+2", "bfloat16", "more than one unit in the last place"),
    "one-ulp-bf16-checkpoint": ("bf16+1", "auto", "not bitwise equal (bfloat16 checkpoint"),
}


def _worker_rank(rank: int, out: Path, group: str, name: str, configs: list[Path],
                 port: int) -> None:
    code = run_worker_rank(rank, group=group, world=WORLD, port=port, config=configs[rank],
                           termination_log=out / f"{name}.term.{rank}")
    (out / f"{name}.code.{rank}").write_text(str(code))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, ckpts):
    out = tmp_path_factory.mktemp("refusals")
    found = {}
    for name, (odd, dtype, _rule) in REFUSALS.items():
        base = "bf16" if odd.startswith("bf16") else "fp32"
        configs = []
        for rank, ck in enumerate((base, odd)):
            path = out / f"{name}.{rank}.yaml"
            path.write_text(json.dumps(_launch(ckpts[ck], dtype=dtype)))
            configs.append(path)
        port, group = free_port(), f"r{uuid.uuid4().hex[:10]}"
        run_group(out, group, WORLD, lambda rank, out, n=name, c=configs, p=port, g=group:
                  _worker_rank(rank, out, g, n, c, p), timeout_s=300)
        found[name] = [
            (int((out / f"{name}.code.{r}").read_text()), (out / f"{name}.term.{r}").read_text())
            for r in range(WORLD)
        ]
    return found


@pytest.mark.parametrize("name", list(REFUSALS))
def test_scalar_disagreement_fails_setup_on_every_rank(refusals, name):
    rule = REFUSALS[name][2]
    for code, message in refusals[name]:
        assert code == 1
        assert message.startswith("scalars: SetupError: DWDP setup failed in scalars"), message
        assert f"rank 1: layer model.layers.1: parameter post_attention_layernorm.weight " \
               f"differs from rank 0's: {rule}" in message


# -- setup_dwdp scenarios -----------------------------------------------------------------------


def _generate(model, tok) -> list[list[int]]:
    engine = ContinuousEngine(model, tok, model_name="x")
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return [r.token_ids for r in engine.run_batch(ids, PARAMS)]


def _grow_layer_2(model) -> None:
    """Give MoE layer 2 one more expert than the model's (never routed to): DWDP cannot
    split it with the partition, so it must keep the whole table."""
    experts = model.model.layers[2].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        table = getattr(experts, name).data
        setattr(experts, name, torch.nn.Parameter(torch.cat([table, table[:1]]),
                                                  requires_grad=False))
    experts.num_experts += 1  # the grouped GEMM's expert count follows the tables


def _draft_layer_2(model) -> None:
    """Run MoE layer 2's block three times in a row per forward, as a draft layer runs once
    per draft step; the last result is kept (equal to one run)."""
    block = model.model.layers[2].mlp
    forward = block.forward

    def three_times(*args, **kwargs):
        forward(*args, **kwargs)
        forward(*args, **kwargs)
        return forward(*args, **kwargs)

    block.forward = three_times


class _Lines(logging.Handler):
    """Collects the messages the worker's loggers emit at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[int, str]] = []
        logger = logging.getLogger("dwdp.worker")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))

    def take(self) -> list[tuple[int, str]]:
        out, self.records = self.records, []
        return out


def _refused(call) -> bool:
    from dwdp.worker.attachment import WeightsShardedError

    try:
        call()
    except WeightsShardedError:
        return True
    return False


def _setup_rank(rank: int, out: Path, group: str, port: int, ckpts: dict) -> None:
    torch.set_num_threads(1)
    from dwdp.api.launch import LaunchConfig
    from dwdp.worker.bringup import setup_dwdp
    from dwdp.worker.main import resolve_host_settings
    from dwdp.worker.models import adapter_for
    from dwdp.worker.transport.base import RendezvousConfig
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    lines = _Lines()
    record: dict = {}
    config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=WORLD,
                              secret=RENDEZVOUS_SECRET, address=("127.0.0.1", port), timeout_s=120)

    def attached(index: int, ck: str, change=None, **launch):
        os.environ["DWDP_INCARNATION"] = f"s{index}"
        os.environ["DWDP_GROUP"] = group
        cfg = LaunchConfig.model_validate(_launch(ckpts[ck], **launch))
        model, tok = load_checkpoint(ckpts[ck], dtype=cfg.model.dtype)
        if change is not None:
            change(model)
        settings = resolve_host_settings(cfg, rank, {"now": "setup"})  # as run_worker
        return model, tok, setup_dwdp(model, adapter_for(model), cfg, group=transport,
                                      settings=settings)

    with TcpStoreTransport(config) as transport:
        # 1. rank 1's scalar one bfloat16 ULP off, cast from float32: rank 0's value installed
        model, tok, att = attached(0, "fp32+1" if rank == 1 else "fp32", dtype="bfloat16")
        param = dict(model.named_parameters())[SCALAR]
        record["scalars"] = att.status()["scalars"]
        record["scalar_bytes"] = param.detach().view(torch.int16).tolist()
        att.close()

        # 2. dense DWDP on a wide model, 3 expert slots: what moves, the INFO line; after
        #    close() reloads and updates are still refused
        lines.take()
        model, tok, att = attached(1, "wide", dense=True, slots=3)
        record["wide_info"] = [m for level, m in lines.take() if SLOTS_INFO in m]
        record["moved"] = sorted(t.name for b in att.dense.layout.blobs for t in b.tensors())
        record["replicated"] = {r.name: r.reason for r in att.dense.layout.replicated}
        record["wide_tokens"] = _generate(model, tok)
        att.close()
        layer = model.model.layers[1]
        record["dense_reload_after_close"] = _refused(
            lambda: layer.load_state_dict(layer.state_dict()))
        record["dense_update_after_close"] = _refused(lambda: att.update_weights({}))

        # 3. an MoE layer DWDP cannot manage (another expert count): kept whole
        model, tok, att = attached(2, "fp32", change=_grow_layer_2)
        logged = lines.take()
        record["unmanaged_warnings"] = [m for level, m in logged if level == 30
                                        and "keeps its full expert table" in m]
        record["unmanaged_status"] = att.status()["unmanaged_moe_layers"]
        record["moe_layers"] = att.status()["moe_layers"]
        record["grown_is_whole"] = tuple(model.model.layers[2].mlp.experts.down_proj.shape)
        record["grown_tokens"] = _generate(model, tok)
        record["slots_info_2"] = [m for level, m in logged if SLOTS_INFO in m]
        att.close()
        record["expert_reload_after_close"] = _refused(lambda: model.load_state_dict(
            model.state_dict()))
        record["expert_update_after_close"] = _refused(lambda: att.update_weights({}))

        # 4. a repeated layer declared in config.json, run three times in a row per forward
        model, tok, att = attached(3, "repeated", change=_draft_layer_2)
        record["repeated_tokens"] = _generate(model, tok)
        stats = att.expert_schedule.stats
        record["repeated"] = {"declared": att.status()["repeated_moe_layers"],
                              "repeats": stats.repeats, "demand": stats.demand_copies,
                              "copies": att.counters.copies}
        att.close()
    (out / f"rules.{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def rules(tmp_path_factory, ckpts):
    out = tmp_path_factory.mktemp("ranks")
    group = f"s{uuid.uuid4().hex[:10]}"
    port = free_port()
    run_group(out, group, WORLD, lambda rank, out: _setup_rank(rank, out, group, port, ckpts))
    return [json.loads((out / f"rules.{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def references(ckpts):
    torch.set_num_threads(1)
    refs = {}
    for key, ck, change in (("wide", "wide", None), ("grown", "fp32", _grow_layer_2),
                            ("repeated", "repeated", _draft_layer_2)):
        model, tok = load_checkpoint(ckpts[ck])
        if change is not None:
            change(model)
        refs[key] = _generate(model, tok)
    return refs


def test_one_ulp_from_float32_installs_rank_0s_value(rules):
    assert rules[0]["scalars"]["installed"] == []
    assert rules[1]["scalars"]["installed"] == [SCALAR]
    assert rules[0]["scalars"]["compared"] == rules[1]["scalars"]["compared"] > 0
    assert rules[0]["scalar_bytes"] == rules[1]["scalar_bytes"]


def test_dense_moves_only_storages_of_at_least_one_mib(rules, ckpts, references):
    model, _tok = load_checkpoint(ckpts["wide"])
    params = dict(model.named_parameters())
    for rec in rules:
        assert rec["moved"], "nothing of the wide model moved"
        for name in rec["moved"]:
            assert params[name].untyped_storage().nbytes() >= DENSE_MIN_BYTES, name
        small = [n for n, why in rec["replicated"].items() if "under" in why]
        assert "model.layers.1.mlp.gate.weight" in small
        assert "model.layers.1.input_layernorm.weight" in small
        for name in small:
            assert params[name].untyped_storage().nbytes() < DENSE_MIN_BYTES, name
        assert rec["wide_tokens"] == references["wide"]


def test_more_than_two_slots_logs_one_info_line(rules):
    for rec in rules:
        assert len(rec["wide_info"]) == 1 and rec["wide_info"][0].startswith("DWDP: 3 expert")
        assert rec["slots_info_2"] == []


def test_unmanaged_layer_keeps_its_full_table_warned_once_and_counted(rules, references):
    for rec in rules:
        assert rec["unmanaged_status"] == {"expert_count": 1}
        assert rec["moe_layers"] == [1]
        assert rec["grown_is_whole"][0] == 5
        assert len(rec["unmanaged_warnings"]) == 1
        assert "model.layers.2" in rec["unmanaged_warnings"][0]
        assert rec["grown_tokens"] == references["grown"]


def test_declared_repeated_layer_keeps_its_slot(rules, references):
    for rec in rules:
        rep = rec["repeated"]
        assert rep["declared"] == [1]  # MoE order of decoder layer 2
        # two repeats per forward bind the resident copy: no copy on demand, no re-gather
        assert rep["repeats"] > 0 and rep["repeats"] % 2 == 0
        assert rep["demand"] == 0
        assert rec["repeated_tokens"] == references["repeated"]


def test_reload_guards_survive_teardown(rules):
    for rec in rules:
        assert rec["dense_reload_after_close"] and rec["dense_update_after_close"]
        assert rec["expert_reload_after_close"] and rec["expert_update_after_close"]

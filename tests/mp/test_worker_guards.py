"""DWDP on a real model, 4 rank processes: weight guards, updates with invalidate_prefetch,
recovery after an aborted forward, and fail-together when expert setup fails on one rank."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from conftest import RENDEZVOUS_SECRET, run_group  # noqa: E402
from ports import free_port  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402

WORLD = 4
NUM_EXPERTS = 7
PROMPTS = ("Hello world, the", "What is the capital", "a b c")
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
FAIL_RANK = 2


def _update(model) -> dict[str, torch.Tensor]:
    """A deterministic weight update: a new expert table and a new router."""
    gen = torch.Generator().manual_seed(5)
    layer = model.model.layers[2].mlp
    return {
        "model.layers.2.mlp.experts.down_proj": torch.randn(
            layer.experts.down_proj.shape, generator=gen
        )
        * 0.3,
        "model.layers.2.mlp.gate.weight": torch.randn(layer.gate.weight.shape, generator=gen),
    }


def _run(model, tok):
    engine = ContinuousEngine(model, tok, model_name="x")
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return [
        (r.token_ids, torch.stack(r.logits))
        for r in engine.run_batch(ids, PARAMS, keep_logits=True)
    ]


def _rank_main(rank: int, out: Path, group: str, port: int, ckpt: str) -> None:

    torch.set_num_threads(1)
    from dwdp.worker.attachment import WeightsShardedError
    from dwdp.worker.backend.cpu import CpuBackend
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for
    from dwdp.worker.setup.phases import FailAt, FailureInjector, SetupError
    from dwdp.worker.transport.base import RendezvousConfig
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    record: dict = {}
    config = RendezvousConfig(
        group=group,
        incarnation="i0",
        rank=rank,
        world_size=WORLD,
        secret=RENDEZVOUS_SECRET,
        address=("127.0.0.1", port),
        timeout_s=120,
    )
    partition = expert_partition(NUM_EXPERTS, WORLD)

    def attached(index, dense):
        model, tok = load_checkpoint(ckpt)
        backend = CpuBackend(group=group, incarnation=f"s{index}", rank=rank)
        att = attach(
            model,
            adapter_for(model),
            backend=backend,
            transport=transport,
            partition=partition,
            enable_dense=dense,
            num_slots=2,
        )
        return model, tok, att

    with TcpStoreTransport(config) as transport:
        # 1. expert DWDP alone: load_state_dict refused, update_weights + invalidate_prefetch
        model, tok, att = attached(0, dense=False)
        try:
            model.load_state_dict(model.state_dict())
            record["expert_load_refused"] = False
        except WeightsShardedError as exc:
            record["expert_load_refused"] = "update_weights" in str(exc)
        _run(model, tok)  # prime the prefetch: the update must invalidate it
        record["written"] = att.update_weights(_update(model))
        record["invalidations"] = att.expert_schedule.stats.invalidations
        torch.save(_run(model, tok), out / f"updated.{rank}.pt")
        att.close()

        # 2. dense + expert: every update refused, before anything changes
        model, tok, att = attached(1, dense=True)
        for what, call in (
            (
                "load",
                lambda: model.model.layers[1].load_state_dict(model.model.layers[1].state_dict()),
            ),
            ("update", lambda: att.update_weights(_update(model))),
        ):
            try:
                call()
                record[f"dense_{what}_refused"] = False
            except WeightsShardedError:
                record[f"dense_{what}_refused"] = True

        # 3. an aborted forward (an exception inside layer 2's experts), then a clean one
        calls = {"n": 0}

        def fail_once(_module, _args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected forward failure")

        handle = model.model.layers[2].mlp.experts.register_forward_pre_hook(fail_once)
        try:
            _run(model, tok)
            record["aborted"] = False
        except RuntimeError as exc:
            record["aborted"] = "injected" in str(exc)
        handle.remove()
        torch.save(_run(model, tok), out / f"after_abort.{rank}.pt")
        record["dense_aborts"] = att.dense_schedule.stats.aborts
        att.close()

        # 4. expert setup fails on one rank: every rank raises after the same collective and
        #    keeps its replicated tables
        model, tok = load_checkpoint(ckpt)
        try:
            attach(
                model,
                adapter_for(model),
                backend=CpuBackend(group=group, incarnation="s3", rank=rank),
                transport=transport,
                partition=partition,
                enable_dense=False,
                injector=FailureInjector((FailAt("allocate", FAIL_RANK),)),
            )
            record["setup_failed"] = None
        except SetupError as exc:
            record["setup_failed"] = {"phase": str(exc.phase), "ranks": list(exc.failed_ranks)}
        torch.save(_run(model, tok), out / f"after_fail.{rank}.pt")
    (out / f"guards.{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(
        make_checkpoint(
            "deepseek_v3",
            tmp_path_factory.mktemp("ck") / "ds",
            num_experts=NUM_EXPERTS,
            num_layers=3,
            seed=2,
        )
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, ckpt):
    out = tmp_path_factory.mktemp("ranks")
    group = f"g{uuid.uuid4().hex[:10]}"
    port = free_port()
    run_group(out, group, WORLD, lambda rank, out: _rank_main(rank, out, group, port, ckpt))
    return out, [json.loads((out / f"guards.{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference(ckpt):
    torch.set_num_threads(1)  # as the ranks: another thread count may sum in another order
    model, tok = load_checkpoint(ckpt)
    plain = _run(model, tok)
    with torch.no_grad():
        for name, value in _update(model).items():
            dict(model.named_parameters())[name].copy_(value)
    return plain, _run(model, tok)


def _equal(got, want):
    return all(a == c and torch.equal(b, d) for (a, b), (c, d) in zip(got, want, strict=True))


def test_expert_only_update_then_invalidate(run, reference):
    out, records = run
    _plain, updated = reference
    for rank, rec in enumerate(records):
        assert rec["expert_load_refused"]
        assert rec["written"] == 2
        assert rec["invalidations"] == 1
        assert _equal(torch.load(out / f"updated.{rank}.pt"), updated), rank


def test_dense_refuses_every_update(run):
    _out, records = run
    for rec in records:
        assert rec["dense_load_refused"] and rec["dense_update_refused"]


def test_aborted_forward_recovers_bitwise(run, reference):
    out, records = run
    plain, _updated = reference
    for rank, rec in enumerate(records):
        assert rec["aborted"] and rec["dense_aborts"] >= 1
        assert _equal(torch.load(out / f"after_abort.{rank}.pt"), plain), rank


def test_expert_setup_fails_together_and_keeps_the_model(run, reference):
    out, records = run
    plain, _updated = reference
    for rank, rec in enumerate(records):
        assert rec["setup_failed"] == {"phase": "allocate", "ranks": [FAIL_RANK]}
        assert _equal(torch.load(out / f"after_fail.{rank}.pt"), plain), rank

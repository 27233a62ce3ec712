"""The demo model served through the real worker path with DWDP: 4 forked rank processes over
the cpu backend and a TCP store, expert + dense DWDP (8 routed experts, 2 per rank), each
answering the demo's prompts (scripts/demo.py PROMPTS and CHAT, rendered as the server
renders them) greedily. Every rank's tokens and logits equal one process with replicated
weights, and the answers are the facts the model learned (" Paris." after "The capital of
France is").

The model is the one the demo serves with its trained MTP layer beside it
(``cached_demo_mtp_model`` in the shared cache; trained there on first use, about 40 seconds
on one core); the ranks also answer with speculative decoding on (n-gram and MTP drafts), which
changes no token.
"""

from __future__ import annotations

import json
import sys
import uuid
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
from dwdp_dev.devcluster.paths import cache_dir  # noqa: E402
from dwdp_dev.worker.demo_mtp import cached_demo_mtp_model  # noqa: E402

WORLD = 4
NUM_EXPERTS = 8
PROMPTS = ("The capital of France is", "Once upon a time", "DWDP shares the experts")
CHAT = "Say hello to the DWDP group."
PARAMS = SamplingParams(max_tokens=8)


def _prompt_ids(tok) -> list[list[int]]:
    """The demo's requests as the server tokenizes them: completions with the tokenizer's
    special tokens, the chat rendered by the chat template."""
    chat = tok.apply_chat_template(
        [{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=False
    )
    return [tok(p, add_special_tokens=True)["input_ids"] for p in PROMPTS] + [
        tok(chat, add_special_tokens=False)["input_ids"]
    ]


def _batch(tok, rank: int) -> list[list[int]]:
    prompts = _prompt_ids(tok)
    return prompts[rank:] + prompts[:rank]


def _rank_main(rank: int, out: Path, group: str, port: int, checkpoint: str) -> None:
    torch.set_num_threads(1)
    from dwdp.worker.backend.cpu import CpuBackend
    from dwdp.worker.bringup import attach
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
        model, tok = load_checkpoint(checkpoint)
        attachment = attach(
            model,
            adapter_for(model),
            backend=CpuBackend(group=group, incarnation="i0", rank=rank),
            transport=transport,
            partition=expert_partition(NUM_EXPERTS, WORLD),
            enable_dense=True,
            num_slots=2,
        )
        try:
            engine = ContinuousEngine(model, tok, model_name="demo")
            results = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
            drafted = _drafted(model, tok, checkpoint, rank)
            status = attachment.status()
        finally:
            attachment.close()
    torch.save([(r.token_ids, torch.stack(r.logits)) for r in results], out / f"out.{rank}.pt")
    (out / f"s.{rank}.json").write_text(
        json.dumps({"texts": [r.text for r in results], "phase": status["phase"],
                    "drafted": drafted})
    )


def _drafted(model, tok, checkpoint: str, rank: int) -> dict:
    """The same batch on the DWDP-attached model with speculative decoding (n-gram, then the
    checkpoint's MTP layer): each method's tokens and accepted drafts (verify steps of several
    tokens per request run through the prefetch schedule like any step)."""
    from dwdp.worker.engine.base import EngineConfig
    from dwdp.worker.engine.speculative import SpeculativeConfig
    from dwdp.worker.loading.mtp import load_mtp

    out = {}
    for spec in (SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                   prompt_lookup_max=3),
                 SpeculativeConfig(method="mtp", num_speculative_tokens=2)):
        engine = ContinuousEngine(model, tok, model_name="demo",
                                  config=EngineConfig(speculative=spec))
        if spec.method == "mtp":
            engine.attach_draft_layer(load_mtp(checkpoint, model.config, dtype=model.dtype,
                                               device="cpu"))
        results = engine.run_batch(_batch(tok, rank), PARAMS)
        out[spec.method] = {"tokens": [r.token_ids for r in results],
                            "accepted": engine.stats.spec_accepted_tokens}
    return out


@pytest.fixture(scope="module")
def checkpoint() -> str:
    """The demo model with its trained MTP layer (the same weights as the demo's, and the
    layer beside them)."""
    return str(cached_demo_mtp_model(cache_dir() / "models"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("ranks")
    group = f"d{uuid.uuid4().hex[:10]}"
    port = free_port()
    run_group(
        out,
        group,
        WORLD,
        lambda rank, out: _rank_main(rank, out, group, port, checkpoint),
        timeout_s=300,
    )
    return out


def test_every_rank_answers_as_the_replicated_model(run, checkpoint):
    torch.set_num_threads(1)
    model, tok = load_checkpoint(checkpoint)
    engine = ContinuousEngine(model, tok, model_name="demo")
    for rank in range(WORLD):
        want = engine.run_batch(_batch(tok, rank), PARAMS, keep_logits=True)
        got = torch.load(run / f"out.{rank}.pt")
        assert len(got) == len(want) == len(PROMPTS) + 1
        for (tokens, logits), ref in zip(got, want, strict=True):
            assert tokens == ref.token_ids, rank
            assert torch.equal(logits, torch.stack(ref.logits)), rank


def test_the_answers_are_the_facts(run):
    records = read_records(run, "s", WORLD)
    for rank, rec in enumerate(records):
        assert rec["phase"] == "committed"
        texts = rec["texts"][-rank:] + rec["texts"][:-rank] if rank else rec["texts"]
        france, story, dwdp, chat = texts
        assert france == " Paris.", rank
        assert story.startswith(" there was a tiny model"), rank
        assert dwdp == " across the ranks of a group.", rank
        assert chat.startswith("Hello, DWDP group!"), rank


def test_speculative_decoding_on_the_dwdp_group_changes_no_token(run):
    """n-gram and MTP drafts on every rank of the group (its steps, verify steps included,
    run through the prefetch schedule): the greedy tokens of the plain run, drafts accepted."""
    for rank in range(WORLD):
        got = torch.load(run / f"out.{rank}.pt")
        drafted = read_records(run, "s", WORLD)[rank]["drafted"]
        for method in ("ngram", "mtp"):
            assert drafted[method]["tokens"] == [tokens for tokens, _ in got], (rank, method)
        assert drafted["mtp"]["accepted"] > 0, rank

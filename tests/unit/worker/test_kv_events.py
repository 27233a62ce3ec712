"""KV cache events in vLLM's format: a subscriber written against vLLM's published event schema
(msgspec structs, as vLLM's ``kv_events_subscriber`` example declares them) receives the
engine's events over a real ZMQ socket and replays them to exactly the prefix cache's blocks."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from dwdp.api.launch import KvCacheConfig  # noqa: E402
from dwdp.worker.engine.base import EngineConfig  # noqa: E402
from dwdp.worker.engine.continuous import ContinuousEngine  # noqa: E402
from dwdp.worker.engine.kv_events import (  # noqa: E402
    KvEventPublisher,
    KvEventsError,
    external_hash,
)
from dwdp.worker.engine.protocol import SamplingParams  # noqa: E402
from dwdp.worker.loading.checkpoint import load_checkpoint  # noqa: E402
from dwdp.worker.main import attach_kv_events  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import free_port  # noqa: E402

BLOCK = 4


# vLLM's event schema (vllm.distributed.kv_events), declared as a subscriber would
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=5)
    return load_checkpoint(path)


def _receive(sub, until) -> list[tuple[bytes, int, KVEventBatch]]:
    """Messages as (topic, sequence number, batch) until ``until(messages)`` holds (10 s)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got: list[tuple[bytes, int, KVEventBatch]] = []
    deadline = time.monotonic() + 10
    while not until(got):
        assert time.monotonic() < deadline, f"events still missing after {len(got)} messages"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def test_the_events_replay_to_the_cache_and_decode_with_vllms_schema(loaded):
    """A rank binds a loopback endpoint; a subscriber connects before any request. Requests
    that share prefixes, in a pool small enough to evict: the subscriber's replay of
    BlockStored / BlockRemoved equals the hashes the cache holds, each BlockStored's tokens
    are its blocks' tokens, the topic is llm-d's kv@{pod_ip}@{model}, the sequence numbers
    have no gap and the first batch is AllBlocksCleared."""
    model, tok = loaded
    engine = ContinuousEngine(model, tok, model_name="tiny", config=EngineConfig(
        max_model_len=64, block_size=BLOCK, kv_capacity_tokens=16 * BLOCK, max_batch_size=2))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = KvCacheConfig.model_validate({"events": {"endpoint": endpoint}}).events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    close = attach_kv_events(engine, events, "10.1.2.3")
    assert close is not None
    try:
        sub.connect(endpoint)
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher first
        engine.kv_events.publish([])  # a batch sent after the subscriber joined
        first = _receive(sub, lambda got: bool(got))
        vocab = model.config.get_text_config().vocab_size
        rng = random.Random(3)
        prefix = [rng.randrange(vocab) for _ in range(12)]
        prompts = [prefix + [rng.randrange(vocab) for _ in range(n)] for n in (5, 9, 14, 3)]
        prompts += [[rng.randrange(vocab) for _ in range(n)] for n in (30, 22)]
        engine.run_batch(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        held = {external_hash(h) for h in engine.allocator._by_hash}
        seen: set[int] = set()

        def replayed(got) -> bool:
            seen.clear()
            for _, _, batch in first + got:
                for ev in batch.events:
                    if isinstance(ev, AllBlocksCleared):
                        seen.clear()
                    elif isinstance(ev, BlockStored):
                        seen.update(ev.block_hashes)
                    else:
                        seen.difference_update(ev.block_hashes)
            return seen == held

        got = first + _receive(sub, replayed)
    finally:
        close()
        sub.close()
        ctx.term()
    assert engine.stats.prefix_cache_hits > 0 and held
    removed = [e for _, _, b in got for e in b.events if isinstance(e, BlockRemoved)]
    assert removed, "the pool of 16 blocks evicted nothing"
    topics = {t for t, _, _ in got}
    assert topics == {b"kv@10.1.2.3@tiny"}
    seqs = [s for _, s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert isinstance(got[0][2].events[0], AllBlocksCleared)
    for _, _, batch in got:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and ev.medium == "CPU" and ev.lora_id is None
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)


def test_an_endpoint_that_cannot_be_bound_is_one_error_naming_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(KvEventsError, match=r"^kvCache.events.endpoint: cannot bind tcp://"):
            KvEventPublisher(endpoint, "t", bind=True, block_size=BLOCK, medium="CPU")


@pytest.mark.parametrize(
    ("events", "needle"),
    [
        ({"endpoint": "tcp://*:5557"}, "wildcard address"),
        ({"endpoint": "tcp://0.0.0.0:5557"}, "wildcard address"),
        ({"endpoint": "http://epp:5557"}, "String should match pattern"),
    ],
)
def test_endpoints_that_would_listen_everywhere_or_are_not_zmq_tcp_are_refused(events, needle):
    with pytest.raises(ValueError, match=needle):
        KvCacheConfig.model_validate({"events": events})


def test_events_without_prefix_caching_are_refused():
    with pytest.raises(ValueError, match="events describe the prefix cache"):
        KvCacheConfig.model_validate(
            {"prefixCaching": False, "events": {"endpoint": "tcp://epp:5557"}})

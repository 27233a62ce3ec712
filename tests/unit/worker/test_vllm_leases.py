"""A context rank's KV lease under a slow vLLM decode server (issue 33, item 4): vLLM 0.32.0's
decode side keeps the lease of a request it waits to read alive with heartbeats, and a lease
nobody keeps alive expires.

What vLLM 0.32.0 does (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of the wheel):
its scheduler tracks every request with ``do_remote_prefill`` from the moment it arrives until
its KV is received (``on_new_request``; ``update_connector_output`` stops it), and every
``kv_lease_duration // 6`` seconds (5 s by default) packs them into the step's metadata; its
worker then handshakes with the prefill engine if it has not yet and sends each of that
engine's agents the NIXL notification ``HB:<remote request id>,<id>,...``. When it reads, the
READ carries the notification ``<remote request id>:<consumers>`` (``pull_worker``); a lease
whose request is never read nor heartbeaten expires on the prefill side.

The decode side here is a real NIXL agent doing what that worker does on the wire, with times
shrunk to a 2-second lease: the ZMQ handshake (``get_meta_msg``) with the rank's side channel,
heartbeats every half second while it "waits", a READ of the staged blocks of every layer with
the final notification. The rank is the real engine behind the OpenAI app with its
``VllmProducer`` (real NIXL over UCX/TCP on loopback). No vLLM needed.

And with real vLLM (``vllm_env``; skipped without it): a decode server with one run slot
(``--max-num-seqs 1``) and ``kv_lease_duration`` 6 (a heartbeat a second) is busy with long
requests while the rank's prefilled request waits in its queue, longer than the rank's lease;
the lease survives on vLLM's heartbeats and the answer is vLLM's own.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from vllm_env import VLLM_PYTHON, needs_vllm  # noqa: E402

httpx = pytest.importorskip("httpx")

from dwdp.worker.disagg.vllm_nixl import VllmInterop  # noqa: E402
from dwdp_dev.worker.checkpoint import make_checkpoint  # noqa: E402
from dwdp_dev.worker.servers import EngineServer, VllmServer, free_port, wait_for  # noqa: E402

KEY = "vllm-lease-key"
LEASE_S = 2.0
HEARTBEAT_S = 0.5
PROMPT = [(7 * i) % 200 + 3 for i in range(150)]  # two vLLM blocks


class DecodeSide:
    """vLLM 0.32.0's decode worker as the prefill rank sees it: a NIXL agent that handshakes
    over the rank's ZMQ side channel at ``host:port``, sends heartbeats and READs staged
    blocks with the final notification."""

    def __init__(self, host: str, port: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, 10000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(msgpack.packb((b"get_meta_msg", 0, 0)))
            payload = msgpack.unpackb(sock.recv_multipart()[0])
        finally:
            ctx.destroy(linger=0)
        self.meta = msgpack.unpackb(payload["agent_metadata_bytes"])
        # vLLM's decode agent: a uuid for a name, NIXL's default progress thread
        self.agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
        name = self.agent.add_remote_agent(self.meta["agent_metadata"])
        self.remote = name.decode() if isinstance(name, bytes) else str(name)

    def heartbeat(self, request_ids: list[str]) -> None:
        """``HB:<id>,<id>`` as vLLM's ``_send_heartbeats`` sends it."""
        self.agent.send_notif(self.remote, ("HB:" + ",".join(request_ids)).encode())

    def read(self, request_id: str, block_ids: list[int]) -> list[torch.Tensor]:
        """READ ``block_ids`` of every layer's staging region, notifying ``<id>:1`` (one
        consumer) as vLLM's pull worker does; returns per layer [blocks, block_len] bytes."""
        block_len = self.meta["block_lens"][0]
        layers = len(self.meta["kv_caches_base_addr"])
        local = torch.zeros(layers, len(block_ids), block_len, dtype=torch.uint8)
        registered = self.agent.register_memory([local])
        far, near = [], []
        for i, base in enumerate(self.meta["kv_caches_base_addr"]):
            for j, block in enumerate(block_ids):
                far.append((base + block * block_len, block_len, 0))
                near.append((local[i, j].data_ptr(), block_len, 0))
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(near, "DRAM"),
            self.agent.get_xfer_descs(far, "DRAM"), self.remote, f"{request_id}:1".encode())
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + 30
            while state not in ("DONE", "ERR"):
                assert time.monotonic() < deadline, "the READ did not finish"
                time.sleep(0.001)
                state = self.agent.check_xfer_state(handle)
            assert state == "DONE"
        finally:
            self.agent.release_xfer_handle(handle)
            self.agent.deregister_memory(registered)
        return list(local)

    def close(self) -> None:
        self.agent.remove_remote_agent(self.remote)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "q", num_experts=4,
                           num_layers=2, hidden_size=64, head_dim=32, moe_width=32)


@pytest.fixture
def rank(checkpoint):
    interop = VllmInterop(model=str(checkpoint), port=free_port())
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, vllm=interop,
                      model_name="m", lease_s=LEASE_S) as ctx:
        yield ctx


def _prefill(ctx: EngineServer) -> dict:
    r = ctx.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)


def test_heartbeats_keep_a_slow_readers_lease_past_lease_s(rank):
    """The decode side waits three leases long, heartbeating: the staged blocks stay held and
    are read intact afterwards; the final notification ends the lease and every block (the
    staging and dwdp's) comes back."""
    params = _prefill(rank)
    producer = rank.engine.kv.vllm
    rid, blocks = params["remote_request_id"], params["remote_block_ids"][0]
    assert len(blocks) == 2 and rank.engine.kv.leases == 1
    staged = [_as_bytes(t[blocks]).clone() for t in producer.staging]
    decode = DecodeSide(params["remote_host"], params["remote_port"])
    try:
        waited = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < waited:
            decode.heartbeat([rid])
            time.sleep(HEARTBEAT_S)
            assert rank.engine.kv.leases == 1, "the lease ended under heartbeats"
        assert rank.engine.kv.leases_expired == 0
        read = decode.read(rid, blocks)
        assert all(torch.equal(got, want) for got, want in zip(read, staged, strict=True))
        assert any(bool(w.any()) for w in staged)  # the prefill's KV, not an empty buffer
        wait_for(lambda: rank.engine.kv.leases == 0, "the final notification ended no lease")
    finally:
        decode.close()
    assert rank.engine.kv.leases_expired == 0
    wait_for(lambda: rank.engine.allocator.num_in_use == 0, "dwdp's blocks still held")
    assert producer.free_staging_blocks == producer.num_staging


def test_without_heartbeats_the_lease_expires_and_the_blocks_come_back(rank):
    """The same wait without heartbeats: the lease expires after lease_s (counted in
    leases_expired, on /dwdp/status too), its staging and dwdp blocks return to their pools,
    and a heartbeat for it afterwards holds nothing."""
    params = _prefill(rank)
    producer = rank.engine.kv.vllm
    rid = params["remote_request_id"]
    decode = DecodeSide(params["remote_host"], params["remote_port"])
    try:
        started = time.monotonic()
        assert rank.engine.kv.leases == 1
        wait_for(lambda: rank.engine.kv.leases == 0, "the lease never expired",
                 timeout=LEASE_S + 10)
        assert time.monotonic() - started >= LEASE_S * 0.9
        assert rank.engine.kv.leases_expired == 1
        status = rank.client.get("/dwdp/status").json()["kv_transfer"]
        assert status["leases_expired"] == 1 and status["leases"] == 0
        decode.heartbeat([rid])
        time.sleep(HEARTBEAT_S)
        assert rank.engine.kv.leases == 0
    finally:
        decode.close()
    wait_for(lambda: rank.engine.allocator.num_in_use == 0, "dwdp's blocks still held")
    assert producer.free_staging_blocks == producer.num_staging


VLLM_LEASE_S = 3.0
"""The rank's lease under real vLLM: three of the decode side's heartbeats (one a second)."""
BUSY_S = 3 * VLLM_LEASE_S
"""How long vLLM's one run slot stays taken after the prefilled request arrived."""
BLOCKERS = 4
"""Streamed requests ahead of the prefilled one on vLLM's one run slot (480 tokens each, so
that they outlast ``BUSY_S`` on a fast host), closed by the client after ``BUSY_S``."""


class Blocker(threading.Thread):
    """A streamed completion that holds vLLM's run slot (or waits for it) until ``stop`` is
    set; the client then closes the stream and vLLM aborts the request."""

    def __init__(self, base: str, body: dict, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.stop = base, body, stop

    def run(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", self.base + "/v1/completions", headers=headers, timeout=600,
                          json={**self.body, "stream": True}) as response:
            for _ in response.iter_lines():
                if self.stop.is_set():
                    return


@needs_vllm
def test_a_real_vllm_decode_server_keeps_the_lease_while_it_is_busy(checkpoint):
    """vLLM 0.32.0 busy on its one run slot: the rank's prefilled request waits in its queue
    behind other requests for three of the rank's leases; vLLM's heartbeats keep the lease
    (none expires), it reads the staged KV when the slot frees and answers as when it serves
    the checkpoint alone; the final notification ends the lease."""
    import httpx

    args = ["--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching",
            "--api-key", KEY, "--max-num-seqs", "1"]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    interop = VllmInterop(model=str(checkpoint), port=free_port())
    stop = threading.Event()
    with VllmServer(VLLM_PYTHON, checkpoint, kv_role="kv_consumer", args=args,
                    extra_config={"kv_lease_duration": 6}) as decode, \
            EngineServer(checkpoint, api_key=KEY, max_model_len=512, vllm=interop,
                         model_name=str(checkpoint), lease_s=VLLM_LEASE_S) as ctx:
        alone = httpx.post(decode + "/v1/completions", json=body, headers=headers, timeout=120)
        assert alone.status_code == 200, alone.text
        long = {**body, "prompt": [5, 6, 7], "max_tokens": 480}
        blockers = [Blocker(decode, long, stop) for _ in range(BLOCKERS)]
        timer = threading.Timer(BUSY_S, stop.set)
        try:
            for n, blocker in enumerate(blockers):  # one runs, the others queue in order
                blocker.start()
                wait_for(lambda n=n: _gauges(decode) == (1, n), "vLLM did not queue it",
                         timeout=60)
            params = _prefill(ctx)
            started = time.monotonic()
            timer.start()
            routed = httpx.post(decode + "/v1/completions", headers=headers, timeout=600,
                                json={**body, "kv_transfer_params": params})
            waited = time.monotonic() - started
        finally:
            stop.set()
            timer.cancel()
            for blocker in blockers:
                if blocker.is_alive():
                    blocker.join(60)
        assert routed.status_code == 200, routed.text
        assert waited > 2 * VLLM_LEASE_S, f"vLLM answered in {waited:.1f} s: it was not busy"
        assert routed.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        wait_for(lambda: ctx.engine.kv.leases == 0, "vLLM did not release the lease")
        assert ctx.engine.kv.leases_expired == 0 and ctx.engine.kv.leases_granted == 1


def _gauges(base: str) -> tuple[float, float]:
    """vLLM's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (the one server
    of the test: one sample each)."""
    import httpx

    values = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("vllm:num_requests_running", 0.0), values.get(
        "vllm:num_requests_waiting", 0.0)


def _staged_prefill(ctx: EngineServer) -> httpx.Response:
    return ctx.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})


@pytest.fixture
def small_staging(checkpoint):
    """A context rank whose staging buffer holds two 128-token blocks: one prefill of
    ``PROMPT`` (150 tokens) fills it."""
    interop = VllmInterop(model=str(checkpoint), port=free_port())
    with EngineServer(checkpoint, api_key=KEY, max_model_len=512, vllm=interop, model_name="m",
                      lease_s=LEASE_S, vllm_staging_blocks=2) as ctx:
        yield ctx


def test_a_prefill_waits_for_room_in_a_full_staging_buffer(small_staging) -> None:
    """The first prefill holds the whole buffer; the second waits (its blocks and token kept)
    while the rank answers other requests, and is staged once the first lease expires."""
    ctx = small_staging
    assert _staged_prefill(ctx).status_code == 200
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(_staged_prefill, ctx)
        plain = ctx.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert plain.status_code == 200, plain.text
        assert not second.done()
        answer = second.result(timeout=LEASE_S * 10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["kv_transfer_params"]["remote_block_ids"]
    assert time.monotonic() - started >= LEASE_S * 0.5  # it waited for the lease to end


def test_a_prefill_that_finds_no_room_within_the_lease_time_is_answered_503(
        small_staging) -> None:
    """A slow decode side keeps the first lease alive with heartbeats: the second prefill
    waits one lease time for room, then fails with a 503 naming the setting; the rank serves
    on."""
    ctx = small_staging
    first = _prefill(ctx)
    producer = ctx.engine.kv.vllm
    side = DecodeSide(producer.host, producer.interop.port)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            side.heartbeat([first["remote_request_id"]])

    beats = threading.Thread(target=beat)
    beats.start()
    try:
        r = _staged_prefill(ctx)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "vLLM staging buffer full" in message and "stagingTokens" in message
        plain = ctx.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert plain.status_code == 200, plain.text
    finally:
        stop.set()
        beats.join()
        side.close()

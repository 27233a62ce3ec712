"""The NIXL agent of one engine: its paged KV cache registered, its metadata served, remote blocks
read into local ones.

Each server (context rank or generation server) holds one ``KvAgent`` over its
``PagedKVCache``: every layer's two slot tensors are registered with NIXL (DRAM on the host,
VRAM on a GPU). The side channel is the server's own HTTP port: ``GET /v1/dwdp/kv_agent``
answers ``describe()`` (the NIXL agent metadata, base64, the cache layout and the address of
each layer's tensors), behind the API key when one is set, so only a holder of the deployment's
key can learn where another server's KV cache lives.

A generation server ``connect``s to the context server named by ``kv_transfer_params``
(``remote_host``/``remote_port``) once per remote engine; the layouts must agree (model, dtype,
block size, draft layers, layers and their shapes) or ``TransferError`` names what differs. The
draft layers are the MTP layer's (``engine.speculative.method: mtp``), cache layer
``num_layers`` after the model's: its KV of a prompt moves with the model's, so the generation
server's MTP layer drafts from the first step. ``pull`` reads the remote blocks of every layer
into local blocks with one NIXL READ and, when it is done, notifies
the context side with ``release_message(request_id)``, which frees the lease there.

On the host, UCX is limited to TCP unless ``UCX_TLS`` is set: pods do not share memory, so UCX's
cross-memory transports would fail between them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dwdp.worker.engine.kv_connector import TransferError
from dwdp.worker.engine.paged import PagedKVCache

RELEASE = b"dwdp-kv-release:"
PULL_TIMEOUT_S = 60.0


_WHY = {"draft_layers": " (the MTP layer's KV moves with the model's: "
                        "engine.speculative.method mtp on both servers or on neither)"}
"""What a layout difference means, where the key alone does not say it."""


def release_message(request_id: str) -> bytes:
    """The NIXL notification that ends a request's lease on the context side."""
    return RELEASE + request_id.encode()


def released_request(message: bytes) -> str | None:
    """The request id of a release notification, ``None`` for another message."""
    if message.startswith(RELEASE):
        return message[len(RELEASE) :].decode(errors="replace")
    return None


@dataclass(frozen=True, slots=True)
class RemoteEngine:
    """A connected context server: its agent name and each layer's (K, V) base addresses."""

    name: str
    regions: list[list[int]]


def new_nixl_agent(engine_id: str, *, host_memory: bool) -> Any:
    """A NIXL agent named ``engine_id`` on UCX, without a progress thread: UCX's spins a core
    even while idle (82% of one measured on the host); the engine progresses the agent itself
    (transfers, and the notifications it polls every loop while leases are held: the peer's
    READ progresses then too). ``host_memory``: the agent moves host memory between pods that
    share none, so UCX is held to TCP (``UCX_TLS``, unless set). Raises ``TransferError``
    without the nixl package."""
    if host_memory:
        os.environ.setdefault("UCX_TLS", "tcp")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise TransferError(f"KV transfer needs the nixl package: {exc}") from exc
    return nixl_agent(engine_id, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class KvAgent:
    """The NIXL agent over ``cache`` (every layer allocated; see the module docstring).

    ``model``: the served model's name, part of the layout check. Raises ``TransferError``
    when NIXL is missing or a layer of the cache was never allocated.
    """

    def __init__(self, cache: PagedKVCache, *, model: str, num_layers: int,
                 draft_layers: int = 0) -> None:
        total = num_layers + draft_layers
        missing = [i for i in range(total) if i not in cache.layers]
        if missing:
            raise TransferError(f"KV cache layers {missing} were never allocated")
        self.cache = cache
        self.model = model
        self.draft_layers = draft_layers
        self.engine_id = f"dwdp-{uuid.uuid4().hex[:12]}"
        self._agent = new_nixl_agent(self.engine_id, host_memory=cache.device.type == "cpu")
        self._tensors = [t for i in range(total) for t in cache.layers[i]]
        self._registered = self._agent.register_memory(self._tensors)
        self.memory_type = "DRAM" if cache.device.type == "cpu" else "VRAM"  # NIXL's name
        self._dev = 0 if cache.device.type == "cpu" else (cache.device.index or 0)
        self._remotes: dict[str, RemoteEngine] = {}

    def layout(self) -> dict[str, Any]:
        """What two servers must share to exchange blocks."""
        return {
            "model": self.model,
            "dtype": str(self.cache.dtype),
            "block_size": self.cache.block_size,
            "draft_layers": self.draft_layers,
            "layers": [
                [list(t.shape[1:]) for t in self.cache.layers[i]]
                for i in range(len(self._tensors) // 2)
            ],
        }

    def describe(self) -> dict[str, Any]:
        """The side channel's answer: agent metadata, layout, tensor addresses."""
        return {
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "layout": self.layout(),
            "regions": [
                [self._tensors[2 * i].data_ptr(), self._tensors[2 * i + 1].data_ptr()]
                for i in range(len(self._tensors) // 2)
            ],
        }

    def connect(self, described: dict[str, Any]) -> RemoteEngine:
        """Add the remote agent ``described`` (its ``describe()``); raises ``TransferError``
        when the layouts differ (naming the first field) or the answer is malformed."""
        engine_id = str(described.get("engine_id", ""))
        if engine_id in self._remotes:
            return self._remotes[engine_id]
        theirs, ours = described.get("layout") or {}, self.layout()
        for key in ("model", "dtype", "block_size", "draft_layers", "layers"):
            if theirs.get(key) != ours.get(key):
                raise TransferError(
                    f"KV layout differs from {engine_id}: {key} {theirs.get(key)!r} there, "
                    f"{ours.get(key)!r} here{_WHY.get(key, '')}"
                )
        regions = described.get("regions")
        if not isinstance(regions, list) or len(regions) != len(ours["layers"]):
            raise TransferError(f"KV agent {engine_id}: malformed regions")
        try:
            name = self._agent.add_remote_agent(base64.b64decode(described["agent_metadata"]))
        except Exception as exc:  # NIXL's own errors, one line
            raise TransferError(f"KV agent {engine_id}: metadata refused: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        remote = RemoteEngine(name, [[int(a) for a in pair] for pair in regions])
        self._remotes[engine_id] = remote
        return remote

    def known(self, engine_id: str) -> RemoteEngine | None:
        """The connected remote engine of that id, if any."""
        return self._remotes.get(engine_id)

    def pull(
        self,
        remote: RemoteEngine,
        remote_blocks: list[int],
        local_blocks: list[int],
        request_id: str,
    ) -> int:
        """Read ``remote_blocks`` of every layer into ``local_blocks`` (same count), then
        release the remote lease. Returns the bytes read; raises ``TransferError``."""
        if len(remote_blocks) != len(local_blocks):
            raise TransferError(
                f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones"
            )
        local, far = [], []
        for i, pair in enumerate(remote.regions):
            for t, base in zip(self.cache.layers[i], pair, strict=True):
                size = t[0].numel() * t.element_size() * self.cache.block_size
                for rb, lb in zip(remote_blocks, local_blocks, strict=True):
                    far.append((base + rb * size, size, 0))
                    local.append((t.data_ptr() + lb * size, size, self._dev))
        total = sum(n for _, n, _ in local)
        src = self._agent.get_xfer_descs(far, self.memory_type)
        dst = self._agent.get_xfer_descs(local, self.memory_type)
        try:
            handle = self._agent.initialize_xfer(
                "READ", dst, src, remote.name, release_message(request_id)
            )
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + PULL_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"KV read from {remote.name} timed out")
                time.sleep(0.0005)
                state = self._agent.check_xfer_state(handle)
            self._agent.release_xfer_handle(handle)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"KV read from {remote.name} failed: {exc}") from exc
        if state == "ERR":
            raise TransferError(f"KV read from {remote.name} failed")
        return total

    def released(self) -> list[str]:
        """Request ids whose leases the generation side released since the last call."""
        out = []
        for messages in self._agent.get_new_notifs().values():
            for m in messages:
                rid = released_request(bytes(m))
                if rid is not None:
                    out.append(rid)
        return out

    def close(self) -> None:
        """Deregister the cache (the agent goes with the process)."""
        for remote in self._remotes.values():
            with contextlib.suppress(Exception):  # closing: nothing left to do
                self._agent.remove_remote_agent(remote.name)
        self._remotes.clear()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

"""The disaggregation side of one engine, the engine's ``KvConnector``
(``dwdp.worker.engine.kv_connector``): the NIXL agent, the leases of prefilled requests, and
the side-channel fetch of a context server's agent.

Context role: a request with ``do_remote_decode`` is prefilled; ``request_finished`` answers
its ``kv_transfer_params`` (``do_remote_prefill`` and where the blocks are) and its blocks stay
under a lease of ``lease_s`` seconds (vLLM: 30 s by default); the lease ends when the
generation side's release notification arrives or it expires (a WARNING), and
``finished_blocks`` gives the blocks back to the engine. Generation role: ``prepare_load``
fetches the context server's ``describe()`` from its side channel (``GET /v1/dwdp/kv_agent`` on
the ``remote_host:remote_port`` of the params, with this server's API key: both sides of one
deployment share it), claiming the request's lease there (which extends it, or answers 410
when it is gone, so a late reader gets a clear error instead of blocks reused by another
request), and ``load`` reads the blocks.

Thread use: ``prepare_load`` runs on the server's event loop (the fetch) and a worker thread
(the NIXL call); every other method but ``describe`` runs on the engine thread. Agent calls are
serialised by a lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from dwdp.api.defaults import KV_TRANSFER_LEASE_S
from dwdp.worker.apikey import ApiKey
from dwdp.worker.disagg.agent import KV_AGENT_PATH, KvAgent, RemoteEngine, TransferError
from dwdp.worker.engine.kv_connector import KvEndpoint, KvTransferParams

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0


class KvTransfer:
    """One engine's KV transfer, a ``KvConnector`` (see the module docstring).

    ``agent``: its ``KvAgent``; ``host``/``port``: where generation servers reach this server's
    side channel (its HTTP address); ``api_key``: sent on side-channel fetches (an ``ApiKey``,
    asked at each fetch so a rotated key is used, or a fixed key).
    """

    def __init__(
        self,
        agent: KvAgent,
        *,
        host: str,
        port: int,
        api_key: ApiKey | str | None = None,
        lease_s: float = KV_TRANSFER_LEASE_S,
    ) -> None:
        self.agent = agent
        self.host = host
        self.port = port
        self.api_key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        self.lease_s = lease_s
        self._lock = threading.Lock()  # the agent's calls
        self._lease_lock = threading.Lock()  # the lease table (engine thread and side channel)
        self._leases: dict[str, tuple[list[int], float]] = {}
        self.blocks_received = 0
        self.leases_granted = 0
        self.leases_expired = 0
        self._servers: dict[str, dict[str, Any]] = {}  # engine id -> its "server" identity

    @property
    def leases(self) -> int:
        """Prefilled requests whose blocks wait for their generation side."""
        return len(self._leases)

    def status(self) -> dict[str, int]:
        """The counters of ``/dwdp/status``'s ``kv_transfer``: ``leases`` (held now),
        ``leases_granted`` (requests prefilled here for a remote decode), ``leases_expired``
        (never read), ``blocks_received`` (KV blocks this server read from context servers)."""
        return {
            "leases": self.leases,
            "leases_granted": self.leases_granted,
            "leases_expired": self.leases_expired,
            "blocks_received": self.blocks_received,
        }

    @property
    def endpoint(self) -> KvEndpoint:
        """The NIXL agent's name and this server's advertised side-channel address."""
        return KvEndpoint(self.agent.engine_id, self.host, self.port)

    # -- context side --------------------------------------------------------------------------
    def request_finished(self, request_id: str, blocks: list[int]) -> KvTransferParams:
        """Hold ``blocks`` until the generation side releases them or ``lease_s`` passes; the
        lease exists before the answer leaves, so a fast generation server always finds it.
        Returns the answer's ``kv_transfer_params`` (``do_remote_prefill`` and where)."""
        with self._lease_lock:
            self._leases[request_id] = (list(blocks), time.monotonic() + self.lease_s)
            self.leases_granted += 1
        return KvTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.agent.engine_id,
            remote_request_id=request_id,
            remote_block_ids=list(blocks),
            remote_host=self.host,
            remote_port=self.port,
            tp_size=1,
        )

    def cancel_hold(self, request_id: str) -> None:
        """Forget a lease without freeing its blocks (the request still runs and holds them)."""
        with self._lease_lock:
            self._leases.pop(request_id, None)

    def claim(self, request_id: str) -> list[int] | None:
        """Extend a held lease by ``lease_s`` (the generation side is about to read it) and
        return its block ids; ``None`` when no lease of that request is held (expired,
        released or unknown)."""
        with self._lease_lock:
            held = self._leases.get(request_id)
            if held is None:
                return None
            self._leases[request_id] = (held[0], time.monotonic() + self.lease_s)
            return list(held[0])

    def finished_blocks(self) -> list[list[int]]:
        """Block tables whose lease ended since the last call (the engine frees them)."""
        with self._lock:
            released = self.agent.released()
        now = time.monotonic()
        with self._lease_lock:
            out = [self._leases.pop(rid)[0] for rid in released if rid in self._leases]
            for rid in [r for r, (_, deadline) in self._leases.items() if deadline < now]:
                log.warning("KV lease of request %s expired after %.0f s unread", rid, self.lease_s)
                self.leases_expired += 1
                out.append(self._leases.pop(rid)[0])
        return out

    def describe(self, claim: str | None = None) -> dict[str, Any] | None:
        """The side channel's answer (``KvAgent.describe``); with ``claim``, ``None`` unless
        that request's lease is held (and then extended), and ``lease_block_ids``: the blocks
        of that lease, the only ones its reader may read."""
        blocks = self.claim(claim) if claim is not None else []
        if blocks is None:
            return None
        with self._lock:
            described = self.agent.describe()
        return {**described, "lease_block_ids": blocks} if claim is not None else described

    # -- generation side -----------------------------------------------------------------------
    async def prepare_load(self, params: KvTransferParams) -> None:
        """Claim the lease of ``params`` on its context server and connect to that server
        (once per engine id). Raises ``TransferError`` naming the server when it cannot be
        reached or does not match, or the lease is gone or holds other blocks."""
        import httpx

        engine_id = str(params.remote_engine_id)
        url = f"http://{_host_for_url(str(params.remote_host))}:{params.remote_port}{KV_AGENT_PATH}"
        key = self.api_key.current()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:  # every request claims its lease; the answer also carries the agent
            async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:
                r = await client.get(
                    url, headers=headers, params={"claim": str(params.remote_request_id)}
                )
        except httpx.HTTPError as exc:
            raise TransferError(f"KV side channel {url}: {exc!r}") from exc
        if r.status_code == 410:
            raise TransferError(
                f"KV blocks of request {params.remote_request_id} on {engine_id}: the lease "
                "expired or was released before this server read them"
            )
        if r.status_code != 200:
            raise TransferError(f"KV side channel {url}: HTTP {r.status_code}")
        described = r.json()
        if described.get("lease_block_ids") != params.remote_block_ids:
            # only the blocks leased to this request: other ids are other requests' KV
            raise TransferError(
                f"kv_transfer_params.remote_block_ids: not the blocks of request "
                f"{params.remote_request_id}'s lease on {engine_id}"
            )
        if self.agent.known(engine_id) is not None:
            return
        if described.get("engine_id") != engine_id:
            raise TransferError(
                f"KV side channel {url}: engine {described.get('engine_id')!r}, the params "
                f"name {engine_id!r} (the context server restarted?)"
            )
        await asyncio.to_thread(self._connect, described)
        self._servers[engine_id] = _identity(described.get("server"))

    def server_of(self, engine_id: str) -> dict[str, Any]:
        """The identity a connected context server gave in its side channel's ``server``
        (``role``, ``group``, ``rank``, ``incarnation``, ``pod``; empty when it gave none)."""
        return dict(self._servers.get(engine_id) or {})

    def _connect(self, described: dict[str, Any]) -> RemoteEngine:
        with self._lock:
            return self.agent.connect(described)

    def load(self, params: KvTransferParams, blocks: list[int]) -> None:
        """Read the params' blocks into local ``blocks`` and release them there (after
        ``prepare_load``; ``TransferError``)."""
        remote = self.agent.known(str(params.remote_engine_id))
        if remote is None:
            raise TransferError(f"KV agent {params.remote_engine_id}: not connected")
        with self._lock:
            self.agent.pull(remote, params.block_ids, blocks, str(params.remote_request_id))
        self.blocks_received += len(blocks)

    def close(self) -> None:
        """Deregister the cache from NIXL."""
        with self._lock:
            self.agent.close()


IDENTITY_KEYS = ("role", "group", "rank", "incarnation", "pod")


def _identity(server: Any) -> dict[str, Any]:
    """The known scalar parts of a side channel's ``server`` (anything else dropped)."""
    if not isinstance(server, dict):
        return {}
    return {
        k: server[k]
        for k in IDENTITY_KEYS
        if isinstance(server.get(k), str | int) and not isinstance(server.get(k), bool)
    }


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

"""The disaggregation side of one engine, the engine's ``KvConnector``
(``dwdp.worker.engine.kv_connector``): the NIXL agent, the leases of prefilled requests, and
the side-channel fetch of a context server's agent.

Context role: a request with ``do_remote_decode`` is prefilled; ``request_finished`` answers
its ``kv_transfer_params`` (``do_remote_prefill``, where the blocks are, and the lease's token,
a random secret only that answer carries) and its blocks stay under a lease of ``lease_s``
seconds (vLLM: 30 s by default); the lease ends when the generation side's release notification
arrives (the NIXL READ's, or ``DELETE`` on the side channel when it refused the request), or it
expires (a WARNING), and ``finished_blocks`` gives the blocks back to the engine. Generation
role: ``prepare_load`` fetches the context server's ``describe()`` from its side channel
(``GET /v1/dwdp/kv_agent`` on the ``remote_host:remote_port`` of the params, with this server's
API key: both sides of one deployment share it), claiming the request's lease there with its
token (which extends it; 410 when it is gone, 403 for another token); before any block is read
the side channel's engine must be the params' ``remote_engine_id`` and the lease's blocks their
``remote_block_ids`` (``LeaseError`` naming the field otherwise); ``load`` reads the blocks.
A vLLM prefill server's answer (``KvTransferParams.from_vllm``) goes to the ``VllmReader``
(``dwdp.worker.disagg.vllm_reader``) of a server with ``kvTransfer.vllm``, and is refused (400)
by one without.

[Note: lease binding] A reader gets blocks only from the engine that granted the lease, only
the lease's blocks, and only with the lease's token: params mixing a real lease with another
engine's id, other block ids, or another request's token read nothing.

Thread use: ``prepare_load`` runs on the server's event loop (the fetch) and a worker thread
(the NIXL call); every other method but ``describe`` runs on the engine thread. Agent calls are
serialised by a lock.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dwdp.api.defaults import KV_TRANSFER_LEASE_S
from dwdp.worker.apikey import ApiKey
from dwdp.worker.disagg.agent import KvAgent, RemoteEngine
from dwdp.worker.engine.kv_connector import (
    KV_AGENT_PATH,
    KvEndpoint,
    KvTransferParams,
    LeaseError,
    TransferError,
)

if TYPE_CHECKING:
    from dwdp.worker.disagg.vllm_nixl import VllmProducer
    from dwdp.worker.disagg.vllm_reader import VllmReader

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
TOKEN_BYTES = 18
"""Random bytes of a lease's token (24 URL-safe characters)."""


@dataclass(slots=True)
class Lease:
    """A prefilled request's blocks held for its reader: ``token`` proves the reader got the
    prefill answer; ``deadline`` is ``time.monotonic()`` seconds."""

    blocks: list[int]
    token: str
    deadline: float


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
        vllm: VllmProducer | None = None,
        vllm_reader: VllmReader | None = None,
    ) -> None:
        self.agent = agent
        self.vllm = vllm
        self.vllm_reader = vllm_reader
        self.host = host
        self.port = port
        self.api_key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        self.lease_s = lease_s
        self._lock = threading.Lock()  # the agent's calls
        self._lease_lock = threading.Lock()  # the lease table (engine thread and side channel)
        self._leases: dict[str, Lease] = {}
        self._refused: list[list[int]] = []  # leases the decode side refused, blocks to free
        self.blocks_received = 0
        self.leases_granted = 0
        self._expired = 0  # dwdp leases; the vLLM producer counts its own
        self.leases_refused = 0
        self._servers: dict[str, dict[str, Any]] = {}  # engine id -> its "server" identity

    @property
    def leases(self) -> int:
        """Prefilled requests whose blocks wait for their generation side."""
        return len(self._leases) + (self.vllm.leases if self.vllm is not None else 0)

    @property
    def leases_expired(self) -> int:
        """Leases that ended unread, dwdp generation servers' and vLLM decode servers'."""
        return self._expired + (self.vllm.expired if self.vllm is not None else 0)

    def status(self) -> dict[str, int]:
        """The counters of ``/dwdp/status``'s ``kv_transfer``: ``leases`` (held now),
        ``leases_granted`` (requests prefilled here for a remote decode), ``leases_expired``
        (never read), ``leases_refused`` (released unread by a generation server that refused
        the request), ``blocks_received`` (KV blocks this server read from context servers)."""
        return {
            "leases": self.leases,
            "leases_granted": self.leases_granted,
            "leases_expired": self.leases_expired,
            "leases_refused": self.leases_refused,
            "blocks_received": self.blocks_received,
        }

    @property
    def endpoint(self) -> KvEndpoint:
        """The NIXL agent's name and this server's advertised side-channel address."""
        return KvEndpoint(self.agent.engine_id, self.host, self.port)

    # -- context side --------------------------------------------------------------------------
    def request_finished(
        self, request_id: str, blocks: list[int], num_tokens: int | None = None
    ) -> KvTransferParams:
        """Hold ``blocks`` until the generation side releases them or ``lease_s`` passes; the
        lease exists before the answer leaves, so a fast generation server always finds it.
        Returns the answer's ``kv_transfer_params`` (``do_remote_prefill``, where, and the
        lease's token; for vLLM decode servers, vLLM's answer)."""
        if self.vllm is not None:
            return self._vllm_finished(request_id, blocks, num_tokens)
        token = secrets.token_urlsafe(TOKEN_BYTES)
        with self._lease_lock:
            self._leases[request_id] = Lease(list(blocks), token, time.monotonic() + self.lease_s)
            self.leases_granted += 1
        return KvTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.agent.engine_id,
            remote_request_id=request_id,
            remote_block_ids=list(blocks),
            remote_host=self.host,
            remote_port=self.port,
            remote_lease_token=token,
            tp_size=1,
        )

    def _vllm_finished(
        self, request_id: str, blocks: list[int], num_tokens: int | None
    ) -> KvTransferParams:
        assert self.vllm is not None
        tokens = num_tokens if num_tokens is not None else len(blocks) * self.agent.cache.block_size
        staged = self.vllm.stage(request_id, blocks, tokens)
        with self._lease_lock:
            self.leases_granted += 1
        # built unvalidated: vLLM's answer carries no dwdp lease token
        return KvTransferParams.model_construct(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.vllm.engine_id,
            remote_request_id=request_id,
            remote_block_ids=staged,
            remote_host=self.vllm.host,
            remote_port=self.vllm.interop.port,
            remote_lease_token=None,
            tp_size=1,
            dcp_size=1,
            pp_size=1,
            remote_num_tokens=tokens,
            remote_blocks_expiry_time=None,
            transfer_mode="pull",
        )

    def cancel_hold(self, request_id: str) -> None:
        """Forget a lease without freeing its blocks (the request still runs and holds them)."""
        if self.vllm is not None:
            self.vllm.cancel(request_id)
        with self._lease_lock:
            self._leases.pop(request_id, None)

    def _held(self, request_id: str, token: str | None) -> Lease:
        """The lease of ``request_id`` if ``token`` is its token (the lease lock held);
        ``LeaseError`` 410 when no such lease is held, 403 for another token."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseError(
                410,
                f"kv_transfer_params.remote_request_id: no KV lease of {request_id!r} is held "
                f"on {self.agent.engine_id} (it expired, was released, or was never granted)",
            )
        if token is None or not hmac.compare_digest(token.encode(), lease.token.encode()):
            raise LeaseError(
                403,
                f"kv_transfer_params.remote_lease_token: not the token of {request_id!r}'s "
                f"lease on {self.agent.engine_id}",
            )
        return lease

    def claim(self, request_id: str, token: str | None) -> list[int]:
        """Extend the lease of ``request_id`` by ``lease_s`` (its reader is about to read it)
        and return its block ids; ``LeaseError`` as ``_held``."""
        with self._lease_lock:
            lease = self._held(request_id, token)
            lease.deadline = time.monotonic() + self.lease_s
            return list(lease.blocks)

    def release_lease(self, request_id: str, token: str | None) -> None:
        """The generation side refused the request: end its lease now; the engine frees the
        blocks at its next ``finished_blocks`` (milliseconds). ``LeaseError`` as ``_held``."""
        with self._lease_lock:
            lease = self._held(request_id, token)
            del self._leases[request_id]
            self._refused.append(lease.blocks)
            self.leases_refused += 1
        log.info("KV lease of request %s released unread: the decode side refused it",
                 request_id)

    def finished_blocks(self) -> list[list[int]]:
        """Block tables whose lease ended since the last call (the engine frees them)."""
        with self._lock:
            released = self.agent.released()
        if self.vllm_reader is not None:
            self.vllm_reader.heartbeat()
        now = time.monotonic()
        vllm_ended = self.vllm.finished_blocks() if self.vllm is not None else []
        with self._lease_lock:
            out, self._refused = self._refused + vllm_ended, []
            out += [self._leases.pop(rid).blocks for rid in released if rid in self._leases]
            for rid in [r for r, lease in self._leases.items() if lease.deadline < now]:
                log.warning("KV lease of request %s expired after %.0f s unread", rid, self.lease_s)
                self._expired += 1
                out.append(self._leases.pop(rid).blocks)
        return out

    def describe(self, claim: str | None = None, token: str | None = None) -> dict[str, Any]:
        """The side channel's answer (``KvAgent.describe``); with ``claim`` and the lease's
        ``token``, ``lease_block_ids``: the blocks of that lease, the only ones its reader may
        read (the lease is extended). ``LeaseError`` as ``_held``."""
        blocks = self.claim(claim, token) if claim is not None else None
        with self._lock:
            described = self.agent.describe()
        return {**described, "lease_block_ids": blocks} if blocks is not None else described

    # -- generation side -----------------------------------------------------------------------
    async def prepare_load(self, params: KvTransferParams) -> None:
        """Claim the lease of ``params`` on its context server and connect to that server
        (once per engine id); see [Note: lease binding]. Raises ``LeaseError`` (a 4xx naming
        the field) when the params name no lease this server may read, ``TransferError`` when
        the server cannot be reached or does not match. vLLM's prefill answers
        (``params.from_vllm``) go to the ``VllmReader``: a handshake on vLLM's side channel."""
        if self._vllm_read(params):
            assert self.vllm_reader is not None
            await asyncio.to_thread(self.vllm_reader.connect, params)
            return
        engine_id = str(params.remote_engine_id)
        url = self._side_channel(params)
        described = await self._call("GET", url, params)
        if described.get("engine_id") != engine_id:
            raise LeaseError(
                400,
                f"kv_transfer_params.remote_engine_id: {engine_id!r}, but the side channel "
                f"{params.remote_host}:{params.remote_port} is engine "
                f"{described.get('engine_id')!r}: the lease belongs to that engine",
            )
        if described.get("lease_block_ids") != params.remote_block_ids:
            # only the blocks leased to this request: other ids are other requests' KV
            raise LeaseError(
                400,
                f"kv_transfer_params.remote_block_ids: not the blocks of request "
                f"{params.remote_request_id}'s lease on {engine_id}",
            )
        if self.agent.known(engine_id) is not None:
            return
        await asyncio.to_thread(self._connect, described)
        self._servers[engine_id] = _identity(described.get("server"))

    async def release(self, params: KvTransferParams) -> None:
        """Tell the context server of ``params`` that this server refused the request, so
        its lease ends now (``DELETE`` on its side channel, with the lease's token). Best
        effort: a lease already gone, or a server out of reach, is logged at INFO. A vLLM
        prefill server gets vLLM's completion notification instead (it frees the blocks)."""
        try:
            if self._vllm_read(params):
                assert self.vllm_reader is not None
                await asyncio.to_thread(self.vllm_reader.release, params)
                return
            await self._call("DELETE", self._side_channel(params), params)
        except TransferError as exc:
            log.info("KV lease of %s not released: %s", params.remote_request_id, exc)

    def _vllm_read(self, params: KvTransferParams) -> bool:
        """Whether ``params`` are read from a vLLM prefill server (``LeaseError`` 400 when
        they are vLLM's and this server reads none)."""
        if not params.from_vllm:
            return False
        if self.vllm_reader is None:
            raise LeaseError(
                400,
                "kv_transfer_params.remote_lease_token: required with do_remote_prefill (the "
                "params are a vLLM prefill server's answer, but this server reads dwdp "
                "context servers only: set kvTransfer.vllm to read vLLM's)",
            )
        return True

    def _side_channel(self, params: KvTransferParams) -> str:
        host = _host_for_url(str(params.remote_host))
        return f"http://{host}:{params.remote_port}{KV_AGENT_PATH}"

    async def _call(self, method: str, url: str, params: KvTransferParams) -> dict[str, Any]:
        """``method`` on the side channel ``url`` for the lease of ``params``; its JSON answer.
        A 403/410 answer is the side channel's ``LeaseError``; others ``TransferError``."""
        import httpx

        key = self.api_key.current()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        query = {"claim": str(params.remote_request_id),
                 "token": str(params.remote_lease_token or "")}
        try:
            async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:
                r = await client.request(method, url, headers=headers, params=query)
        except httpx.HTTPError as exc:
            raise TransferError(f"KV side channel {url}: {exc!r}") from exc
        if r.status_code in (403, 410):
            raise LeaseError(r.status_code, _message(r))
        if r.status_code not in (200, 204):
            raise TransferError(f"KV side channel {url}: HTTP {r.status_code}")
        return r.json() if r.status_code == 200 else {}

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
        if self._vllm_read(params):
            assert self.vllm_reader is not None
            self.vllm_reader.load(params, blocks)
            self.blocks_received += len(blocks)
            return
        remote = self.agent.known(str(params.remote_engine_id))
        if remote is None:
            raise TransferError(f"KV agent {params.remote_engine_id}: not connected")
        with self._lock:
            self.agent.pull(remote, params.block_ids, blocks, str(params.remote_request_id))
        self.blocks_received += len(blocks)

    def close(self) -> None:
        """Deregister the cache from NIXL."""
        if self.vllm is not None:
            self.vllm.close()
        if self.vllm_reader is not None:
            self.vllm_reader.close()
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


def _message(r: Any) -> str:
    """The ``error.message`` of a side channel's answer (its status when it has none)."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"KV side channel: HTTP {r.status_code}"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

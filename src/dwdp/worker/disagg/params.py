"""``kv_transfer_params``: the prefill/decode contract of vLLM's NIXL connector, one home.

A router (vllm-router, llm-d's sidecar, vLLM's proxy examples) first sends the client's request
to a context server with ``do_remote_decode: true``; the context server prefills it, keeps its
KV blocks under a lease and answers with ``do_remote_prefill: true`` and where the blocks are
(``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
``remote_port``: the HTTP side channel serving the NIXL agent metadata, ``tp_size``). The router
copies that object unchanged into the request it sends a generation server, which reads the
blocks with NIXL and decodes. Fields the routers add that this contract does not use are
ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

BlockId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_BLOCKS = 1 << 20


class KvTransferParams(BaseModel):
    """The ``kv_transfer_params`` object of a request (vLLM's field names and meanings)."""

    # strict: "yes" is no bool, "8001" no port, true no block id (a 400 naming the field)
    model_config = ConfigDict(extra="ignore", strict=True)

    do_remote_decode: bool = Field(False, description="Prefill only; another server decodes.")
    do_remote_prefill: bool = Field(False, description="The KV cache comes from remote blocks.")
    remote_engine_id: str | None = Field(None, min_length=1, max_length=256)
    remote_request_id: str | None = Field(None, min_length=1, max_length=256)
    remote_block_ids: list[BlockId] | None = Field(None, max_length=MAX_BLOCKS)
    remote_host: str | None = Field(None, min_length=1, max_length=253)
    remote_port: int | None = Field(None, ge=1, le=65535)
    tp_size: int = Field(1, ge=1, le=1, description="Tensor-parallel ranks of the context side.")

    def problem(self) -> str | None:
        """The first contradiction or missing field, as ``kv_transfer_params.<field>: ...``."""
        if self.do_remote_decode and self.do_remote_prefill:
            return "kv_transfer_params.do_remote_prefill: cannot be true with do_remote_decode"
        if self.do_remote_prefill:
            for name in (
                "remote_engine_id",
                "remote_request_id",
                "remote_block_ids",
                "remote_host",
                "remote_port",
            ):
                if getattr(self, name) in (None, []):
                    return f"kv_transfer_params.{name}: required with do_remote_prefill"
        return None


def prefilled(
    *, engine_id: str, request_id: str, block_ids: list[int], host: str, port: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a context server answers after a remote-decode prefill."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }

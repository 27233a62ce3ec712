"""The defaults of settings more than one place reads, one home each.

The API models (``dwdp.api.launch``, ``dwdp.api.deployment``; the CRD's defaults come from
them), the worker's engine and the operator import these, so a default changes here only.
"""

from __future__ import annotations

MAX_NUM_TOKENS = 8192
"""Tokens per forward pass, at most (``maxNumTokens``)."""
MAX_BATCH_SIZE = 8
"""Requests per forward pass, at most (``maxBatchSize``)."""
KV_BLOCK_SIZE = 16
"""Tokens per block of the paged KV cache (``kvCache.blockSize``; vLLM's ``--block-size``)."""
KV_TRANSFER_LEASE_S = 30
"""Seconds a context rank holds a prefilled request's KV blocks for its generation server
(``kvCache.transferLeaseSeconds``; vLLM's lease)."""
SERVER_PORT = 8000
"""HTTP port of a pod's local rank 0 (``server.port``; local rank k serves port + k)."""
ROUTER_PORT = 8000
"""Port of the router's OpenAI API (``router.port``, the Service's)."""
VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
"""The vLLM versions whose NIXL connector a context rank speaks (``kvTransfer.vllm.version``;
the first is the default)."""
VLLM_SIDE_CHANNEL_PORT = 5600
"""vLLM's default NIXL side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``;
``kvTransfer.vllm.sideChannelPort``)."""

"""Prefill/decode disaggregation: vLLM's NIXL-connector contract (``kv_transfer_params``) and
the KV block transfer between a context rank and a generation server (NIXL READ)."""

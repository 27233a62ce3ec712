"""Load a local Hugging Face checkpoint for serving, after checking it (no downloads).

``load_checkpoint`` validates the safetensors headers against the config first
(``dwdp.worker.loading.validate``), so a missing tensor or a tensor of the wrong shape or dtype
fails with one line before any weight is read; then it loads through
``AutoModelForCausalLM.from_pretrained`` and the tokenizer through ``AutoTokenizer``
(``dwdp.worker.loading.tokenizer``). A DWDP
rank loads through ``dwdp.worker.loading.sharded`` instead (only the experts it keeps), and so
does an FP8 checkpoint (``dwdp.worker.quant.fp8``: its weights stay FP8).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dwdp.worker.loading.tokenizer import load_tokenizer
from dwdp.worker.loading.validate import CheckpointError, validate_checkpoint
from dwdp.worker.models import adapter_for
from dwdp.worker.quant.fp8 import scheme_of


def load_checkpoint(path: str | Path, *, dtype: str = "auto") -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` of the checkpoint directory ``path`` in eval mode.

    ``dtype`` is ``auto`` (the checkpoint's) or a torch dtype name. Raises ``CheckpointError``
    (one line naming the tensor, field or file) for a checkpoint that cannot serve.
    """
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    config = validate_checkpoint(path)
    if scheme_of(config) is not None:  # FP8: the worker's own reader keeps the FP8 weights
        from dwdp.worker.loading.sharded import load_sharded

        adapter = adapter_for(config)
        assert adapter is not None  # the generic adapter without a match
        model, tokenizer, _ = load_sharded(path, adapter=adapter, partition=None, rank=0,
                                           dtype=dtype)
        return model, tokenizer
    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=True
        )
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {path}: loading failed: {first}") from exc
    model.eval()
    return model, load_tokenizer(path)

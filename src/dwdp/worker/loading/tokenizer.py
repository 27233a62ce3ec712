"""The tokenizer of a local Hugging Face checkpoint (no downloads).

Every load reads it (``dwdp.worker.loading.checkpoint``, ``dwdp.worker.loading.sharded``), and
so does the rank's API server process (``dwdp.worker.server.api_process``), which loads nothing
else of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dwdp.worker.loading.validate import CheckpointError


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer (``AutoTokenizer``, local files only). Raises
    ``CheckpointError`` naming the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {path}: tokenizer: {first}") from exc

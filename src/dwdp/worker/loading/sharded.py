"""Sharded loading: each DWDP rank reads from the checkpoint only what it keeps.

The model is built on the meta device (no memory), then every tensor is read from the
safetensors files through ``safe_open(...).get_slice`` (``model.safetensors.index.json``
says which file holds which tensor): the non-expert tensors whole (replicated), the fused
expert tables of the MoE layers DWDP does not manage (``dwdp.worker.expert.managed``) whole,
and of every managed MoE layer only the rows ``[start, end)`` of this rank's stored range
(``ExpertPartition.ranges[rank]``, overlaps of the redundant partition included). Those rows
go into a :class:`LoadedExperts` on the host, whatever ``device`` is: expert setup copies them
into the rank's store, which it allocates on the device, so on a GPU the rows never sit in
device memory next to the store (they would double the experts' share of the device peak);
the module's own tables stay on the meta device until the repoint points them into the
slots.

On-disk forms (``ArchitectureAdapter.checkpoint_forms``): a fused table (``[E, 2I, H]`` /
``[E, H, I]``, sliced along its first dimension) or one tensor per expert matrix as
``save_pretrained`` writes them (gate and up stacked into ``gate_up_proj``'s rows, in that
order, as transformers fuses them on load). A tensor of another dtype than the model's is
cast (the ``dtype`` option), as ``from_pretrained`` does.

Peak host memory of a rank: the replicated tensors (on a cpu device) + its expert rows + the
unmanaged layers' tables + one expert matrix in flight, instead of the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dwdp.worker.expert.layout import LoadedExperts
from dwdp.worker.loading.tokenizer import load_tokenizer
from dwdp.worker.loading.validate import (
    CheckpointError,
    meta_model,
    scan_checkpoint,
    validate_checkpoint,
)
from dwdp.worker.models.base import SCALE_SUFFIX, ArchitectureAdapter
from dwdp.worker.quant.fp8 import scale_problem

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dwdp.api.partition import ExpertPartition

_T = TypeVar("_T")


def load_sharded(
    path: str | Path,
    *,
    adapter: ArchitectureAdapter,
    partition: ExpertPartition | None,
    rank: int,
    dtype: str = "auto",
    device: str = "cpu",
) -> tuple[Any, Any, LoadedExperts | None]:
    """Return ``(model, tokenizer, rows)`` for rank ``rank`` of ``partition``, in eval mode.

    ``model`` holds every tensor on ``device`` except the managed MoE layers' fused expert
    tables (meta, full shape); ``rows`` holds this rank's rows of those tables, on the host
    (module docstring). Without a ``partition`` every tensor is read whole into the model
    and ``rows`` is ``None`` (how an FP8 checkpoint loads without expert DWDP). ``dtype``:
    ``auto`` (the checkpoint's) or a torch dtype name; FP8 weights and their scales keep
    their stored dtype. Raises ``CheckpointError`` (one line naming the file and the tensor)
    for a checkpoint that cannot serve.
    """
    import torch

    from dwdp.worker.expert.managed import select_layers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    config = validate_checkpoint(path)
    headers, where = scan_checkpoint(path)
    torch_dtype = getattr(config, "dtype", None) if dtype == "auto" else getattr(torch, dtype)
    model = meta_model(config, torch_dtype)
    managed: dict[int, tuple[str, str]] = {}
    rows = None
    if partition is not None:
        rows = LoadedExperts(*partition.ranges[rank], {})
        for m in select_layers(model, adapter, partition.num_experts).managed:
            managed.update({id(t): (m.prefix, p) for p, t in m.expert_tensors().items()})
    reader = _Reader(path, adapter, headers, where, device)
    with reader:
        for name, meta in _checkpoint_tensors(model, config):
            if rows is not None and id(meta) in managed:
                prefix, param = managed[id(meta)]
                value = reader.read(name, meta, rows.start, rows.end, device="cpu")
                _check_scale(path, name, value, rows.start)
                rows.tables.setdefault(prefix, {})[param] = value
                _mark_loaded(meta)
            else:
                value = reader.read(name, meta, 0, None)
                _check_scale(path, name, value, 0)
                _put(model, name, value, meta)
    _materialize_buffers(model, device)
    model.tie_weights()
    model.eval()
    return model, load_tokenizer(path), rows


def read_into(path: Path, model: nn.Module, adapter: ArchitectureAdapter,
              alias: Callable[[str], str | None], device: str) -> None:
    """Read every state-dict tensor of ``model`` (on the meta device) from the checkpoint at
    ``path`` onto ``device``, the stored keys seen under ``alias`` (a stored key -> the name
    the model's tensors ask for; ``None``: not seen): how an MTP layer, stored under its layer's
    index, loads into a model of its own (``dwdp.worker.loading.mtp``). Raises
    ``CheckpointError`` as :func:`load_sharded`."""
    stored, files = scan_checkpoint(path)
    keys = {seen: key for key in stored if (seen := alias(key)) is not None}
    headers = {seen: stored[key] for seen, key in keys.items()}
    where = {seen: files[key] for seen, key in keys.items()}
    with _Reader(path, adapter, headers, where, device, keys=keys) as reader:
        for name, meta in model.state_dict(keep_vars=True).items():
            value = reader.read(name, meta, 0, None)
            _check_scale(path, keys.get(name, name), value, 0)
            _put(model, name, value, meta)
    _materialize_buffers(model, device)


def _checkpoint_tensors(model: nn.Module, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The state-dict tensors a checkpoint holds (a tied output embedding left out)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def _check_scale(path: Path, name: str, value: torch.Tensor, first_row: int) -> None:
    """Refuse a block-scaled FP8 weight's scales (``name`` ends ``_scale_inv``; ``value``
    holds the checkpoint's rows from ``first_row``) that are not all finite and positive:
    ``CheckpointError`` naming the tensor, the first bad index and its value."""
    if not name.endswith(SCALE_SUFFIX):
        return
    problem = scale_problem(value, first_row)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {name}: {problem}")


def _put(model: nn.Module, name: str, value: torch.Tensor, meta: torch.Tensor) -> None:
    from torch import nn

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = _mark_loaded(
            nn.Parameter(value, requires_grad=meta.requires_grad)
        )
    else:
        module._buffers[attr] = _mark_loaded(value)


def _mark_loaded(tensor: _T) -> _T:
    """transformers' ``_is_hf_initialized`` flag: its weight initializers leave the tensor
    alone."""
    setattr(tensor, "_is_hf_initialized", True)  # noqa: B010 - a flag torch does not declare
    return tensor


def _materialize_buffers(model: nn.Module, device: str) -> None:
    """The non-persistent buffers (rotary ``inv_freq``) are in no checkpoint: allocate them on
    ``device`` and let the model's own initializer compute them (it leaves every tensor read
    from the checkpoint alone: they carry transformers' ``_is_hf_initialized``)."""
    import torch

    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        fresh = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not fresh:
            continue
        for key in fresh:
            buffer = module._buffers[key]
            assert buffer is not None
            module._buffers[key] = torch.empty_like(buffer, device=device)
        if init is not None:
            with torch.no_grad():
                init(module)


class _Reader:
    """Reads model tensors (or rows of fused expert tables) from the checkpoint's files."""

    def __init__(
        self,
        path: Path,
        adapter: ArchitectureAdapter,
        headers: dict[str, tuple[tuple[int, ...], str]],
        where: dict[str, Path],
        device: str,
        keys: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.adapter = adapter
        self.headers = headers
        self.where = where
        self.device = device
        self.keys = keys or {}
        """Names read -> the keys stored under them (``read_into``); others are their own."""
        self._stack = contextlib.ExitStack()
        self._file: Path | None = None
        self._handle: Any = None

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _slice(self, key: str) -> Any:
        """``get_slice(key)`` of the file that holds ``key``. One file is open at a time:
        ``safe_open`` maps the file, and the pages read stay resident until it is closed, so
        the file read before is closed first (tensors come in file order, mostly)."""
        from safetensors import safe_open

        file = self.where[key]
        if self._file != file:
            self._stack.close()
            self._handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            self._file = file
        return self._handle.get_slice(self.keys.get(key, key))

    def read(
        self, name: str, meta: torch.Tensor, start: int, end: int | None, *,
        device: str | None = None,
    ) -> torch.Tensor:
        """Model tensor ``name`` (``meta`` gives its shape and dtype) on ``device`` (``None``:
        the reader's); for a fused expert table only rows ``[start, end)`` (``end`` ``None``:
        all)."""
        device = self.device if device is None else device
        shape = tuple(meta.shape)
        stop = shape[0] if end is None else end
        forms = self.adapter.checkpoint_forms(name, shape)
        form = next((f for f in forms if all(k in self.headers for k in f)), None)
        if form is None:
            best = max(forms, key=lambda f: sum(k in self.headers for k in f))
            missing = next(k for k in best if k not in self.headers)
            raise CheckpointError(f"checkpoint {self.path}: tensor {missing} is missing")
        try:
            if len(form) == 1 and next(iter(form.values())) == shape:
                key = next(iter(form))
                piece = self._slice(key)
                view = piece[start:stop] if (start, stop) != (0, shape[0]) else piece[:]
                # a copy: safetensors' tensors are views of the file's mapping, which would
                # keep every page read resident for as long as one of them lives
                value = view.to(device=device, dtype=meta.dtype, copy=True)
            else:
                value = self._per_expert(name, meta, form, start, stop, device)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.where.get(next(iter(form)), self.path)}: tensor "
                f"{next(iter(form))}: reading failed ({exc})"
            ) from exc
        return value.contiguous()

    def _per_expert(
        self, name: str, meta: torch.Tensor, form: dict[str, tuple[int, ...]], start: int,
        stop: int, device: str,
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` of a fused table stored as one tensor per expert matrix."""
        import torch

        alternatives = self.adapter.expert_matrix_names(name, start)
        which = next(i for i, names in enumerate(alternatives) if names[0] in form)
        out = torch.empty((stop - start, *meta.shape[1:]), dtype=meta.dtype, device=device)
        for row, expert in enumerate(range(start, stop)):
            names = self.adapter.expert_matrix_names(name, expert)[which]
            offset = 0
            for key in names:  # gate then up along the rows; down alone
                part = self._slice(key)[:]
                out[row, offset : offset + part.shape[0]].copy_(part)
                offset += part.shape[0]
        return out

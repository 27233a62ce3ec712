"""Repointing module tensors into prefetch slots (P5), restoring them (P1-P5 failure) and
counting leaked originals (P6).

A parameter keeps its ``nn.Parameter`` object (``param.data`` is swapped), so references
the model or an optimizer holds stay valid; a buffer or a plain attribute is replaced in
its module. The original tensors are held only by the :class:`Originals` record until P6
drops them; a storage that outlives the drop is a *leak* (someone else still holds it).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dwdp.worker.dense.layout import TensorRef


def set_tensor(ref: TensorRef, tensor: torch.Tensor) -> None:
    """Make ``ref``'s module attribute ``tensor`` (in place for a parameter)."""
    module = ref.module
    if ref.kind == "parameter":
        param = module._parameters[ref.attr]
        assert param is not None, ref.name
        param.data = tensor
    elif ref.kind == "buffer":
        module._buffers[ref.attr] = tensor
    else:
        module.__dict__[ref.attr] = tensor


def current_tensor(ref: TensorRef) -> torch.Tensor:
    """The plain tensor behind ``ref`` now (``.data`` of a parameter)."""
    tensor = ref.get()
    return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


@dataclass(slots=True)
class Originals:
    """The original tensor of every repointed attribute, in repoint order."""

    saved: list[tuple[TensorRef, torch.Tensor]] = field(default_factory=list)

    def repoint(self, ref: TensorRef, tensor: torch.Tensor) -> None:
        """Remember ``ref``'s current tensor (once) and point ``ref`` at ``tensor``."""
        if all(r is not ref for r, _ in self.saved):
            self.saved.append((ref, current_tensor(ref)))
        set_tensor(ref, tensor)

    def restore(self) -> int:
        """Point every repointed attribute back at its original; returns how many."""
        for ref, original in reversed(self.saved):
            set_tensor(ref, original)
        count = len(self.saved)
        self.saved.clear()
        return count

    def original(self, ref: TensorRef) -> torch.Tensor:
        for r, t in self.saved:
            if r is ref:
                return t
        raise KeyError(ref.name)


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Original storages still alive after P6 dropped its references (``names``: one
    tensor name per leaked storage)."""

    count: int
    names: tuple[str, ...]
    nbytes: int


def watch_storages(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, int, StorageWeakRef]]:
    """Weak references to the storages of ``named`` tensors, taken before the drop."""
    return [(name, t.untyped_storage().nbytes(), StorageWeakRef(t.untyped_storage()))
            for name, t in named]


def count_leaks(watched: list[tuple[str, int, StorageWeakRef]]) -> LeakReport:
    """After every reference DWDP held was dropped: storages still alive are leaks."""
    if any(not ref.expired() for _, _, ref in watched):
        gc.collect()  # only reference cycles can still hold them; a full collection is slow
    alive = [(name, nbytes) for name, nbytes, ref in watched if not ref.expired()]
    return LeakReport(len(alive), tuple(n for n, _ in alive), sum(b for _, b in alive))

"""The group-wide vote on the model load: a rank that fails to load fails its group together.

[Note: fail-together] (``dwdp.worker.setup.phases``) applied to the load. After the
rendezvous every rank loads, then takes part in one collective (``load``) carrying ``None``
or its one-line error; a rank whose load raised votes its error instead of leaving its peers
blocked in the first setup collective. If any rank failed, every rank raises the same
:class:`LoadError` after that collective, naming the failing ranks and their causes, so the
termination message of every rank starts ``load:``.

What a failed load had read is dropped before the vote: the tensors die with the failed
call's frames (collected here, with the device's cached blocks returned on CUDA). The load
allocates nothing in shared memory (the backends' stores come with setup).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from typing import TypeVar

from dwdp.api.contract import Stage
from dwdp.worker.setup.group_vote import vote
from dwdp.worker.termination import one_line
from dwdp.worker.transport.base import GroupTransport

_T = TypeVar("_T")

LOAD_VOTE = "load"
"""The label of the load's collective."""


class LoadError(RuntimeError):
    """The model load failed on one or more ranks; raised on every rank after the same
    collective. ``errors`` maps each failing rank to its one-line cause; ``phase`` is
    ``load`` (the first word of the termination message)."""

    phase = Stage.LOAD.value

    def __init__(self, errors: Mapping[int, str]) -> None:
        self.errors = dict(sorted(errors.items()))
        detail = "; ".join(f"rank {r}: {m}" for r, m in self.errors.items())
        super().__init__(
            f"the model load failed on rank(s) {list(self.errors)}: {detail}; every rank of "
            f"the group stops"
        )

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(self.errors)


def load_together(group: GroupTransport | None, load: Callable[[], _T], *, device: str) -> _T:
    """``load()`` (which returns a value, never ``None``) on this rank, then (with a group)
    one vote of every rank on the load.

    Without a group the load's own error propagates. With one, returns the load's result
    when every rank loaded, else raises :class:`LoadError` on every rank alike (the result
    dropped). Raises the transport's errors when the group cannot be reached.
    """
    if group is None:
        return load()
    result, error = _attempt(load, device)
    verdict = vote(group, LOAD_VOTE, error)
    if not verdict.ok:
        del result  # a healthy rank's model goes too: the whole group stops
        _release(device)
        raise LoadError(verdict.errors)
    assert result is not None
    return result


def _attempt(load: Callable[[], _T], device: str) -> tuple[_T | None, str | None]:
    """``(result, None)``, or ``(None, one-line error)`` with what the load had read
    released."""
    try:
        return load(), None
    except Exception as exc:  # any cause (a checkpoint, memory, a device): the group votes
        error = one_line(exc)
    # ``exc`` is unbound here: its traceback's frames, and the tensors they held, are garbage
    _release(device)
    return None, error


def _release(device: str) -> None:
    """Collect the frames of a failed load (their tensors) and, on CUDA, hand the cached
    blocks back to the device."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()

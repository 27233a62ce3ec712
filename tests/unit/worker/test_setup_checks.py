"""The checks setup makes before it commits, each caught by a test that fails when the check is
removed: a group serves only verified weights. Two ranks in threads over the cpu backend,
expert + dense DWDP on a tiny DeepSeek-V3 (every dense storage managed: ``dense_min_bytes=0``).

The mutant table (check removed -> the test that catches it; each was removed once by hand
and its test failed):

| check | where | test |
| --- | --- | --- |
| P1 fit: store + slots within the free memory | ``setup.dense._p1_collect`` | ``test_a_store_larger_than_the_free_memory_fails_p1_on_every_rank`` |
| P4: every gathered slot equals the original bytes | ``setup.dense._p4_gather_check`` | ``test_a_wrong_byte_after_the_gather_fails_p4_naming_the_layer`` |
| P5: every repointed tensor reads the original bytes | ``setup.dense._p5_repoint`` | ``test_a_wrong_byte_after_the_repoint_fails_p5_naming_the_tensor`` |
| expert gather equals the original tables | ``setup.expert_repoint.check_expert_gather`` | ``test_a_wrong_expert_byte_fails_the_expert_check`` |
"""  # noqa: E501

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))

from test_attach_gather_wiring import NUM_EXPERTS, _model  # noqa: E402
from test_transport import run_threads  # noqa: E402

from dwdp.api.partition import expert_partition  # noqa: E402
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments  # noqa: E402
from dwdp.worker.setup.phases import FailureInjector, SetupError  # noqa: E402

BAD_RANK = 1


class SmallBackend(CpuBackend):
    """The cpu backend of a rank whose memory holds 4 KiB (smaller than any store)."""

    def free_bytes(self) -> int:
        return 4096


def _attach_all(*, small_rank: int | None = None, corrupt=None,
                dense_off_rank: int | None = None) -> list[BaseException]:
    """attach on two ranks; ``corrupt(phase, rank, model)`` runs at the end of every phase's
    local work (the injector's hook); ``dense_off_rank`` has dense DWDP off. Returns each
    rank's ``SetupError`` (the test fails if a rank commits), after checking no store is left
    behind."""
    from dwdp.worker.bringup import attach
    from dwdp.worker.models import adapter_for

    group = f"u{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    models = [_model(), _model()]

    def body(transport):
        rank = transport.rank
        model = models[rank]
        kind = SmallBackend if rank == small_rank else CpuBackend
        backend = kind(group=group, incarnation="1", rank=rank)
        hook = None if corrupt is None else (lambda phase, r: corrupt(phase, r, model))
        with pytest.raises(SetupError) as info:
            attach(model, adapter_for(model), backend=backend, transport=transport,
                   partition=expert_partition(NUM_EXPERTS, 2),
                   enable_dense=rank != dense_off_rank, dense_min_bytes=0,
                   injector=FailureInjector(hook=hook))
        return info.value

    errors = run_threads(2, body)
    assert not leftover_segments(group)
    return errors


def _bump(tensor) -> None:
    """Change one byte of ``tensor`` in place (a weight now differs from what was stored)."""
    with torch.no_grad():
        tensor.view(-1)[0] += 1.0


def _dense_weight(model):
    """A dense-managed weight: the last MoE layer's attention output projection."""
    return model.model.layers[-1].self_attn.o_proj.weight


def test_a_store_larger_than_the_free_memory_fails_p1_on_every_rank():
    for exc in _attach_all(small_rank=BAD_RANK):
        assert (exc.phase, exc.failed_ranks, exc.restored) == ("P1", (BAD_RANK,), True), exc
        assert "MemoryFitError" in str(exc) and "bytes are free" in str(exc)


def test_a_wrong_byte_after_the_gather_fails_p4_naming_the_layer():
    """Rank 1's original changes after its rows were stored (end of P3): its P4 gather reads
    the stored bytes, which no longer equal the original."""

    def corrupt(phase, rank, model):
        if (phase, rank) == ("P3", BAD_RANK):
            _bump(_dense_weight(model))

    for exc in _attach_all(corrupt=corrupt):
        assert (exc.phase, exc.failed_ranks) == ("P4", (BAD_RANK,)), exc
        assert "differs from the original bytes" in str(exc)
        assert f"layers.{len(_model().model.layers) - 1}" in str(exc)


def test_a_wrong_byte_after_the_repoint_fails_p5_naming_the_tensor():
    """Rank 1's original changes after P4 checked it: the repointed tensor reads the slot's
    bytes, which no longer equal the original's."""

    def corrupt(phase, rank, model):
        if (phase, rank) == ("P4", BAD_RANK):
            _bump(_dense_weight(model))

    for exc in _attach_all(corrupt=corrupt):
        assert (exc.phase, exc.failed_ranks) == ("P5", (BAD_RANK,)), exc
        assert "o_proj.weight reads other bytes through its slot" in str(exc)


def test_a_wrong_expert_byte_fails_the_expert_check():
    """Rank 1's expert table changes after expert setup committed its store: the gather
    check compares the slot with the table and fails on every rank."""

    def corrupt(phase, rank, model):
        if (phase, rank) == ("commit", BAD_RANK):
            _bump(model.model.layers[-1].mlp.experts.down_proj)

    for exc in _attach_all(corrupt=corrupt):
        assert exc.failed_ranks == (BAD_RANK,), exc
        assert "gathered slot differs from the original" in str(exc)


def test_ranks_that_disagree_on_dense_dwdp_fail_with_that_verdict():
    """One rank with dense DWDP on, the other off: every rank raises at P1 naming the
    disagreement (not a mismatched collective)."""
    for exc in _attach_all(dense_off_rank=BAD_RANK):
        assert exc.phase == "P1" and exc.restored, exc
        assert "ranks disagree on enable_dense (on: [0], off: [1])" in str(exc), exc

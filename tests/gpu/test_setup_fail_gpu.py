"""Fail-together through the real setup on the cuda backend: 4 rank processes on one GPU
attach expert + dense DWDP to a DeepSeek-V3-family checkpoint with a failure injected (on
rank 2) at dense P3, at dense P6 (the commit) and at the expert map step. Every rank
must raise ``SetupError`` naming that phase and rank 2, and leave no VMM handle, import,
reservation, mapping or exported fd behind (``live_handles()`` counted before and after).
A P3 failure restores the original tensors (the forward is bitwise the one before setup).
A final scenario without injection attaches, holds handles, closes and returns to the
count it started from (so the counter is not trivially zero)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from ports import free_port

torch = pytest.importorskip("torch")

from dwdp.worker.transport.base import make_secret_file  # noqa: E402

WORLD = 4
FAIL_RANK = 2
SCENARIOS = ("P3", "P6", "map", "none")

CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from pathlib import Path
    from dwdp.api.enums import CopyMode, HandleType
    from dwdp.api.partition import expert_partition
    from dwdp.worker.bringup import attach
    from dwdp.worker.backend.cuda import CudaBackend
    from dwdp.worker.backend.cuda_vmm import LEDGER
    from dwdp.worker.loading.checkpoint import load_checkpoint
    from dwdp.worker.models import adapter_for
    from dwdp.worker.setup.phases import FailAt, FailureInjector, SetupError
    from dwdp.worker.settings import CopySettings
    from dwdp.worker.transport.base import RendezvousConfig, read_secret
    from dwdp.worker.transport.tcp_store import TcpStoreTransport

    rank, port, group, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    ckpt, scenarios, fail_rank = sys.argv[5], json.loads(sys.argv[6]), int(sys.argv[7])
    torch.cuda.set_device(0)
    config = RendezvousConfig(group=group, incarnation="i0", rank=rank, world_size=4,
                              secret=read_secret(os.environ), address=("127.0.0.1", port),
                              timeout_s=240)
    backend = CudaBackend(device=0, handle_type=HandleType.POSIX_FD)
    records = []
    with TcpStoreTransport(config) as transport:
        for scenario in scenarios:
            points = () if scenario == "none" else (FailAt(scenario, fail_rank),)
            model, tok = load_checkpoint(ckpt)
            model.to("cuda:0")
            ids = torch.tensor([tok("Hello world, the")["input_ids"]], device="cuda:0")
            with torch.no_grad():
                before_logits = model(ids).logits
            adapter = adapter_for(model)
            e = adapter.moe_layers(model)[0].num_experts
            rec = {"scenario": scenario, "rank": rank, "before": LEDGER.snapshot()}
            try:
                att = attach(model, adapter, backend=backend, transport=transport,
                             partition=expert_partition(e, 4), enable_dense=True,
                             num_slots=2,
                             settings=CopySettings(copy_mode=CopyMode.BATCHED),
                             injector=FailureInjector(points))
            except SetupError as exc:
                rec.update(raised=True, phase=str(exc.phase), failed=list(exc.failed_ranks),
                           restored=exc.restored, error=str(exc)[:400])
                if exc.restored and scenario == "P3":
                    with torch.no_grad():
                        rec["forward_equal"] = bool(torch.equal(model(ids).logits,
                                                                before_logits))
            else:
                rec["raised"] = False
                rec["attached"] = LEDGER.snapshot()
                torch.cuda.synchronize()
                transport.barrier(label=f"attached-{scenario}")
                att.close()
            rec["after"] = LEDGER.snapshot()
            transport.barrier(label=f"end-{scenario}")
            records.append(rec)
    backend.close()
    records.append({"closed": LEDGER.snapshot()})
    (out / f"fail.{rank}.json").write_text(json.dumps(records))
    """
)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from dwdp_dev.worker.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("gpufail")
    ckpt = str(make_checkpoint("deepseek_v3", root / "ds", num_experts=6, seed=9))
    script = root / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["DWDP_RENDEZVOUS_SECRET_FILE"] = str(make_secret_file(root))
    port, group = free_port(), f"g{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(port),
                group,
                str(root),
                ckpt,
                json.dumps(SCENARIOS),
                str(FAIL_RANK),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    for p, (_o, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return [json.loads((root / f"fail.{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("scenario", ["P3", "P6", "map"])
def test_injected_failure_raises_on_every_rank_and_leaves_no_handle(records, scenario):
    index = SCENARIOS.index(scenario)
    for rank, recs in enumerate(records):
        rec = recs[index]
        assert rec["scenario"] == scenario and rec["raised"] is True, (rank, rec)
        assert rec["phase"] == scenario and rec["failed"] == [FAIL_RANK], (rank, rec)
        assert rec["after"] == rec["before"] == {}, (rank, rec)
        if scenario == "P3":
            assert rec["restored"] is True and rec["forward_equal"] is True, (rank, rec)
        else:  # past the dense commit: released without the originals
            assert rec["restored"] is False, (rank, rec)


def test_a_committed_attach_holds_handles_and_close_releases_them(records):
    index = SCENARIOS.index("none")
    for rank, recs in enumerate(records):
        rec = recs[index]
        assert rec["raised"] is False, (rank, rec)
        attached = rec["attached"]
        # two stores (dense, expert) allocated, exported and mapped; 2 x 3 peers imported
        assert attached.get("mapping", 0) >= 2 + 2 * (WORLD - 1), (rank, attached)
        assert rec["after"] == rec["before"] == {}, (rank, rec)
        assert recs[-1] == {"closed": {}}, (rank, recs[-1])

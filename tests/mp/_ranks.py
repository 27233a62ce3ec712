"""What each rank process of the multi-process tests runs: one or more setup scenarios.

Used two ways: forked from the test process (TCP store transport; torch is imported once)
and as a script under ``mpirun`` (MPI transport). Each scenario writes one JSON record per
rank to ``<out>/<scenario>.<rank>.json``.

Scenarios: ``commit``; ``fail-P1`` .. ``fail-P6`` (failure injected on rank 2);
``enable-dense-mismatch`` (rank 1 has dense DWDP off); ``weights-mismatch`` (rank 3 has
other weights); ``leak`` (the model holds an extra view of one weight); ``expert-commit``;
``expert-fail-<phase>``; ``expert-shape-mismatch``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _toy import TOY_ARCH, build_toy, intact, snapshot

from dwdp.api.partition import expert_partition
from dwdp.worker.backend.cpu import CpuBackend, leftover_segments
from dwdp.worker.dense.layout import Segment
from dwdp.worker.setup.dense import DenseSetupOptions, setup_dense
from dwdp.worker.setup.expert import ExpertLayerWeights, setup_experts
from dwdp.worker.setup.phases import FailAt, FailureInjector, SetupError

FAIL_RANK = 2
SCENARIOS = (
    "commit",
    *(f"fail-P{i}" for i in range(1, 7)),
    "enable-dense-mismatch",
    "weights-mismatch",
    "leak",
    "expert-commit",
    *(f"expert-fail-{p}" for p in ("handshake", "allocate", "map", "commit")),
    "expert-shape-mismatch",
)


def _dense_forward_check(model, dense, ids, reference) -> bool:
    """Run the model with DWDP: before each MoE layer, gather its blobs into its slots."""
    moe_order = {int(s.prefix.rsplit(".", 1)[1]): i for i, s in
                 enumerate(TOY_ARCH.moe_layers(model))}
    stream = dense.backend.new_stream("dense-copy")

    def before_layer(index: int) -> None:
        if index in moe_order:
            layer = moe_order[index]
            for segment in Segment:
                dense.launch(layer, segment, dense.home_slot(layer, segment), stream)

    out = model(ids, before_layer=before_layer)
    return bool(torch.equal(out, reference))


def _scheduled_forward_check(model, dense, ids, reference) -> bool:
    """Two forwards driven by the dense slot schedule's hooks H0-H3 (standalone mode): the
    schedule launches our copy plans through ``dense.launch``."""
    from dwdp.worker.schedule.dense import DenseSlotSchedule

    moe_order = {int(s.prefix.rsplit(".", 1)[1]): i for i, s in
                 enumerate(TOY_ARCH.moe_layers(model))}
    backend = dense.backend
    schedule = DenseSlotSchedule(backend=backend, copy_stream=backend.new_stream("dense-copy"),
                                 layers=range(dense.num_layers), launch=dense.launch,
                                 attached=False)

    def hook(method):
        def call(index: int) -> None:
            if index in moe_order:
                getattr(schedule, method)(moe_order[index])
        return call

    ok = True
    for _ in range(2):
        schedule.h0_forward_entry()
        out = model(ids, before_layer=hook("h1_layer_entry"),
                    after_attention=hook("h2_after_attention"), after_mlp=hook("h3_after_moe"))
        ok &= bool(torch.equal(out, reference))
    return ok


def run_dense(scenario: str, transport, backend, rank: int) -> dict:
    model = build_toy(perturb=scenario == "weights-mismatch" and rank == 3)
    if scenario == "leak":
        model.kept_alive = model.model.layers[2].self_attn.o_proj.weight.detach()
    ids = torch.arange(12).reshape(2, 6) % 64
    reference = model(ids)
    before = snapshot(model)
    fail = (FailAt(f"P{scenario[-1]}", FAIL_RANK),) if scenario.startswith("fail-P") else ()
    record: dict = {"scenario": scenario, "rank": rank}
    try:
        dense = setup_dense(
            model, TOY_ARCH.moe_layers(model), backend=backend, transport=transport,
            enable_dense=not (scenario == "enable-dense-mismatch" and rank == 1),
            options=DenseSetupOptions(min_bytes=0),  # the toy's storages are all under 1 MiB
            injector=FailureInjector(fail))
    except SetupError as exc:
        record.update(ok=False, phase=exc.phase, failed=list(exc.failed_ranks),
                      restored=exc.restored, error=str(exc))
        if exc.restored:
            record["changed"] = intact(model, before)
            record["forward_equal"] = bool(torch.equal(model(ids), reference))
        return record
    assert dense is not None
    record.update(ok=True, digest=dense.layout.digest, status=dense.status().as_dict(),
                  padded_bytes=dense.layout.padded_bytes,
                  slot_sizes={s.value: [b.nbytes for b in dense.slot_buffers(s)]
                              for s in Segment},
                  moved=[t.name for b in dense.layout.blobs for t in b.tensors()],
                  replicated=[r.name for r in dense.layout.replicated],
                  forward_equal=_dense_forward_check(model, dense, ids, reference),
                  scheduled_forward_equal=_scheduled_forward_check(model, dense, ids,
                                                                   reference))
    dense.release()
    return record


def run_expert(scenario: str, transport, backend, rank: int) -> dict:
    model = build_toy()
    world = transport.world_size
    partition = expert_partition(8, world)
    start, end = partition.ranges[rank]
    layers = []
    for index, layer in enumerate(model.model.layers[1:]):
        experts = layer.mlp.experts
        tensors = {"gate_up_proj": experts.gate_up_proj[start:end].contiguous(),
                   "down_proj": experts.down_proj[start:end].contiguous()}
        if scenario == "expert-shape-mismatch" and rank == 1 and index == 0:
            tensors["down_proj"] = tensors["down_proj"][:, :, :-1].contiguous()
        layers.append(ExpertLayerWeights(f"model.layers.{index + 1}", tensors))
    fail: tuple[FailAt, ...] = ()
    if scenario.startswith("expert-fail-"):
        fail = (FailAt(scenario.removeprefix("expert-fail-"), FAIL_RANK),)
    record: dict = {"scenario": scenario, "rank": rank}
    try:
        experts = setup_experts(layers, partition=partition, backend=backend,
                                transport=transport, num_slots=2,
                                injector=FailureInjector(fail))
    except SetupError as exc:
        record.update(ok=False, phase=exc.phase, failed=list(exc.failed_ranks), error=str(exc))
        return record
    # Every slot view must equal the full expert table after its plan ran.
    stream = backend.new_stream("expert-copy")
    full_ok = True
    for layer_index, layer in enumerate(model.model.layers[1:]):
        slot = layer_index % 2
        experts.launch(layer_index, slot, stream)
        views = experts.slot_views(slot)
        full_ok &= torch.equal(views["gate_up_proj"], layer.mlp.experts.gate_up_proj)
        full_ok &= torch.equal(views["down_proj"], layer.mlp.experts.down_proj)
    record.update(ok=True, full_tables=bool(full_ok), status=experts.status().as_dict(),
                  ranges=[list(r) for r in experts.ranges])
    experts.release()
    return record


def run_scenario(scenario: str, transport, rank: int, group: str, out: Path) -> None:
    torch.set_num_threads(1)  # four ranks share two cores: no intra-op thread pools
    backend = CpuBackend(group=group, incarnation=transport_incarnation(scenario), rank=rank)
    try:
        runner = run_expert if scenario.startswith("expert-") else run_dense
        record = runner(scenario, transport, backend, rank)
    except BaseException as exc:
        record = {"scenario": scenario, "rank": rank, "crash": repr(exc),
                  "traceback": traceback.format_exc()}
    transport.barrier(label=f"end-{scenario}")  # every rank released: nothing may be left
    record["leftover_segments"] = leftover_segments(group)
    (out / f"{scenario}.{rank}.json").write_text(json.dumps(record))


def transport_incarnation(scenario: str) -> str:
    return f"inc-{scenario}"


def main_mpi(out: Path, scenarios: list[str], group: str) -> None:
    from dwdp.worker.transport.mpi import MpiTransport

    transport = MpiTransport.split(timeout_s=float(os.environ.get("DWDP_RENDEZVOUS_TIMEOUT_S",
                                                                  "30")))
    assert transport is not None
    for scenario in scenarios:
        run_scenario(scenario, transport, transport.rank, group, out)
    transport.close()


if __name__ == "__main__":
    main_mpi(Path(sys.argv[1]), sys.argv[3].split(","), sys.argv[2])

"""Which MoE layers DWDP manages (docs/design.md §6.4): a layer it cannot manage keeps its full
expert table, with one WARNING per reason and a count; repeated layers are declared."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from dwdp.worker.expert.managed import (  # noqa: E402
    RepeatedLayerError,
    UnmanagedReason,
    log_unmanaged,
    select_layers,
)
from dwdp.worker.models import adapter_for  # noqa: E402
from dwdp_dev.worker.checkpoint import tiny_config  # noqa: E402

pytestmark = pytest.mark.unit


def _model(num_layers: int = 5):
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen3_moe", vocab_size=64, num_experts=6, num_layers=num_layers)
    return AutoModelForCausalLM.from_config(config).eval()


class PerExpertMlps(nn.Module):
    """Experts as a list of per-expert MLPs (not fused tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))


def test_unmanaged_layers_keep_their_table_and_orders_stay_consecutive():
    model = _model()
    layers = model.model.layers
    layers[2].mlp.experts = PerExpertMlps()
    bigger = layers[3].mlp.experts
    bigger.down_proj = nn.Parameter(torch.cat([bigger.down_proj.data, bigger.down_proj.data[:1]]))
    bigger.gate_up_proj = nn.Parameter(
        torch.cat([bigger.gate_up_proj.data, bigger.gate_up_proj.data[:1]])
    )
    selection = select_layers(model, adapter_for(model), 6)
    assert [(m.layer_index, m.moe_index) for m in selection.managed] == [(1, 0), (4, 1)]
    assert [(u.prefix, u.reason) for u in selection.unmanaged] == [
        ("model.layers.2", UnmanagedReason.NOT_FUSED),
        ("model.layers.3", UnmanagedReason.EXPERT_COUNT),
    ]
    assert "7 experts, the partition splits 6" in selection.unmanaged[1].detail
    assert selection.unmanaged_counts() == {"experts_not_fused": 1, "expert_count": 1}


def test_one_warning_per_reason_and_one_count_line(caplog):
    model = _model(num_layers=6)
    for index in (2, 3, 5):
        model.model.layers[index].mlp.experts = PerExpertMlps()
    selection = select_layers(model, adapter_for(model), None)
    with caplog.at_level(logging.INFO, logger="dwdp.worker.expert.managed"):
        log_unmanaged(selection.unmanaged, rank=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model.layers.2" in warnings[0]
    assert "keeps its full expert table" in warnings[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["DWDP rank 1: MoE layers kept whole: experts_not_fused=3"]


def test_every_layer_managed_logs_nothing(caplog):
    model = _model()
    selection = select_layers(model, adapter_for(model), 6)
    with caplog.at_level(logging.DEBUG):
        log_unmanaged(selection.unmanaged, rank=0)
    assert not caplog.records and selection.unmanaged_counts() == {}


def test_repeated_layers_from_the_config_map_to_moe_orders():
    model = _model()
    model.config.dwdp_repeated_layers = [3]
    assert select_layers(model, adapter_for(model), 6).repeated == frozenset({2})
    model.config.dwdp_repeated_layers = [0]  # layer 0 is a dense MLP layer
    with pytest.raises(RepeatedLayerError, match=r"decoder layer\(s\) \[0\] are not MoE layers"):
        select_layers(model, adapter_for(model), 6)

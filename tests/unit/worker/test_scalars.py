"""The scalar exchange's rule (seed 000, "The exchange"): bitwise equal to rank 0's, one ULP
only for a 16-bit parameter cast from float32 checkpoint values; the message names the layer
and the parameter."""

from __future__ import annotations

import pytest
import torch

from dwdp.worker.setup.scalars import LayerScalar, disagreement, within_one_ulp

pytestmark = pytest.mark.unit

VALUES = torch.tensor([1.0, -0.37, 3.0e-3, 0.0, -2.5])


def _step(values: torch.Tensor, dtype: torch.dtype, ulps: int) -> torch.Tensor:
    """``values`` cast to ``dtype``, each moved ``ulps`` representable values away from 0."""
    bits = values.to(dtype).view(torch.int16)
    return (bits + ulps).view(dtype)


def _scalar(t: torch.Tensor, checkpoint: str | None) -> LayerScalar:
    dtype = str(t.dtype).removeprefix("torch.")
    return LayerScalar("model.layers.3", "post_attention_layernorm.weight", dtype, checkpoint,
                       t.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_ulp_passes_only_when_cast_from_float32(dtype):
    ref = VALUES.to(dtype)
    one = _step(VALUES, dtype, 1)
    assert within_one_ulp(_scalar(ref, None).data, _scalar(one, None).data,
                          str(dtype).removeprefix("torch."))
    assert disagreement(_scalar(one, "float32"), _scalar(ref, "float32")) is None
    for checkpoint in (str(dtype).removeprefix("torch."), None):  # a 16-bit or unknown one
        why = disagreement(_scalar(one, checkpoint), _scalar(ref, checkpoint))
        assert why is not None and "not bitwise equal" in why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_ulps_fail_naming_the_layer_and_the_parameter(dtype):
    ref = VALUES.to(dtype)
    why = disagreement(_scalar(_step(VALUES, dtype, 2), "float32"), _scalar(ref, "float32"))
    assert why == (
        "layer model.layers.3: parameter post_attention_layernorm.weight differs from rank "
        "0's: more than one unit in the last place"
    )


def test_zero_crossing_counts_in_ulps():
    """+0 and the smallest negative subnormal are one ULP apart; +0 and -0 are equal."""
    zero = torch.zeros(1, dtype=torch.bfloat16)
    neg = torch.tensor([-(2**-133)], dtype=torch.bfloat16)
    assert within_one_ulp(_scalar(zero, None).data, _scalar(neg, None).data, "bfloat16")
    assert within_one_ulp(_scalar(zero, None).data, _scalar(-zero, None).data, "bfloat16")


def test_wider_parameters_and_nans_are_bitwise():
    ref = VALUES.clone()
    near = torch.nextafter(VALUES, torch.full_like(VALUES, 10.0))
    why = disagreement(_scalar(near, "float32"), _scalar(ref, "float32"))
    assert why is not None and "not bitwise equal" in why
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    other_nan = (nan.view(torch.int16) + 1).view(torch.bfloat16)
    assert disagreement(_scalar(nan, "float32"), _scalar(nan, "float32")) is None
    assert disagreement(_scalar(other_nan, "float32"), _scalar(nan, "float32")) is not None


def test_another_shape_or_dtype_fails():
    ref = _scalar(VALUES.to(torch.bfloat16), "float32")
    why = disagreement(_scalar(VALUES[:3].to(torch.bfloat16), "float32"), ref)
    assert why is not None and "rank 0's bfloat16 of 10 bytes" in why
    assert "missing on rank 0" in (disagreement(ref, None) or "")

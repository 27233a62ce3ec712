"""The scalar exchange: per-layer scalars every rank must agree on, compared once at setup.

Which tensors: in every MoE decoder layer DWDP manages, each parameter or buffer outside the
expert tables with at most one dimension (zero-dimensional scales, the routing bias, norm
weights, per-channel scales). Each rank serves with its own copy of them, so a rank that
loaded other values would route or scale differently without any error (docs/design.md §6.4).

The rule (seed 000, "The exchange"), compared with rank 0's bytes:
- bitwise equal, in general;
- within one unit in the last place where the parameter is 16-bit (bfloat16, float16) and
  its checkpoint values were float32 (the checkpoint dtype is read from the safetensors
  headers; unknown counts as not float32): a cast of nearby float32 values may round either
  way. Rank 0's bytes are then installed on every rank, so every rank serves the same value.

One collective (every rank sends every scalar's bytes); every rank computes the same verdict
from it. A disagreement raises :class:`~dwdp.worker.setup.phases.SetupError` (phase
``scalars``) on every rank, naming the rank, the layer and the parameter; nothing has been
allocated yet, so every rank still holds its own weights (``restored=True``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dwdp.worker.models.base import EXPERT_PARAMS, MoeLayer
from dwdp.worker.setup.group_vote import vote
from dwdp.worker.setup.phases import SetupError
from dwdp.worker.transport.base import GroupTransport
from dwdp.worker.transport.codec import wire_record

log = logging.getLogger(__name__)

PHASE_SCALARS = "scalars"
"""The setup phase word of the exchange (termination messages start with it)."""

@wire_record("setup.layer_scalar")
@dataclass(frozen=True, slots=True)
class LayerScalar:
    """One per-layer scalar as this rank holds it: ``layer`` (the decoder layer's prefix,
    ``model.layers.3``), ``param`` (relative to it, ``mlp.gate.e_score_correction_bias``),
    ``dtype`` (torch dtype name), ``checkpoint_dtype`` (the safetensors dtype name, or
    ``None`` when unknown) and ``data`` (the bytes)."""

    layer: str
    param: str
    dtype: str
    checkpoint_dtype: str | None
    data: bytes

    @property
    def name(self) -> str:
        return f"{self.layer}.{self.param}"

    @property
    def ulp_allowed(self) -> bool:
        """True for a 16-bit parameter cast from float32 checkpoint values."""
        return self.dtype in ("bfloat16", "float16") and self.checkpoint_dtype == "float32"


@dataclass(frozen=True, slots=True)
class ScalarReport:
    """What the exchange found on this rank: how many scalars it compared and the names
    whose value it replaced with rank 0's (one ULP apart)."""

    compared: int
    installed: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {"compared": self.compared, "installed": list(self.installed)}


def _tensors(layer: MoeLayer) -> list[tuple[str, torch.Tensor]]:
    experts = {id(t) for t in layer.expert_tensors().values()}
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for rel, module in layer.decoder_layer.named_modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is None or id(tensor) in seen or id(tensor) in experts:
                    continue
                seen.add(id(tensor))
                if tensor.dim() <= 1 and attr not in EXPERT_PARAMS and not tensor.is_meta:
                    out.append((f"{rel}.{attr}" if rel else attr, tensor))
    return out


def collect_scalars(
    layers: Sequence[MoeLayer], checkpoint_dtypes: Mapping[str, str]
) -> list[tuple[LayerScalar, torch.Tensor]]:
    """Every per-layer scalar of ``layers`` with the tensor it came from, in layer order.

    ``checkpoint_dtypes``: fully qualified name -> safetensors dtype name (``float32``)."""
    out = []
    for layer in layers:
        for param, tensor in _tensors(layer):
            data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            name = f"{layer.prefix}.{param}"
            dtype = str(tensor.dtype).removeprefix("torch.")
            scalar = LayerScalar(layer.prefix, param, dtype, checkpoint_dtypes.get(name),
                                 data.numpy().tobytes())
            out.append((scalar, tensor))
    return out


def _ordered16(data: bytes) -> torch.Tensor:
    """16-bit floats' bits as integers ordered like their values (sign-magnitude -> two's
    complement), so adjacent representable values differ by 1."""
    bits = torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits >= 0x8000, -(bits & 0x7FFF), bits)


_NAN_ABOVE = {"bfloat16": 0x7F80, "float16": 0x7C00}
"""Magnitude bits above which a 16-bit float is a NaN."""


def within_one_ulp(a: bytes, b: bytes, dtype: str) -> bool:
    """True when the 16-bit floats ``a`` and ``b`` (``dtype`` ``bfloat16`` or ``float16``)
    are each at most one unit in the last place apart; NaNs must be bitwise equal."""
    if len(a) != len(b) or dtype not in _NAN_ABOVE:
        return False
    x, y = _ordered16(a), _ordered16(b)
    nan = (x.abs() > _NAN_ABOVE[dtype]) | (y.abs() > _NAN_ABOVE[dtype])
    differ = x != y
    return bool(((x - y).abs() <= 1).all()) and not bool(nan[differ].any())


def disagreement(mine: LayerScalar, ref: LayerScalar | None) -> str | None:
    """Why ``mine`` is not acceptable next to rank 0's ``ref`` (``None``: it is)."""
    if ref is None:
        return f"layer {mine.layer}: parameter {mine.param} is missing on rank 0"
    if (mine.dtype, len(mine.data)) != (ref.dtype, len(ref.data)):
        return (f"layer {mine.layer}: parameter {mine.param} is {mine.dtype} of "
                f"{len(mine.data)} bytes, rank 0's {ref.dtype} of {len(ref.data)} bytes")
    if mine.data == ref.data:
        return None
    if mine.ulp_allowed and ref.ulp_allowed and within_one_ulp(mine.data, ref.data,
                                                               mine.dtype):
        return None
    rule = ("more than one unit in the last place" if mine.ulp_allowed
            else "not bitwise equal (" + (f"{mine.dtype} checkpoint values"
                                          if mine.checkpoint_dtype else "checkpoint dtype "
                                          "unknown") + ")")
    return f"layer {mine.layer}: parameter {mine.param} differs from rank 0's: {rule}"


def exchange_scalars(
    layers: Sequence[MoeLayer], transport: GroupTransport, checkpoint_dtypes: Mapping[str, str]
) -> ScalarReport:
    """Run the scalar exchange (a collective: every rank calls it before any DWDP
    allocation) and install rank 0's value where the one-ULP allowance applied.

    Raises :class:`SetupError` (phase ``scalars``) on every rank when any rank's scalars
    differ from rank 0's beyond the rule; the message names rank, layer and parameter.
    """
    collected = collect_scalars(layers, checkpoint_dtypes)
    mine = tuple(s for s, _ in collected)
    exchange = vote(transport, PHASE_SCALARS, None, mine)
    errors: dict[int, str] = dict(exchange.errors)
    reference = {s.name: s for s in exchange.payloads[0]}
    for rank, scalars in enumerate(exchange.payloads):
        names = {s.name for s in scalars}
        problems = [p for s in scalars if (p := disagreement(s, reference.get(s.name)))]
        problems += [f"layer {reference[n].layer}: parameter {reference[n].param} is missing"
                     for n in sorted(set(reference) - names)]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            errors.setdefault(rank, problems[0] + more)
    if errors:
        raise SetupError(PHASE_SCALARS, "exchange the per-layer scalars", errors,
                         restored=True)
    installed = []
    for scalar, tensor in collected:
        ref = reference[scalar.name]
        if ref.data != scalar.data:
            source = torch.frombuffer(bytearray(ref.data), dtype=tensor.dtype)
            with torch.no_grad():
                tensor.copy_(source.reshape(tensor.shape).to(tensor.device))
            installed.append(scalar.name)
    if installed:
        log.warning("DWDP rank %d: %d per-layer scalar(s) one ULP off rank 0's; rank 0's value "
                    "installed: %s", transport.rank, len(installed), ", ".join(installed[:8]))
    return ScalarReport(len(collected), tuple(installed))

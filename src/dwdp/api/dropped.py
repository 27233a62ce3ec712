"""Fields the API no longer has, each with why; the words ``dwdp validate`` prints for them.

Earlier specs had a ``parallel`` section (tensor, pipeline and context parallel sizes,
attention data parallelism) and an ``engine`` section (six engine switches) in the context
and generation sections of a DwdpDeployment and in a worker's launch config. This worker
accepted only their defaults (every rank serves one whole model through the eager forward
pass of the base checkpoint), so the fields are gone from the models and the CRD, except
``engine.cudaGraphs``, which came back as a real setting (:class:`dwdp.api.launch.EngineSpec`):
the ``engine`` section is known again, and its five other switches are dropped fields in it
(``speculativeDecoding``'s reason points to ``engine.speculative``, its successor).
A document that still writes one, at any value, is refused as an unknown field: the models
forbid unknown fields, and the apiserver refuses them under strict field validation (what
``kubectl apply`` asks for) or prunes them otherwise (the CRD's schema is structural).

:func:`unknown_field_rules` words the refusal of any unknown field: a dropped field gets its
reason (``unknown field (dropped: tensor parallelism is not supported yet; ...)``), any other
one the generic words, with the nearest known field name when one is close.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

__all__ = [
    "DROPPED_FIELDS",
    "DROPPED_UNDER",
    "UNKNOWN_FIELD",
    "dropped_reason",
    "unknown_field_rules",
]

UNKNOWN_FIELD = "unknown field"
"""The words every unknown-field refusal starts with (the apiserver's say the same)."""

_ONE_MODEL = "each rank serves one whole model"
_EAGER = "the engine runs the model's own forward pass"

DROPPED_FIELDS: Mapping[tuple[str, ...], str] = {
    ("parallel",): f"the parallel layout is not configurable yet; {_ONE_MODEL}",
    ("parallel", "tensorParallelSize"): f"tensor parallelism is not supported yet; {_ONE_MODEL}",
    ("parallel", "pipelineParallelSize"): (
        f"pipeline parallelism is not supported yet; {_ONE_MODEL}"
    ),
    ("parallel", "contextParallelSize"): (
        f"context parallelism is not supported yet; {_ONE_MODEL}"
    ),
    ("parallel", "attentionDP"): (
        f"attention data parallelism is not supported yet; {_ONE_MODEL}"
    ),
    ("engine", "torchCompile"): f"torch.compile of the model is not supported yet; {_EAGER}",
    ("engine", "overlapScheduler"): (
        "the overlap scheduler is not supported yet; each step is scheduled after the "
        "previous one"
    ),
    ("engine", "lora"): "LoRA adapters are not supported yet; the base checkpoint is served",
    ("engine", "speculativeDecoding"): (
        "speculative decoding is engine.speculative now (method and numSpeculativeTokens)"
    ),
    ("engine", "sleepMode"): (
        "sleep mode is not supported yet; weights and KV cache stay resident"
    ),
}
"""Every dropped field, by its path (camelCase) under one of :data:`DROPPED_UNDER`, with
why it is gone; a section (``parallel``) is dropped with all its fields."""

DROPPED_UNDER: tuple[tuple[str, ...], ...] = ((), ("spec", "context"), ("spec", "generation"))
"""Where the dropped fields were: a launch config's root and a DwdpDeployment's serving
sections."""


def dropped_reason(path: tuple[str | int, ...]) -> str | None:
    """Why the field at ``path`` (from a document's root) was dropped, or None."""
    for under in DROPPED_UNDER:
        if path[: len(under)] == under and len(path) > len(under):
            reason = DROPPED_FIELDS.get(tuple(str(p) for p in path[len(under) :]))
            if reason is not None:
                return reason
    return None


def _dropped(reason: str) -> str:
    return f"{UNKNOWN_FIELD} (dropped: {reason})"


CONTEXT_ONLY: Mapping[str, str] = {
    "dwdp": "DWDP runs on context servers only (spec.context.dwdp): a generation server holds "
    "the whole model and decodes from the context servers' KV cache",
    "handleType": "the handle type of DWDP's stores is a context-server setting "
    "(spec.context.handleType): a generation server runs no DWDP",
}
"""The context section's fields a generation section does not take, with why."""


def _rule(path: tuple[str | int, ...], known: Iterable[str]) -> str:
    reason = dropped_reason(path)
    if reason is not None:
        return _dropped(reason)
    if len(path) == 3 and path[:2] == ("spec", "generation") and str(path[2]) in CONTEXT_ONLY:
        return f"{UNKNOWN_FIELD} here: {CONTEXT_ONLY[str(path[2])]}"
    near = difflib.get_close_matches(str(path[-1]), list(known), n=1) if path else []
    hint = f"did you mean {near[0]}? " if near else ""
    return f"{UNKNOWN_FIELD} ({hint}check its spelling and indentation)"


def unknown_field_rules(
    path: tuple[str | int, ...], value: object, known: Iterable[str] = ()
) -> list[tuple[tuple[str | int, ...], str]]:
    """The refusal of the unknown field at ``path`` holding ``value``, as (path, rule) pairs.

    ``known`` lists the field names the object holding it accepts (for "did you mean").
    A dropped section written as a mapping gives one pair per field inside it, each with
    the most specific reason (``spec.context.parallel.tensorParallelSize``); an empty or
    non-mapping one gives one pair at the section itself.
    """
    section = dropped_reason(path)
    if section is not None and isinstance(value, Mapping) and value:
        return [
            ((*path, key), _dropped(dropped_reason((*path, key)) or section)) for key in value
        ]
    return [(path, _rule(path, known))]

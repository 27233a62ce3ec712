"""DwdpConfig: the DWDP settings of one worker (docs/design.md §3.1).

snake_case in Python, camelCase in YAML and the CRD. Parsing applies every rule of 3.1 and
reports each broken one as a :class:`~dwdp.api.errors.Problem` naming the field, its value and
the rule. The same rules are written as CEL for the CRD (``x-kubernetes-validations`` below);
the case table in ``tests/cases`` checks that both reach the same verdict.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from dwdp.api.base import (
    ApiModel,
    Bool,
    Int64,
    NonNegInt,
    PosInt,
    cel_literal,
    cel_rule,
    cel_rules,
)
from dwdp.api.enums import CopyMode, GatherKernel
from dwdp.api.errors import Problem, RuleViolations
from dwdp.api.partition import ExpertPartition, expert_partition

__all__ = ["EXPERT_FIELD_DEFAULTS", "DwdpConfig"]

# The expert fields and the defaults they must keep while enable_experts is false:
# (python name, camelCase name, default).
EXPERT_FIELD_DEFAULTS: tuple[tuple[str, str, int | bool], ...] = (
    ("dwdp_size", "dwdpSize", 1),
    ("num_groups", "numGroups", 1),
    ("num_experts_per_worker", "numExpertsPerWorker", 0),
    ("num_prefetch_experts", "numPrefetchExperts", 0),
    ("contention_opt", "contentionOpt", False),
    ("num_prefetch_slots", "numPrefetchSlots", 2),
)


SM_RESERVE_RULE = "must be auto or a number of SMs of at least 1"


def _cel_rules() -> list[dict[str, str]]:
    rules = [
        cel_rule(
            "!has(self.gatherKernel) || (has(self.copyMode) && self.copyMode == 'gather')",
            "gatherKernel is only valid with copyMode: gather",
            field_path=".gatherKernel",
        ),
        cel_rule(
            "!has(self.smReserve) || type(self.smReserve) == string || self.smReserve >= 1",
            f"smReserve {SM_RESERVE_RULE}",
            field_path=".smReserve",
        ),
        cel_rule(
            "!has(self.smReserve) || type(self.smReserve) != string || "
            "self.smReserve != 'auto' || "
            "(has(self.copyMode) && self.copyMode == 'gather')",
            "smReserve auto is the gather kernel's resident SMs and needs copyMode: gather",
            field_path=".smReserve",
        ),
        cel_rule(
            "!self.contentionOpt || !has(self.copyMode) || self.copyMode == 'batched'",
            "copyMode must be batched or unset while contentionOpt is true",
            field_path=".copyMode",
        ),
        cel_rule(
            "(self.numExpertsPerWorker == 0) == (self.numPrefetchExperts == 0)",
            "numExpertsPerWorker and numPrefetchExperts must be both 0 (the balanced "
            "partition) or both greater than 0",
            field_path=".numPrefetchExperts",
        ),
        cel_rule(
            "self.numExpertsPerWorker == 0 || self.numPrefetchExperts == 0 || "
            "self.numPrefetchExperts <= self.numExpertsPerWorker",
            "numPrefetchExperts (the stride) must not exceed numExpertsPerWorker (the range "
            "size), or experts between the ranges are stored by no rank",
            field_path=".numPrefetchExperts",
        ),
    ]
    for _, camel, default in EXPERT_FIELD_DEFAULTS:
        literal = cel_literal(default)
        rules.append(
            cel_rule(
                f"self.enableExperts || self.{camel} == {literal}",
                f"{camel} must keep its default {literal} while enableExperts is false",
                field_path=f".{camel}",
            )
        )
    rules.append(
        cel_rule(
            "self.enableExperts || self.enableDense",
            "enableExperts and enableDense are both false: DWDP has nothing to distribute",
            field_path=".enableExperts",
        )
    )
    return rules


class DwdpConfig(ApiModel):
    """The DWDP settings of a worker; every field defaults as docs/design.md §3.1 says.

    Raises pydantic's ``ValidationError`` on parse; turn it into problems with
    :func:`dwdp.api.errors.problems_from_validation_error`.
    """

    model_config = ConfigDict(
        json_schema_extra=cel_rules(_cel_rules),
    )

    dwdp_size: PosInt = Field(
        default=1, description="Ranks (GPUs) per DWDP group; expert DWDP needs more than 1."
    )
    num_groups: PosInt = Field(
        default=1, description="DWDP groups per instance (reference semantics); at least 1."
    )
    num_experts_per_worker: NonNegInt = Field(
        default=0,
        description="Routed experts stored per rank (the range size); 0 together with "
        "numPrefetchExperts 0 selects the balanced partition.",
    )
    num_prefetch_experts: NonNegInt = Field(
        default=0,
        description="Stride, in experts, between the starts of consecutive ranks' ranges; "
        "0 together with numExpertsPerWorker 0 selects the balanced partition.",
    )
    contention_opt: Bool = Field(
        default=False,
        description="Batched, peer-interleaved copies: with copyMode unset it means batched "
        "(one batched copy per layer, peers interleaved); an explicit copyMode must be "
        "batched.",
    )
    num_prefetch_slots: Int64 = Field(
        default=2,
        ge=2,
        description="Depth of the expert prefetch ring, at least 2; the gather runs "
        "slots - 1 MoE layers ahead.",
    )
    enable_experts: Bool = Field(
        default=True,
        description="Expert DWDP. When false every expert field keeps its default.",
    )
    enable_dense: Bool = Field(
        default=False,
        description="Dense DWDP (context servers only): also row-shard the non-expert "
        "weights of the MoE decoder layers.",
    )
    copy_mode: CopyMode | None = Field(
        default=None,
        description="per_slice, batched or gather, for every DWDP copy (expert and dense); "
        "unset keeps the default selection.",
    )
    gather_kernel: GatherKernel | None = Field(
        default=None, description="register or tma; only with copyMode gather."
    )
    sm_reserve: Literal["auto"] | PosInt | None = Field(
        default=None,
        description="SMs the model's persistent GEMMs (cuBLAS, the experts' grouped GEMMs) "
        "leave free while DWDP is attached, for the gather kernel running beside them: auto "
        "= the gather's resident SMs (needs copyMode gather), or a number of SMs (below the "
        "device's count). Unset: off (measured on one H200, it left an 8K-token prefill "
        "within 1% and slowed a 16K one by 2%).",
    )

    @field_validator("sm_reserve", mode="wrap")
    @classmethod
    def _one_sm_reserve_rule(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One problem for a bad smReserve (not one per branch of its union)."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(SM_RESERVE_RULE) from None

    @model_validator(mode="after")
    def _check_rules(self) -> DwdpConfig:
        problems = self.rule_problems()
        if problems:
            raise RuleViolations(problems)
        return self

    def rule_problems(self) -> list[Problem]:
        """Every cross-field rule of docs/design.md §3.1 this config breaks, in a fixed order.

        Paths are relative to the config (``gatherKernel``); field-level rules (types,
        enums, minimums) are checked by pydantic before this runs.
        """
        problems: list[Problem] = []
        if self.gather_kernel is not None and self.copy_mode is not CopyMode.GATHER:
            mode = self.copy_mode.value if self.copy_mode else "unset"
            problems.append(
                Problem(
                    ("gatherKernel",),
                    self.gather_kernel.value,
                    f"is only valid with copyMode: gather (copyMode is {mode})",
                )
            )
        if self.sm_reserve == "auto" and self.copy_mode is not CopyMode.GATHER:
            mode = self.copy_mode.value if self.copy_mode else "unset"
            problems.append(
                Problem(
                    ("smReserve",),
                    "auto",
                    f"auto is the gather kernel's resident SMs and needs copyMode: gather "
                    f"(copyMode is {mode}); give a number of SMs or leave it unset",
                )
            )
        if self.contention_opt and self.copy_mode not in (None, CopyMode.BATCHED):
            problems.append(
                Problem(
                    ("copyMode",),
                    self.copy_mode.value,
                    "must be batched or unset while contentionOpt is true",
                )
            )
        size, stride = self.num_experts_per_worker, self.num_prefetch_experts
        if (size == 0) != (stride == 0):
            zero, other, other_value = (
                ("numPrefetchExperts", "numExpertsPerWorker", size)
                if stride == 0
                else ("numExpertsPerWorker", "numPrefetchExperts", stride)
            )
            problems.append(
                Problem(
                    (zero,),
                    0,
                    f"must be greater than 0 when {other} is {other_value}: "
                    "numExpertsPerWorker and numPrefetchExperts are both 0 (the balanced "
                    "partition) or both greater than 0",
                )
            )
        elif size and stride > size:
            problems.append(
                Problem(
                    ("numPrefetchExperts",),
                    stride,
                    f"the stride must not exceed numExpertsPerWorker ({size}), or experts "
                    "between the ranges are stored by no rank",
                )
            )
        if not self.enable_experts:
            for py, camel, default in EXPERT_FIELD_DEFAULTS:
                value = getattr(self, py)
                if value != default:
                    shown = cel_literal(default)
                    problems.append(
                        Problem(
                            (camel,),
                            value,
                            f"must keep its default {shown} while enableExperts is false "
                            "(expert DWDP is off)",
                        )
                    )
            if not self.enable_dense:
                problems.append(
                    Problem(
                        ("enableExperts",),
                        False,
                        "enableExperts and enableDense are both false: DWDP has nothing "
                        "to distribute; turn one of them on",
                    )
                )
        return problems

    @property
    def expert_dwdp(self) -> bool:
        """True when expert DWDP runs: enable_experts and more than one rank per group."""
        return self.enable_experts and self.dwdp_size > 1

    @property
    def balanced(self) -> bool:
        """True when the partition fields select the balanced partition (both 0)."""
        return self.num_experts_per_worker == 0 and self.num_prefetch_experts == 0

    def partition(self, num_experts: int) -> ExpertPartition:
        """The expert partition of ``num_experts`` routed experts over ``dwdp_size`` ranks.

        Raises :class:`~dwdp.api.partition.PartitionError` when the numbers fit none of
        the four kinds.
        """
        return expert_partition(
            num_experts,
            self.dwdp_size,
            experts_per_worker=self.num_experts_per_worker,
            prefetch_experts=self.num_prefetch_experts,
        )

"""Dropped fields (dwdp.api.dropped): unknown to the models and the CRD, with why in words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import caselib
import pytest
import yaml

from dwdp.api.crd import crd_manifest
from dwdp.api.deployment import deployment_problems
from dwdp.api.dropped import DROPPED_FIELDS, dropped_reason, unknown_field_rules

DWDP = Path(sys.executable).with_name("dwdp")
SECTIONS = ("context", "generation")


def _document(section: str, body: dict) -> dict:
    (base,) = [c for c in caselib.load_cases() if c.name == "defaults"]
    doc = caselib.merge_patch(base.document, {"spec": {section: body}})
    if section == "generation":
        doc["spec"]["generation"].setdefault("replicas", 1)
    return doc


def _lines(section: str, body: dict) -> list[str]:
    return [str(p) for p in deployment_problems(_document(section, body))]


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("path", sorted(p for p in DROPPED_FIELDS if len(p) == 2), ids=".".join)
def test_each_dropped_field_is_named_with_its_reason(path, section) -> None:
    """The field itself is named (not only its section), at its old default too."""
    group, name = path
    old_default = 1 if name.endswith("Size") else False
    lines = _lines(section, {group: {name: old_default}})
    where = f"spec.{section}.{group}.{name}"
    assert lines == [f"{where}: unknown field (dropped: {DROPPED_FIELDS[path]})"], lines


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("group", ["parallel"])
def test_a_dropped_section_is_named_with_its_reason(group, section) -> None:
    reason = DROPPED_FIELDS[(group,)]
    assert _lines(section, {group: {}}) == [
        f"spec.{section}.{group}: unknown field (dropped: {reason})"
    ]
    # a name the section never had gets the section's reason
    assert _lines(section, {group: {"pipelineStages": 2}}) == [
        f"spec.{section}.{group}.pipelineStages: unknown field (dropped: {reason})"
    ]


@pytest.mark.parametrize("section", SECTIONS)
def test_the_engine_section_is_known_with_cuda_graphs_only(section) -> None:
    """``engine.cudaGraphs`` is a real setting; the other switches stay dropped, each with its
    reason, and a name the section never had is an ordinary unknown field."""
    assert ("engine",) not in DROPPED_FIELDS
    assert ("engine", "cudaGraphs") not in DROPPED_FIELDS
    assert _lines(section, {"engine": {}}) == []
    assert _lines(section, {"engine": {"cudaGraphs": False}}) == []
    assert _lines(section, {"engine": {"cudaGraphs": True, "torchCompile": False}}) == [
        f"spec.{section}.engine.torchCompile: unknown field (dropped: "
        f"{DROPPED_FIELDS[('engine', 'torchCompile')]})"
    ]
    assert _lines(section, {"engine": {"cudaGraph": True}}) == [
        f"spec.{section}.engine.cudaGraph: unknown field (did you mean cudaGraphs? check its "
        "spelling and indentation)"
    ]


@pytest.mark.parametrize("section", SECTIONS)
def test_speculative_decoding_stays_dropped_and_points_to_speculative(section) -> None:
    """The old switch ``engine.speculativeDecoding`` is refused at any value, its reason
    naming its successor ``engine.speculative``, which is a real setting beside it."""
    assert _lines(section, {"engine": {"speculative": {"numSpeculativeTokens": 2}}}) == []
    assert _lines(section, {"engine": {"speculativeDecoding": True}}) == [
        f"spec.{section}.engine.speculativeDecoding: unknown field (dropped: speculative "
        "decoding is engine.speculative now (method and numSpeculativeTokens))"
    ]


def test_a_misspelled_field_gets_the_nearest_known_name() -> None:
    lines = _lines("context", {"dwdp": {"dwdpsize": 4}, "maxBatchSzie": 4, "zzz": 1})
    assert sorted(lines) == [
        "spec.context.dwdp.dwdpsize: unknown field (did you mean dwdpSize? check its "
        "spelling and indentation)",
        "spec.context.maxBatchSzie: unknown field (did you mean maxBatchSize? check its "
        "spelling and indentation)",
        "spec.context.zzz: unknown field (check its spelling and indentation)",
    ]


def test_the_reason_belongs_to_the_serving_sections_only() -> None:
    """``parallel`` elsewhere is an ordinary unknown field: no reason is made up for it."""
    assert dropped_reason(("spec", "context", "parallel")) is not None
    assert dropped_reason(("parallel", "attentionDP")) is not None  # a launch config
    assert dropped_reason(("spec", "router", "parallel")) is None
    assert dropped_reason(("spec", "context", "dwdp", "engine")) is None
    ((_, rule),) = unknown_field_rules(("spec", "router", "parallel"), {"x": 1})
    assert "dropped" not in rule


def test_no_dropped_field_is_in_the_crd() -> None:
    """A field that comes back must leave the table (its refusal would contradict it)."""
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for section in SECTIONS:
        for path in DROPPED_FIELDS:
            node = spec["spec"]["properties"][section]
            for name in path[:-1]:  # a kept section (engine) holding a dropped field
                node = node["properties"].get(name, {"properties": {}})
            assert path[-1] not in node["properties"], (section, path)


def test_dwdp_validate_prints_the_hint(tmp_path) -> None:
    """The console script, as a user runs it: exit 1, the dropped field and why."""
    path = tmp_path / "old.yaml"
    body = {"parallel": {"tensorParallelSize": 2}, "engine": {"torchCompile": True}}
    path.write_text(yaml.safe_dump(_document("context", body)))
    proc = subprocess.run(
        [str(DWDP), "validate", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout
    assert sorted(proc.stderr.splitlines()) == [
        f"{path}: spec.context.engine.torchCompile: unknown field (dropped: "
        f"{DROPPED_FIELDS[('engine', 'torchCompile')]})",
        f"{path}: spec.context.parallel.tensorParallelSize: unknown field (dropped: "
        f"{DROPPED_FIELDS[('parallel', 'tensorParallelSize')]})",
    ]

"""Every problem of one document in one report: a broken field does not hide the rules of the
objects around it (no rounds of fixing one problem to see the next), and a field dropped for
the next pass adds no problem of its own."""

from __future__ import annotations

from pathlib import Path

import yaml

from dwdp.api.deployment import deployment_problems

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "02-small.yaml"


def _doc(**context) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for key, value in context.items():
        section = doc["spec"]["context"]
        *parents, leaf = key.split("__")
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = value
    return doc


def test_schema_errors_and_worker_limits_come_in_one_report():
    """Two fields out of range, and three settings this worker refuses (which pydantic
    checks only once the section's fields validate): five lines, one per field."""
    doc = _doc(maxBatchSize=-3, kvCache__blockSize=0, engine__cudaGraphs=True,
               dwdp__copyMode="gather", handleType="shm")
    got = {p.where: p.rule for p in deployment_problems(doc)}
    assert set(got) == {
        "spec.context.maxBatchSize",
        "spec.context.kvCache.blockSize",
        "spec.context.engine.cudaGraphs",
        "spec.context.dwdp.copyMode",
        "spec.context.ranksPerPod",
    }, got
    assert "greater than or equal to 1" in got["spec.context.maxBatchSize"]
    assert "not supported by this worker" in got["spec.context.engine.cudaGraphs"]
    assert all("\n" not in str(p) for p in deployment_problems(doc))


def test_a_valid_document_and_a_document_with_one_problem_are_reported_as_before():
    assert deployment_problems(_doc()) == []
    (only,) = deployment_problems(_doc(maxBatchSize=0))
    assert only.where == "spec.context.maxBatchSize"


def test_a_field_refused_by_a_rule_is_not_replaced_by_its_default():
    """enableDense without enableExperts is refused by a rule of the section; replacing it
    by its default (false) would break another rule (both false) the document does not
    break: one problem only."""
    doc = _doc(dwdp={"enableDense": True, "enableExperts": False})
    (only,) = deployment_problems(doc)
    assert only.where == "spec.context.dwdp.enableDense", only


def test_dwdp_settings_on_a_generation_server_are_refused_saying_why():
    doc = yaml.safe_load((EXAMPLE.parent / "03-context-and-generation.yaml").read_text())
    doc["spec"]["generation"]["dwdp"] = {"enableDense": True}
    (only,) = deployment_problems(doc)
    assert only.where == "spec.generation.dwdp"
    assert "DWDP runs on context servers only" in only.rule, only

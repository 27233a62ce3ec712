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


SEED_INPUTS = {
    # the specification's three DWDP snippets, as a DwdpDeployment's context section says them
    "attached dense, DWDP16, gather tma": (
        {"dwdp": {"dwdpSize": 16, "enableDense": True, "copyMode": "gather",
                  "gatherKernel": "tma"}}, []),
    "standalone dense on one DEP16 instance": (
        {"parallel": {"tensorParallelSize": 16, "attentionDP": True},
         "dwdp": {"enableExperts": False, "enableDense": True, "copyMode": "gather",
                  "gatherKernel": "tma"}},
        ["spec.context.parallel.tensorParallelSize", "spec.context.parallel.attentionDP",
         "spec.context.dwdp.enableDense"]),
    "balanced partition, DWDP12": (
        {"dwdp": {"dwdpSize": 12, "numExpertsPerWorker": 0, "numPrefetchExperts": 0}}, []),
}


def test_the_specifications_inputs_are_run_or_refused_one_line_per_field():
    """Each of the specification's DWDP snippets: the attached and balanced ones validate;
    the standalone one (attention DP over tensor parallel ranks, which this worker does not
    run) is refused in one report, one line per field, each saying why."""
    for name, (context, refused) in SEED_INPUTS.items():
        doc = yaml.safe_load(EXAMPLE.read_text())
        doc["spec"]["context"] = context
        problems = deployment_problems(doc)
        assert [p.where for p in problems] == refused, (name, [str(p) for p in problems])
        for problem in problems:
            assert "\n" not in str(problem)
            assert "dropped:" in problem.rule or "not supported by this worker" in problem.rule


def test_a_rule_of_an_inner_object_does_not_hide_the_sections_rules():
    """smReserve auto without copyMode gather breaks a rule of the dwdp object, which kept the
    section's own rules from running: cudaGraphs true with DWDP on comes in the same report;
    a bad smReserve is one line, whatever its type."""
    doc = _doc(dwdp={"dwdpSize": 4, "smReserve": "auto"}, engine={"cudaGraphs": True},
               maxBatchSize=-3)
    got = [p.where for p in deployment_problems(doc)]
    assert sorted(got) == ["spec.context.dwdp.smReserve", "spec.context.engine.cudaGraphs",
                           "spec.context.maxBatchSize"], got
    for bad in (0, "AUTO", 1.5, True):
        (only,) = deployment_problems(_doc(dwdp={"dwdpSize": 4, "smReserve": bad}))
        assert str(only).startswith("spec.context.dwdp.smReserve: must be auto or a number"), only


def test_a_key_with_a_newline_cannot_forge_a_report_line():
    """An unknown key holding a newline (or spaces, or nothing) is quoted in brackets, as
    JSON, so a problem stays one line and no key can print a line that looks like another
    problem (found by the newcomer check and the launch-config fuzz test)."""
    forged = "a\n/tmp/x.yaml: spec: fake line"
    doc = _doc(**{forged: 1, " ": 2})
    lines = [str(p) for p in deployment_problems(doc)]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert 'spec.context["a\\n/tmp/x.yaml: spec: fake line"]: unknown field' in lines[0] + lines[1]
    assert any(line.startswith('spec.context[" "]: unknown field') for line in lines), lines


def test_a_whole_number_beyond_int64_is_refused_as_the_apiserver_refuses_it():
    """The apiserver reads an ``integer`` field as int64 and refuses a larger number; so do
    the models (found by the newcomer check: ``dwdp validate`` called such a document
    valid). The largest int64 itself passes the type check."""
    from dwdp.api.base import INT64_MAX

    too_big = {p.where: str(p) for p in deployment_problems(_doc(replicas=INT64_MAX + 1))}
    assert set(too_big) == {"spec.context.replicas"}, too_big
    assert "must be at most 9223372036854775807" in too_big["spec.context.replicas"]
    at_max = {p.where for p in deployment_problems(_doc(maxBatchSize=INT64_MAX))}
    assert "spec.context.maxBatchSize" not in at_max
    # every integer field, not only the counts: a negative toleration and the ring depth
    doc = _doc(dwdp__numPrefetchSlots=INT64_MAX + 1)
    doc["spec"]["tolerations"] = [
        {"key": "k", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": -INT64_MAX - 2}
    ]
    got = {p.where: str(p) for p in deployment_problems(doc)}
    toleration = "spec.tolerations[0].tolerationSeconds"
    assert set(got) == {"spec.context.dwdp.numPrefetchSlots", toleration}, got
    assert "must be at least -9223372036854775808" in got[toleration]


def test_a_refused_list_item_does_not_hide_the_rules_around_it():
    """A refused item of a list (a vLLM argument the operator sets) and two rules of the spec
    around it (the context's handle type and the model's dtype with a vLLM generation tier):
    three lines in one report (the item was never dropped, so the spec's rules never ran;
    found by the newcomer check)."""
    doc = _doc(handleType="fabric")
    doc["spec"]["generation"] = {
        "vllm": {"image": "vllm/vllm-cpu:0.32.0", "args": ["--kv-transfer-config.kv_role=x"]}
    }
    got = {p.where for p in deployment_problems(doc)}
    assert got == {
        "spec.generation.vllm.args[0]",
        "spec.context.handleType",
        "spec.model.dtype",
    }, got

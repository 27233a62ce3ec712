"""Launch rules (docs/design.md §3.2): the first broken requirement, roles, warnings, rendering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from dwdp.api.config import DwdpConfig
from dwdp.api.deployment import launch_config_for, parse_deployment
from dwdp.api.dropped import DROPPED_FIELDS
from dwdp.api.enums import DenseMode, HandleType, Role, Transport
from dwdp.api.errors import problems_from_validation_error
from dwdp.api.launch import (
    LaunchConfig,
    LaunchError,
    dense_mode,
    launch_message,
    launch_problem,
    launch_problems,
    launch_warnings,
    parse_role,
    resolve_role,
    validate_launch,
)
from dwdp.api.support import NOT_SUPPORTED


def launch(**fields) -> LaunchConfig:
    return LaunchConfig.model_validate({"model": {"path": "/models/m"}, **fields})


ATTACHED = {"dwdp": {"dwdpSize": 4, "enableDense": True}}
STANDALONE = {"dwdp": {"enableExperts": False, "enableDense": True}}


def test_defaults_and_both_spellings() -> None:
    cfg = launch()
    assert cfg.role is None and cfg.transport is Transport.TCP_STORE
    assert cfg.handle_type is HandleType.FABRIC and cfg.graceful_shutdown_timeout_s is None
    validate_launch(cfg)
    snake = LaunchConfig.model_validate(
        {"model": {"path": "/m"}, "graceful_shutdown_timeout_s": 45, "dwdp": {"dwdp_size": 2}}
    )
    camel = LaunchConfig.model_validate(
        {"model": {"path": "/m"}, "gracefulShutdownTimeoutSeconds": 45, "dwdp": {"dwdpSize": 2}}
    )
    assert snake == camel and snake.graceful_shutdown_timeout_s == 45


@pytest.mark.parametrize("value", [0, -1, 1.5, "45", True])
def test_graceful_timeout_positive_integer(value) -> None:
    with pytest.raises(ValidationError) as info:
        launch(gracefulShutdownTimeoutSeconds=value)
    (problem,) = problems_from_validation_error(info.value)
    assert problem.where == "gracefulShutdownTimeoutSeconds"


def test_modes() -> None:
    assert dense_mode(launch(**ATTACHED)) is DenseMode.ATTACHED
    assert dense_mode(launch(dwdp={"dwdpSize": 4})) is None
    # standalone (no expert DWDP) is no mode of this worker, and a limit names it
    assert dense_mode(launch(**STANDALONE)) is None
    assert dense_mode(launch(transport="mpi", **STANDALONE)) is None


def test_first_requirement_is_named() -> None:
    # breaks: standalone dense DWDP (a limit), then the copy mode on shm (a limit)
    cfg = launch(
        handleType="shm",
        dwdp={"enableExperts": False, "enableDense": True, "copyMode": "gather"},
    )
    problems = launch_problems(cfg)
    assert [p.where for p in problems] == ["dwdp.enableDense", "dwdp.copyMode"]
    assert all(NOT_SUPPORTED in p.rule for p in problems), problems
    first = launch_problem(cfg)
    assert first == problems[0]
    assert launch_message(cfg) == str(first) and launch_message(launch()) is None
    with pytest.raises(LaunchError) as info:
        validate_launch(cfg)
    text = str(info.value)
    assert text.startswith("launch refused: dwdp.enableDense:")
    assert "(got true)" in text
    assert f"enableDense without enableExperts (standalone dense DWDP) {NOT_SUPPORTED}" in text


def test_attached_dense_needs_a_group() -> None:
    """Dense DWDP with enableExperts runs attached, which needs dwdpSize > 1."""
    (problem,) = launch_problems(launch(dwdp={"enableDense": True}))
    assert problem.where == "dwdp.dwdpSize" and "runs attached" in problem.rule


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"dwdp": {"enableExperts": False, "enableDense": True}}, "dwdp.enableDense"),
        ({"handleType": "shm", "dwdp": {"dwdpSize": 2, "copyMode": "gather"}}, "dwdp.copyMode"),
        ({"dwdp": {"dwdpSize": 2}, "engine": {"cudaGraphs": True}}, "engine.cudaGraphs"),
    ],
)
def test_worker_limits_refuse_the_launch_first(fields, where) -> None:
    """What ``dwdp worker``/``dwdp launch`` check before the model loads."""
    with pytest.raises(LaunchError) as info:
        validate_launch(launch(role="context", **fields))
    assert info.value.problem.where == where
    assert NOT_SUPPORTED in str(info.value)


@pytest.mark.parametrize("path", sorted(DROPPED_FIELDS), ids=".".join)
def test_a_dropped_field_is_unknown_to_the_launch(path) -> None:
    """A launch config that writes a dropped field, at any value, is refused; the problem
    says why the field was dropped."""
    section, *leaf = path  # a section (written empty) or one field in it (at its old default)
    with pytest.raises(ValidationError) as info:
        launch(**{section: {name: 1 for name in leaf}})
    problems = problems_from_validation_error(info.value, model=LaunchConfig)
    shown = [str(p) for p in problems]
    assert [p.where for p in problems] == [".".join(path)], shown
    assert f"unknown field (dropped: {DROPPED_FIELDS[path]})" in shown[0]


def test_cuda_graphs_launch_rules() -> None:
    """``engine.cudaGraphs``: unset by default; true or false without DWDP, and false with
    it, pass; true with DWDP on is refused naming the field, the value and why."""
    assert launch().engine.cuda_graphs is None
    validate_launch(launch(role="generation", engine={"cudaGraphs": True}))
    validate_launch(launch(role="context", engine={"cudaGraphs": True}))
    validate_launch(launch(role="context", dwdp={"dwdpSize": 4}, engine={"cudaGraphs": False}))
    problem = launch_problem(launch(role="context", dwdp={"dwdpSize": 4},
                                    engine={"cudaGraphs": True}))
    assert str(problem) == (
        "engine.cudaGraphs: engine.cudaGraphs true with DWDP on is not supported by this "
        "worker: the prefetch schedule runs host hooks around every MoE layer, which a CUDA "
        "graph cannot replay; leave it unset or false (got true)"
    )


def _refusal(engine: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        launch(role="generation", engine=engine)
    return [str(p) for p in problems_from_validation_error(info.value, model=LaunchConfig)]


@pytest.mark.parametrize(
    ("given", "resolved"),
    [({}, (5, 5)), ({"promptLookupMax": 3}, (3, 3)), ({"promptLookupMin": 7}, (7, 7)),
     ({"promptLookupMin": 2, "promptLookupMax": 4}, (2, 4)),
     ({"promptLookupMin": 64, "promptLookupMax": 64}, (64, 64))],
)
def test_speculative_lookup_resolves_as_vllm(given, resolved) -> None:
    """``engine.speculative``: off by default; ngram unless told; the suffix lengths by
    vLLM's rules (both unset: 5 and 5; one set: the other takes its value)."""
    assert launch().engine.speculative is None
    spec = launch(engine={"speculative": {"numSpeculativeTokens": 3, **given}}).engine.speculative
    assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert spec.lookup_range() == resolved


def test_speculative_lookup_min_above_max_names_both() -> None:
    shown = _refusal({"speculative": {"numSpeculativeTokens": 3, "promptLookupMin": 6,
                                      "promptLookupMax": 4}})
    assert shown == [
        "engine.speculative.promptLookupMin: must be at most promptLookupMax (4): the drafter "
        "looks up suffixes from promptLookupMax down to promptLookupMin tokens long (got 6)"
    ]


@pytest.mark.parametrize(
    ("speculative", "line"),
    [
        ({}, "engine.speculative.numSpeculativeTokens: is required"),
        ({"numSpeculativeTokens": 0},
         "engine.speculative.numSpeculativeTokens: must be greater than or equal to 1 (got 0)"),
        ({"numSpeculativeTokens": 17},
         "engine.speculative.numSpeculativeTokens: must be less than or equal to 16 (got 17)"),
        ({"numSpeculativeTokens": "3"},
         'engine.speculative.numSpeculativeTokens: must be a whole number (got "3")'),
        ({"numSpeculativeTokens": 2, "promptLookupMax": 65},
         "engine.speculative.promptLookupMax: must be less than or equal to 64 (got 65)"),
        ({"numSpeculativeTokens": 2, "promptLookupMin": 0},
         "engine.speculative.promptLookupMin: must be greater than or equal to 1 (got 0)"),
        ({"method": "eagle", "numSpeculativeTokens": 1},
         "engine.speculative.method: must be 'ngram' or 'mtp' (got \"eagle\")"),
    ],
)
def test_speculative_out_of_range_is_one_line(speculative, line) -> None:
    assert _refusal({"speculative": speculative}) == [line]


def test_speculative_on_a_context_rank_with_dwdp() -> None:
    """A context server decodes every request it is sent whole (without generation servers,
    or through the client Service), so speculation is accepted there, DWDP on or not."""
    cfg = launch(role="context", dwdp={"dwdpSize": 4},
                 engine={"speculative": {"numSpeculativeTokens": 2}})
    validate_launch(cfg)


def test_launch_may_use_mpi() -> None:
    """A launch config may name the MPI transport (a rank started under mpirun); only a
    DwdpDeployment, whose pods start ranks with ``dwdp launch``, refuses it."""
    validate_launch(launch(transport="mpi", dwdp={"dwdpSize": 4}))
    validate_launch(launch(handleType="shm", dwdp={"dwdpSize": 4, "copyMode": "batched"}))


def test_generation_refuses_dense_first() -> None:
    cfg = launch(role="generation", **ATTACHED)
    problem = launch_problem(cfg)
    assert problem is not None and problem.where == "dwdp.enableDense"
    assert "generation server refuses" in problem.rule
    validate_launch(launch(role="context", **ATTACHED))


def test_dense_roots_checked_on_the_host_only() -> None:
    cfg = launch(**ATTACHED, model={"path": "/m", "architecture": "MixtralForCausalLM"})
    validate_launch(cfg)  # unknown at build time
    validate_launch(cfg, dense_roots=True)
    with pytest.raises(LaunchError) as info:
        validate_launch(cfg, dense_roots=False)
    assert "MixtralForCausalLM declares no dense roots" in str(info.value)
    validate_launch(launch(dwdp={"dwdpSize": 4}), dense_roots=False)  # dense off: fine


@pytest.mark.parametrize(
    ("text", "role"),
    [
        ("context", Role.CONTEXT),
        ("CONTEXT", Role.CONTEXT),
        ("ctx0", Role.CONTEXT),
        ("CTX0", Role.CONTEXT),
        ("Gen0", Role.GENERATION),
        ("ctx1", Role.CONTEXT),
        ("CTX12", Role.CONTEXT),
        ("gen3", Role.GENERATION),
        (" Gen07 ", Role.GENERATION),
        ("generation", Role.GENERATION),
        (" aggregated ", Role.AGGREGATED),
    ],
)
def test_parse_role(text, role) -> None:
    assert parse_role(text) is role


@pytest.mark.parametrize("text", ["prefill", "ctx", "gen", "ctx-1", "ctx 1", "gen1a", "context0"])
def test_parse_role_unknown_names_the_accepted(text) -> None:
    with pytest.raises(ValueError, match=r"ctx<N>, gen<N> \(N: digits, as in ctx0\)"):
        parse_role(text)


def test_resolve_role_prefers_the_launch() -> None:
    assert resolve_role(Role.CONTEXT, {"DWDP_ROLE": "gen0"}) is Role.CONTEXT
    assert resolve_role("gen0", {}) is Role.GENERATION
    assert resolve_role(None, {"DWDP_ROLE": "CTX0"}) is Role.CONTEXT
    assert resolve_role(None, {"DWDP_ROLE": "gen3"}) is Role.GENERATION
    assert resolve_role(None, {"DWDP_ROLE": ""}) is None
    assert resolve_role(None, {}) is None


@pytest.mark.parametrize("flag", ["  ", None])
def test_a_blank_role_is_refused_from_the_flag_and_the_environment(flag) -> None:
    """Blanks are no role in either place: refused alike (an empty variable is unset)."""
    with pytest.raises(ValueError, match="unknown role"):
        resolve_role(flag, {"DWDP_ROLE": "  "} if flag is None else {})


def test_warning_without_a_context_role() -> None:
    assert launch_warnings(launch(role="context", **ATTACHED)) == []
    (warning,) = launch_warnings(launch(**ATTACHED))
    assert "role is unset" in warning
    (warning,) = launch_warnings(launch(**ATTACHED), Role.AGGREGATED)
    assert "aggregated" in warning
    assert launch_warnings(launch(dwdp={"dwdpSize": 4})) == []


def test_launch_config_rendered_from_a_deployment() -> None:
    dep = parse_deployment(
        {
            "apiVersion": "dwdp.io/v1alpha1",
            "kind": "DwdpDeployment",
            "metadata": {"name": "demo"},
            "spec": {
                "model": {"path": "/models/m", "architecture": "Qwen3MoeForCausalLM"},
                "image": "img",
                "gracefulShutdownTimeoutSeconds": 45,
                "server": {"port": 9000},
                "context": {
                    "dwdp": {"dwdpSize": 4, "enableDense": True},
                    "maxNumTokens": 4096,
                    "engine": {"cudaGraphs": False},
                },
                "generation": {"replicas": 1, "maxBatchSize": 16, "engine": {"cudaGraphs": True}},
            },
        }
    )
    ctx = launch_config_for(dep.spec, Role.CONTEXT)
    assert ctx.role is Role.CONTEXT and ctx.dwdp.enable_dense and ctx.max_num_tokens == 4096
    assert ctx.graceful_shutdown_timeout_s == 45 and ctx.server_port == 9000
    assert ctx.model.architecture == "Qwen3MoeForCausalLM"
    validate_launch(ctx)
    gen = launch_config_for(dep.spec, Role.GENERATION)
    assert gen.role is Role.GENERATION and gen.dwdp == DwdpConfig()
    assert gen.max_batch_size == 16
    assert ctx.engine.cuda_graphs is False and gen.engine.cuda_graphs is True  # per section
    validate_launch(gen)
    # The rendered launch round-trips through its YAML view (the worker's config file).
    again = LaunchConfig.model_validate(ctx.to_yaml_dict())
    assert again == ctx
    with pytest.raises(ValueError):
        launch_config_for(dep.spec, Role.AGGREGATED)


def test_vllm_side_channel_settings() -> None:
    cfg = launch(role="context", kvTransfer={"vllm": {}})
    vllm = cfg.kv_transfer.vllm
    assert (vllm.version, vllm.side_channel_port, vllm.model) == ("0.32.0", 5600, None)
    assert vllm.hybrid_kv_cache_manager is True
    validate_launch(cfg)
    with pytest.raises(ValidationError) as err:
        launch(kvTransfer={"vllm": {"version": "0.33.0"}})
    [problem] = problems_from_validation_error(err.value)
    assert problem.where == "kvTransfer.vllm.version" and problem.value == "0.33.0"
    assert "vLLM 0.32.0 is the one spoken" in problem.rule


def test_the_vllm_amx_layout_needs_a_bfloat16_model() -> None:
    cfg = launch(role="context", kvTransfer={"vllm": {}})
    assert cfg.kv_transfer.vllm.cpu_attention_kernel == "auto"
    for dtype in ("auto", "bfloat16"):
        validate_launch(launch(role="context", model={"path": "/m", "dtype": dtype},
                               kvTransfer={"vllm": {"cpuAttentionKernel": "amx"}}))
    cfg = launch(role="context", model={"path": "/m", "dtype": "float32"},
                 kvTransfer={"vllm": {"cpuAttentionKernel": "amx"}})
    problem = launch_problem(cfg)
    assert problem is not None and problem.where == "kvTransfer.vllm.cpuAttentionKernel"
    assert "bfloat16 only and model.dtype is float32" in problem.rule
    with pytest.raises(ValidationError):
        launch(kvTransfer={"vllm": {"cpuAttentionKernel": "avx512"}})


def test_the_vllm_tier_on_both_disaggregated_roles_and_not_aggregated() -> None:
    # a generation server reads from vLLM prefill servers (the prefill servers' --model)
    gen = launch(role="generation", kvTransfer={"vllm": {"model": "Qwen/Qwen3-30B-A3B"}})
    assert launch_problem(gen) is None
    validate_launch(gen)
    assert gen.kv_transfer.vllm.model == "Qwen/Qwen3-30B-A3B"
    cfg = launch(role="aggregated", kvTransfer={"vllm": {"sideChannelPort": 5601}})
    problem = launch_problem(cfg)
    assert problem is not None and problem.where == "kvTransfer.vllm"
    assert "an aggregated server prefills and decodes itself and moves none" in problem.rule


def _dwdp_validate_launch(tmp_path, doc) -> subprocess.CompletedProcess[str]:
    """``dwdp validate --launch -f FILE`` as a user runs the console script."""
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(doc))
    dwdp = Path(sys.executable).with_name("dwdp")
    return subprocess.run([str(dwdp), "validate", "--launch", "-f", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_dwdp_validate_refuses_another_vllm_version_in_a_launch_file(tmp_path) -> None:
    """A launch file whose kvTransfer.vllm.version is not spoken: exit 1, one line naming the
    field, the rule and the value; an aggregated server's kvTransfer.vllm likewise (a launch
    rule, past the fields); the same file with the version spoken is valid."""
    doc = {"role": "context", "model": {"path": "/models/m"},
           "kvTransfer": {"vllm": {"version": "0.33.0"}}}
    proc = _dwdp_validate_launch(tmp_path, doc)
    assert proc.returncode == 1, proc.stdout
    path = tmp_path / "launch.yaml"
    assert proc.stderr.splitlines() == [
        f'{path}: kvTransfer.vllm.version: the NIXL connector of vLLM 0.32.0 is the one '
        'spoken; other versions are refused (got "0.33.0")']
    proc = _dwdp_validate_launch(tmp_path, {**doc, "role": "aggregated",
                                            "kvTransfer": {"vllm": {}}})
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"{path}: kvTransfer.vllm: vLLM's NIXL connector moves KV ")
    proc = _dwdp_validate_launch(tmp_path, {**doc, "kvTransfer": {"vllm": {"version": "0.32.0"}}})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{path}: launch config of /models/m is valid\n"


def test_dwdp_validate_launch_given_a_deployment_says_so_in_one_line(tmp_path) -> None:
    """A DwdpDeployment given to ``--launch`` gets one line that names the mix-up, not one per
    deployment field a launch config does not know."""
    doc = {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpDeployment",
           "metadata": {"name": "m"}, "spec": {"model": {"path": "/models/m"}}}
    proc = _dwdp_validate_launch(tmp_path, doc)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f'{tmp_path / "launch.yaml"}: kind: is a DwdpDeployment, not a worker launch config: '
        'validate it without --launch (got "DwdpDeployment")']


@pytest.mark.parametrize("path", ["relative/dir", "/models/../etc", ""])
def test_the_checkpoint_path_must_be_absolute(path) -> None:
    """A relative checkpoint path would be resolved against the worker's working directory:
    ``validate --launch`` refuses it, naming ``model.path``, before any worker starts."""
    with pytest.raises(ValidationError) as info:
        LaunchConfig.model_validate({"model": {"path": path}})
    (problem,) = problems_from_validation_error(info.value)
    assert problem.where == "model.path" and "absolute path" in problem.rule

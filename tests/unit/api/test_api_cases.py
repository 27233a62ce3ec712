"""One case table, three validators, one verdict per case.

Every case of tests/cases/deployments.yaml goes through (a) the pydantic models, (b) the
generated CRD checked offline (schema, defaults and every CEL rule with cel-python) and
(c) ``dwdp validate -f`` as a subprocess. Each must accept exactly the valid cases and, for
an invalid one, name the case's field. The committed CRD must equal the generator's output.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import caselib
import pytest
import yaml

from dwdp.api.crd import committed_crd_path, crd_manifest, crd_yaml
from dwdp.api.deployment import deployment_problems
from dwdp.api.dropped import DROPPED_FIELDS, UNKNOWN_FIELD
from dwdp.api.support import NOT_SUPPORTED, WORKER_LIMITS, Scope

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DWDP = Path(sys.executable).with_name("dwdp")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


offline = _load("dwdp_offline_apiserver", HERE / "offline_apiserver.py")

CASES = caselib.load_cases()
IDS = [case.name for case in CASES]


def test_table_is_large_and_balanced() -> None:
    assert len(CASES) >= 60
    assert sum(case.valid for case in CASES) >= 20
    assert sum(not case.valid for case in CASES) >= 40


SECTIONS = ((Scope.CONTEXT, "spec.context"),)


@pytest.mark.parametrize(
    ("limit", "section"),
    [
        (limit, section)
        for limit in WORKER_LIMITS
        for scope, section in SECTIONS
        if scope in limit.scopes
    ],
    ids=lambda v: v if isinstance(v, str) else ".".join(v.path),
)
def test_every_worker_limit_has_a_refused_case(limit, section) -> None:
    """Each setting this worker does not run is a row of the table, in each section it
    applies to, whose message (checked against every validator) is the limit's own."""
    field = ".".join((section, *limit.path))
    rows = [c for c in CASES if not c.valid and c.field == field and c.message]
    assert rows, f"no refused case names {field}"
    head = f"{limit.setting} {NOT_SUPPORTED}"
    assert any(c.message.startswith(head) for c in rows), [c.message for c in rows]


@pytest.mark.parametrize("section", ["spec.context", "spec.generation"])
@pytest.mark.parametrize("dropped", sorted({path[0] for path in DROPPED_FIELDS}))
def test_every_dropped_section_has_a_refused_case(dropped, section) -> None:
    """Each dropped section (``parallel``), and each kept section holding dropped fields
    (``engine``), is a row of the table in each serving section that names it or one of its
    dropped fields, refused by every validator as an unknown field."""
    field = f"{section}.{dropped}"
    names = {field} | {".".join((section, *path)) for path in DROPPED_FIELDS}
    rows = [c for c in CASES if not c.valid and c.field in names and c.field.startswith(field)]
    assert rows, f"no refused case names {field} or a dropped field in it"
    assert all(c.message == UNKNOWN_FIELD for c in rows), [c.message for c in rows]


def test_committed_crd_matches_generator() -> None:
    path = committed_crd_path(REPO)
    assert path.exists(), f"{path} is missing: run `dwdp crd -o {path}`"
    assert path.read_text() == crd_yaml(), f"{path} is stale: run `dwdp crd -o {path}`"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pydantic_models(case) -> None:
    problems = deployment_problems(case.document)
    text = "\n".join(str(p) for p in problems)
    assert (not problems) == case.valid, f"{case.name} ({case.rule}): {text or 'accepted'}"
    if not case.valid:
        assert case.verdict_in(text), f"{case.name}: {case.field} or message not in: {text}"


@pytest.fixture(scope="module")
def apiserver():
    return offline.OfflineApiserver(crd_manifest())


def test_crd_defaults_pass_their_own_rules(apiserver) -> None:
    """The apiserver refuses a CRD whose ``default: {}`` breaks a CEL rule (a rule that reads
    a field the nested defaults would only fill later); every rule must tolerate it."""
    assert apiserver.default_errors() == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_crd_schema_and_cel_offline(case, apiserver) -> None:
    errors = apiserver.errors(case.document)
    text = "\n".join(errors)
    assert (not errors) == case.valid, f"{case.name} ({case.rule}): {text or 'accepted'}"
    if not case.valid:
        assert case.verdict_in(text), f"{case.name}: {case.field} or message not in: {text}"


# Runs ``dwdp.cli:main`` (what the ``dwdp`` console script calls) once per case in a forked
# child of one warm interpreter: every case gets its own process and exit status without
# paying the interpreter start and model build 100 times over. The console script itself
# is run as a plain subprocess by test_console_script_exit_codes.
_FORK_DRIVER = """
import os, sys
from dwdp.cli import main
import dwdp.api.deployment  # build the models once, before forking
from dwdp.cli import build_parser
build_parser()  # import every sub-command module once, too
import yaml  # noqa: F401  (the validate command loads it lazily)

for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(path + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        try:
            code = main(["validate", "-f", path])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(path + ".rc", "w") as fh:
        fh.write(str(os.waitstatus_to_exitcode(status)))
"""


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """``dwdp validate -f`` on every case, each in its own process."""
    folder = tmp_path_factory.mktemp("cases")
    paths = []
    for case in CASES:
        path = folder / f"{case.name}.yaml"
        path.write_text(yaml.safe_dump(case.document, sort_keys=False))
        paths.append(path)
    driver = subprocess.run(
        [sys.executable, "-c", _FORK_DRIVER, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert driver.returncode == 0, driver.stderr
    results = {}
    for case, path in zip(CASES, paths, strict=True):
        read = lambda suffix, p=path: Path(str(p) + suffix).read_text()  # noqa: E731
        results[case.name] = subprocess.CompletedProcess(
            ["dwdp", "validate", "-f", str(path)], int(read(".rc")), read(".out"), read(".err")
        )
    return results


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dwdp_validate_cli(case, cli_results) -> None:
    proc = cli_results[case.name]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == (0 if case.valid else 1), f"{case.name} ({case.rule}): {out}"
    if case.valid:
        assert "is valid" in proc.stdout
    else:
        assert case.verdict_in(proc.stderr), f"{case.name}: {case.field} or message not in {out}"
        assert all(line.count(": ") >= 2 for line in proc.stderr.splitlines()), out


def _console(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DWDP), *args], capture_output=True, text=True, input=input, timeout=120, check=False
    )


def test_console_script_exit_codes(tmp_path) -> None:
    """The installed ``dwdp`` script: 0 for valid, 1 and one line per problem otherwise."""
    valid = next(case for case in CASES if case.valid)
    invalid = [case for case in CASES if not case.valid][:3]
    path = tmp_path / "valid.yaml"
    path.write_text(yaml.safe_dump(valid.document))
    proc = _console("validate", "-f", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "is valid" in proc.stdout

    multi = yaml.safe_dump_all([case.document for case in invalid])
    proc = _console("validate", "-f", "-", input=multi)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) >= len(invalid)
    for index, case in enumerate(invalid, start=1):
        mine = "\n".join(line for line in lines if f"(document {index})" in line)
        assert case.verdict_in(mine), (case.name, proc.stderr)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot read"),
        ("spec: [unclosed\n", "invalid YAML at line"),
        ("", "no YAML document"),
        ("- a\n- b\n", "must be a mapping"),
        ("!!python/object:os.system {}\n", "invalid YAML"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ],
)
def test_validate_user_errors_are_one_line(tmp_path, content, needle) -> None:
    path = tmp_path / "in.yaml"
    if content is not None:
        path.write_text(content)
    proc = _console("validate", "-f", str(path))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

"""The rank contract (``dwdp.api.contract``): the real worker and the test rank program speak
the same words, and the operator reads only those.

The words each side can emit are derived from its code: the worker's status sources and its
``phased`` termination lines (every stage ``run_worker`` passes through, every setup phase a
``SetupError`` can name), and the rank program's walk, run in-process, failing at each step.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import dwdp.worker
from dwdp.api import contract
from dwdp.api.contract import TERMINATION_WORDS, Env, Stage, StatusPhase
from dwdp.operator.group.failure import classify_failure
from dwdp.operator.observe import rank_report_from_json
from dwdp.worker.launcher import launcher_line
from dwdp.worker.main import phased
from dwdp.worker.server.status import with_identity
from dwdp.worker.setup.phases import DensePhase, ExpertPhase, SetupError
from dwdp.worker.status_source import NoDwdp
from dwdp.worker.transport.base import RendezvousTimeout
from dwdp_dev.operator import rankprog


def _head(line: str) -> str:
    return line.split(":", 1)[0]


def _resolve(node: ast.expr, names: dict[str, object]) -> str | None:
    """The string a constant or a fixed name (``X``, ``X.Y.value``) stands for, None for
    anything else (a local name such as ``self.phase`` or an argument)."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    try:
        value = eval(compile(ast.Expression(node), "<contract>", "eval"), dict(names))
    except Exception:
        return None
    return str(value) if isinstance(value, str) else None


def _worker_sources() -> list[ast.Module]:
    """Every module of the worker package, parsed (not imported: no torch needed)."""
    root = Path(dwdp.worker.__path__[0])
    return [ast.parse(path.read_text()) for path in sorted(root.rglob("*.py"))]


def _fixed_names(trees: list[ast.Module]) -> dict[str, object]:
    """Module-level ``NAME = <word>`` of the worker (constants or contract members),
    with the contract's names to resolve them."""
    names: dict[str, object] = dict(vars(contract))
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and (word := _resolve(node.value, names)):
                    names[target.id] = word
    return names


def _worker_status_words() -> set[str]:
    """Every fixed ``phase`` a worker status source writes (``x.phase = W``,
    ``{"phase": W}``, ``out["phase"] = W``), plus the answers of the real status helpers."""
    words = {NoDwdp().status()["phase"], with_identity({}, None, "boom")["phase"]}
    trees = _worker_sources()
    names = _fixed_names(trees)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    named = (isinstance(target, ast.Attribute) and target.attr == "phase") or (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.slice, ast.Constant)
                        and target.slice.value == "phase"
                    )
                    if named and (word := _resolve(node.value, names)) is not None:
                        words.add(word)
            elif isinstance(node, ast.Call):  # RankStatus.build(phase=W, ...)
                for kw in node.keywords:
                    if kw.arg == "phase" and (word := _resolve(kw.value, names)) is not None:
                        words.add(word)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    word = _resolve(value, names)
                    if isinstance(key, ast.Constant) and key.value == "phase" and word is not None:
                        words.add(word)
    return words


def _worker_termination_words() -> set[str]:
    """The first word of every termination line ``run_worker`` can write: each stage it
    enters (``stage["now"] = S``, ``{"now": S}``, ``phased(S, ...)``), each setup phase a
    ``SetupError`` names, a rendezvous timeout; the launcher keeps the child's word."""
    import dwdp.worker.main as main

    stages: set[str | None] = set()
    for node in ast.walk(ast.parse(inspect.getsource(main))):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "stage"
            for t in node.targets
        ):
            stages.add(_resolve(node.value, vars(main)))
        elif isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value == "now" for k in node.keys
        ):
            stages |= {_resolve(v, vars(main)) for v in node.values}
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "phased":
            stages.add(_resolve(node.args[0], vars(main)))
    stages.discard(None)  # ``phased(stage["now"], exc)``: one of the stages found
    assert len(stages) >= 5, stages  # the scan found run_worker's stages
    lines = [phased(s, RuntimeError("x")) for s in stages if s is not None]
    lines += [
        phased(Stage.SETUP, SetupError(p.value, "what", {0: "x"}, restored=True))
        for p in (*DensePhase, *ExpertPhase)
    ]
    lines.append(phased(Stage.SETUP, RendezvousTimeout("late", missing=(1,))))
    lines = [launcher_line(0, 0, 1, line) for line in lines]
    return {_head(line) for line in lines}


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch):
    """A rank program's rendezvous store on a free port, with the environment of one rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = rankprog._Store(("127.0.0.1", port))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for key in ("RANKPROG_FAIL_PHASE", "RANKPROG_FAIL_RANK", "RANKPROG_COMMIT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(Env.RENDEZVOUS, f"127.0.0.1:{port}")
    monkeypatch.setenv(Env.WORLD_SIZE, "1")
    monkeypatch.setenv("RANKPROG_PHASE_S", "0")
    yield server
    server.shutdown()
    server.server_close()


def _rankprog_words(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[set, set]:
    """(status words, termination words) of the rank program: its walk run in-process, then
    a failure at each step it walked, then a config it cannot read (a real process)."""
    rank = rankprog.Rank(0)
    assert rank.status() is None  # no answer before the commit, as the worker
    rank.run()
    assert rank.walked == list(rankprog.STEPS)
    status = {rank.status()["phase"]}
    termination: set[str] = set()
    for inc, step in enumerate(rank.walked, start=1):
        monkeypatch.setenv("RANKPROG_FAIL_PHASE", step)
        monkeypatch.setenv(Env.INCARNATION, str(inc))  # a fresh rendezvous namespace
        with pytest.raises(rankprog.Fail) as failed:
            rankprog.Rank(0).run()
        assert failed.value.phase == step
        termination.add(_head(str(failed.value)))
    monkeypatch.delenv("RANKPROG_FAIL_PHASE")
    term = tmp_path / "term"
    bad = tmp_path / "bad.yaml"
    bad.write_text("role: [not, a, role]\n")
    env = {Env.CONFIG.value: str(bad), Env.TERMINATION_LOG.value: str(term)}
    proc = subprocess.run(
        [sys.executable, "-m", "dwdp_dev.operator.rankprog"],
        env={**os.environ, **env},
        timeout=60,
        capture_output=True,
    )
    assert proc.returncode == 1
    termination.add(_head(term.read_text()))
    return status, termination


def test_worker_and_rank_program_speak_the_contract(
    store: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    worker_status = _worker_status_words()
    worker_termination = _worker_termination_words()
    prog_status, prog_termination = _rankprog_words(monkeypatch, tmp_path)
    contract_status = {p.value for p in StatusPhase}
    assert worker_status <= contract_status, worker_status - contract_status
    assert worker_termination <= TERMINATION_WORDS, worker_termination - TERMINATION_WORDS
    # The rank program says nothing the real worker cannot say.
    assert prog_status <= worker_status, prog_status - worker_status
    assert prog_termination <= worker_termination, prog_termination - worker_termination
    assert {"rendezvous", "P3", "commit", "serve", "config"} <= prog_termination
    # The operator reads every status word of the worker and classifies every termination
    # word as the failure of a named stage (none falls through to the unnamed "exit").
    for word in worker_status:
        assert rank_report_from_json({"phase": word}) is not None, word
    for word in worker_termination:
        phase, _ = classify_failure(
            message=f"{word}: x",
            exit_code=1,
            terminated_reason=None,
            rank_phase=None,
            was_serving=False,
        )
        assert phase == word


def test_operator_reads_no_word_outside_the_contract() -> None:
    for word in ("rendezvous", "P3", "init", "serving", "aborted", "error", "starting"):
        assert rank_report_from_json({"phase": word}) is None, word


def test_the_operator_reads_what_the_worker_writes() -> None:
    """A round trip through ``RankStatus``: the worker's real status code (a status source,
    its identity, a dead engine's failure) read by the operator's parser."""
    from dwdp.worker.server.status import rank_identity

    env = {"DWDP_GROUP": "demo-g0", "DWDP_INCARNATION": "i3", "DWDP_REVISION": "rv1"}
    body = with_identity(NoDwdp().status(), rank_identity(env))
    report = rank_report_from_json(json.loads(json.dumps(body)))
    assert report is not None and report.committed and not report.failed
    assert (report.rank, report.incarnation, report.revision) == (0, 3, "rv1")
    assert report.start_id == body["start_id"] and report.layout_digest is None
    failed = rank_report_from_json(with_identity(NoDwdp().status(), None, "RuntimeError: boom"))
    assert failed is not None and failed.failed
    # an odd field reads as unknown, the rest still counts; extra fields are ignored
    odd = rank_report_from_json({**body, "rank": "0", "revision": 7, "new_counter": 1})
    assert odd is not None and odd.rank is None and odd.revision is None and odd.incarnation == 3

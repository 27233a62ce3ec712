"""The imports between dwdp's packages form no cycle and keep their allowed directions.

Read from the sources with ``ast`` (nothing is imported): every ``import`` and ``from ...
import`` of every module under src/dwdp counts, at module level, inside a function or under
``TYPE_CHECKING`` alike. For each package, its sub-packages (folders with an ``__init__.py``)
are the nodes of one graph: sub-package A depends on its sibling B when a module anywhere
under A imports a module under B. A package's own modules (``dwdp/worker/settings.py``) are
not nodes: they belong to the package that holds them.

Rules:
- no cycle among the sub-packages of any package (``dwdp``: api, operator, worker, kernels;
  ``dwdp.worker``: backend, dense, setup, engine, loading, ...);
- ``dwdp.api`` (the contract both sides read) imports neither ``dwdp.worker``,
  ``dwdp.operator`` nor ``dwdp.kernels``;
- ``dwdp.operator`` (the kopf controller's image has no torch) imports neither
  ``dwdp.worker`` nor torch;
- nothing in src/dwdp imports ``dwdp_dev`` (the development distribution is not shipped).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("dwdp.api", "dwdp.worker", "the API is the contract; the worker depends on it"),
    ("dwdp.api", "dwdp.operator", "the API is the contract; the operator depends on it"),
    ("dwdp.api", "dwdp.kernels", "the API is the contract; the kernels do not belong in it"),
    ("dwdp.operator", "dwdp.worker", "the operator never runs the worker's code"),
    ("dwdp.operator", "torch", "the operator's image has no torch"),
    ("dwdp", "dwdp_dev", "the development distribution is not shipped with the product"),
)
"""(importer prefix, imported prefix, why): a module named by the first (or under it) must
not import the second (or anything under it)."""


def module_name(path: Path, src: Path) -> str:
    """``src/dwdp/worker/engine/base.py`` -> ``dwdp.worker.engine.base``; a package's
    ``__init__.py`` -> the package."""
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(src: Path) -> dict[str, Path]:
    """Every module under ``src/dwdp``, by dotted name."""
    return {module_name(p, src): p for p in sorted((src / "dwdp").rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The dotted names module ``name`` imports. ``from P import n`` yields ``P.n`` when that
    is a module of ``known``, else ``P``; relative imports are resolved against ``name``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in known else base


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def edges(src: Path) -> dict[str, dict[str, set[str]]]:
    """``{package: {"A -> B": {"importer -> imported", ...}}}``: the dependencies between
    sibling sub-packages of each package, with the imports that make each one."""
    mods = modules(src)
    known = set(mods)
    packages = {n for n, p in mods.items() if p.name == "__init__.py"}
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in mods.items():
        for target in imports(name, path, known):
            if not under(target, "dwdp"):
                continue
            common = _common_package(name, target, packages)
            if common is None:
                continue
            a, b = (_child(common, x, packages) for x in (name, target))
            if a is not None and b is not None and a != b:
                graph.setdefault(common, {}).setdefault(f"{a} -> {b}", set()).add(
                    f"{name} -> {target}"
                )
    return graph


def _common_package(a: str, b: str, packages: set[str]) -> str | None:
    parts_a, parts_b = a.split("."), b.split(".")
    common: list[str] = []
    for x, y in zip(parts_a, parts_b, strict=False):
        if x != y:
            break
        common.append(x)
    while common and ".".join(common) not in packages:
        common.pop()
    return ".".join(common) or None


def _child(package: str, name: str, packages: set[str]) -> str | None:
    """The sub-package of ``package`` that holds ``name`` (None: a module of ``package``)."""
    rest = name[len(package) + 1 :].split(".") if name != package else []
    child = f"{package}.{rest[0]}" if rest else None
    return child if child in packages else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_report(src: Path) -> list[str]:
    """One line per cycle among sibling sub-packages, naming the imports that close it."""
    lines = []
    for _, deps in sorted(edges(src).items()):
        graph: dict[str, set[str]] = {}
        for dep in deps:
            a, b = dep.split(" -> ")
            graph.setdefault(a, set()).add(b)
        for component in cycles(graph):
            members = set(component)
            why = sorted(
                imp
                for dep, imps in deps.items()
                if set(dep.split(" -> ")) <= members
                for imp in imps
            )
            lines.append(f"{' <-> '.join(component)}: {'; '.join(why)}")
    return lines


def forbidden_report(src: Path) -> list[str]:
    """One line per import that breaks a rule of :data:`FORBIDDEN`."""
    mods = modules(src)
    known = set(mods)
    lines = []
    for name, path in mods.items():
        for target in imports(name, path, known):
            for importer, imported, why in FORBIDDEN:
                if under(name, importer) and under(target, imported):
                    lines.append(f"{name} imports {target} ({why})")
    return sorted(set(lines))


def test_no_cycle_among_sub_packages() -> None:
    assert cycle_report(SRC) == []


def test_no_forbidden_direction() -> None:
    assert forbidden_report(SRC) == []


def test_the_graph_sees_the_worker_sub_packages() -> None:
    """The check reads what it claims: the worker's engine depends on its GPU path (paged
    attention picks the SDPA kernels there) and the load vote on the setup's vote."""
    worker = edges(SRC)["dwdp.worker"]
    assert "dwdp.worker.engine -> dwdp.worker.gpu" in worker
    assert "dwdp.worker.loading -> dwdp.worker.setup" in worker


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_and_a_forbidden_import_are_reported(tmp_path: Path) -> None:
    """A lazy import inside a function closes a cycle as much as a top-level one; a relative
    import is resolved; an operator module importing torch breaks a rule."""
    src = _tree(
        tmp_path,
        {
            "dwdp/__init__.py": "",
            "dwdp/worker/__init__.py": "",
            "dwdp/worker/settings.py": "",
            "dwdp/worker/dense/__init__.py": "",
            "dwdp/worker/dense/state.py": "from dwdp.worker.setup.status import X\n",
            "dwdp/worker/setup/__init__.py": "",
            "dwdp/worker/setup/status.py": "X = 1\n",
            "dwdp/worker/setup/dense.py": "def f():\n    from ..dense import state\n",
            "dwdp/operator/__init__.py": "import torch\nfrom dwdp.worker import settings\n",
        },
    )
    assert cycle_report(src) == [
        "dwdp.worker.dense <-> dwdp.worker.setup: "
        "dwdp.worker.dense.state -> dwdp.worker.setup.status; "
        "dwdp.worker.setup.dense -> dwdp.worker.dense.state"
    ]
    assert forbidden_report(src) == [
        "dwdp.operator imports dwdp.worker.settings (the operator never runs the worker's code)",
        "dwdp.operator imports torch (the operator's image has no torch)",
    ]

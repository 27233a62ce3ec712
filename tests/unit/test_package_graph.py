"""The imports of dwdp and of dwdp_dev form no cycle and keep their allowed directions.

Read from the sources with ``ast`` (nothing is imported). An import is every ``import`` and
``from ... import`` of a module, at module level, inside a function or under
``TYPE_CHECKING`` alike: a lazy import hides a cycle from the interpreter, not from the
design, and a type named across modules is a dependency as much as a call (a cycle through
one is broken by moving the type down, never by hiding the import). ``dwdp.cli`` imports
the modules its ``COMMAND_MODULES`` names through importlib: a module-level
``COMMAND_MODULES`` tuple of module names counts as imports of them.

Two graphs are read:

- the **module graph** of each tree (src/dwdp, tools/dwdp_dev): a node per module (a package's
  ``__init__.py`` is the package's node), an edge from A to B when A imports B (an imported
  name that is no module lands on the module that defines it; modules outside the tree are
  left out, and so is the implicit run of the parents' ``__init__`` that an import of
  ``a.b.c`` makes: it is the interpreter's, not the importer's, dependency);
- the **sub-package graph** of each package: its sub-packages (folders with an
  ``__init__.py``) are the nodes, and A depends on its sibling B when a module anywhere
  under A imports a module under B.

Rules (docs/design.md §2.4):
- no cycle in the module graph of src/dwdp nor of tools/dwdp_dev;
- no cycle among the sub-packages of any package (``dwdp``: api, operator, worker, kernels;
  ``dwdp.worker``: backend, dense, setup, engine, loading, ...);
- no upward arrow: a package's own modules (the files in its folder, its ``__init__``
  included) may be imported from its sub-packages (``dwdp.worker.server.app`` imports
  ``dwdp.worker.status_source``), but no own module of a package P that a sub-package S of P
  depends on (a module under S imports it, directly or through other modules) imports a
  module under S; checked for every package of both trees;
- ``dwdp.api`` (the contract both sides read) imports neither ``dwdp.worker``,
  ``dwdp.operator`` nor ``dwdp.kernels``;
- ``dwdp.operator`` (the kopf controller's image has no torch) imports neither
  ``dwdp.worker`` nor torch;
- nothing in src/dwdp imports ``dwdp_dev`` (the development distribution is not shipped).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
TOOLS = REPO / "tools"
TREES: tuple[tuple[Path, str], ...] = ((SRC, "dwdp"), (TOOLS, "dwdp_dev"))
"""(import root, top-level package) of each tree whose module graph is checked."""

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

DYNAMIC = "COMMAND_MODULES"
"""A module-level tuple of module names by this name counts as imports of them."""


def module_name(path: Path, src: Path) -> str:
    """``src/dwdp/worker/engine/base.py`` -> ``dwdp.worker.engine.base``; a package's
    ``__init__.py`` -> the package."""
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(src: Path, top: str = "dwdp") -> dict[str, Path]:
    """Every module under ``src/top``, by dotted name."""
    return {module_name(p, src): p for p in sorted((src / top).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST, where: str) -> Iterator[tuple[ast.AST, str]]:
    """Every node under ``node`` with where it sits: ``module``, ``function`` (in a function
    or lambda body) or ``TYPE_CHECKING`` (under ``if TYPE_CHECKING:`` at module level)."""
    for child in ast.iter_child_nodes(node):
        inner = where
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inner = "function"
        yield child, inner
        if isinstance(child, ast.If) and where == "module" and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, "TYPE_CHECKING"
                yield from _statements(stmt, "TYPE_CHECKING")
            for stmt in child.orelse:
                yield stmt, where
                yield from _statements(stmt, where)
        else:
            yield from _statements(child, inner)


def import_sites(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, str]]:
    """``(imported dotted name, where)`` of every import of module ``name`` (``where``: see
    :func:`_statements`; ``importlib`` for a :data:`DYNAMIC` entry). ``from P import n``
    yields ``P.n`` when that is a module of ``known``, else ``P``; relative imports are
    resolved against ``name``."""
    is_package = path.name == "__init__.py"
    for node, where in _statements(ast.parse(path.read_text(), str(path)), "module"):
        if isinstance(node, ast.Import):
            yield from ((alias.name, where) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in known else base), where
        elif (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and where == "module"
            and any(isinstance(t, ast.Name) and t.id == DYNAMIC for t in _targets(node))
            and isinstance(node.value, ast.Tuple)
        ):
            for item in node.value.elts:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    yield item.value, "importlib"


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The dotted names module ``name`` imports (:func:`import_sites`)."""
    return (target for target, _ in import_sites(name, path, known))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# -- the module graph ------------------------------------------------------------------------

Graph = dict[str, dict[str, set[str]]]
"""``{importer: {imported: {where, ...}}}`` (every module is a key)."""


def module_graph(src: Path, top: str) -> Graph:
    """The module graph of the tree ``src/top`` (module docstring): each import resolved to
    the longest dotted prefix of it that is a module of the tree."""
    mods = modules(src, top)
    known = set(mods)
    graph: Graph = {name: {} for name in mods}
    for name, path in mods.items():
        for target, where in import_sites(name, path, known):
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            hit = ".".join(parts)
            if hit and hit != name:
                graph[name].setdefault(hit, set()).add(where)
    return graph


def _label(graph: Graph, a: str, b: str) -> str:
    hidden = sorted(w for w in graph[a][b] if w != "module")
    return f"{a} -> {b}" + (f" ({', '.join(hidden)})" if "module" not in graph[a][b] else "")


def module_cycle_report(src: Path, top: str) -> list[str]:
    """One line per strongly connected component of more than one module: its modules and
    every import between them (marked ``function``/``TYPE_CHECKING``/``importlib`` when no
    import of that pair is at module level)."""
    graph = module_graph(src, top)
    lines = []
    for component in cycles({a: set(bs) for a, bs in graph.items()}):
        members = set(component)
        why = [_label(graph, a, b) for a in component for b in sorted(graph[a]) if b in members]
        lines.append(f"{' <-> '.join(component)}: {'; '.join(why)}")
    return lines


def _packages(graph: Graph, src: Path) -> set[str]:
    return {n for n in graph if (src / n.replace(".", "/") / "__init__.py").is_file()}


def _path(graph: Graph, starts: list[str], goal: str) -> list[str] | None:
    """The shortest chain of imports from one of ``starts`` to ``goal`` (breadth first)."""
    back: dict[str, str | None] = dict.fromkeys(starts)
    queue = deque(starts)
    while queue:
        v = queue.popleft()
        if v == goal:
            chain = [v]
            while (prev := back[chain[-1]]) is not None:
                chain.append(prev)
            return chain[::-1]
        for w in sorted(graph[v]):
            if w not in back:
                back[w] = v
                queue.append(w)
    return None


def upward_report(src: Path, top: str) -> list[str]:
    """One line per upward arrow (module docstring): an own module ``m`` of a package that
    imports a module under one of its sub-packages ``S`` while ``S`` depends on ``m``,
    with the chain of imports by which it does."""
    graph = module_graph(src, top)
    packages = _packages(graph, src)
    lines = []
    for m, targets in sorted(graph.items()):
        parent = m if m in packages else m.rpartition(".")[0]
        for target in sorted(targets):
            if not under(target, parent) or target == parent:
                continue
            sub = ".".join(target.split(".")[: parent.count(".") + 2])
            if sub not in packages or under(m, sub):
                continue
            chain = _path(graph, sorted(n for n in graph if under(n, sub)), m)
            if chain is not None:
                lines.append(f"{_label(graph, m, target)}, but {sub} depends on {m}: "
                             f"{' -> '.join(chain)}")
    return lines


def counts(src: Path, top: str) -> dict[str, int]:
    """The size of the tree's module graph: modules, edges, cycles (strongly connected
    components of more than one module) and upward arrows."""
    graph = module_graph(src, top)
    return {
        "modules": len(graph),
        "edges": sum(len(t) for t in graph.values()),
        "cycles": len(module_cycle_report(src, top)),
        "upward": len(upward_report(src, top)),
    }


# -- the sub-package graph -------------------------------------------------------------------


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


def _none(lines: list[str]) -> None:
    assert not lines, "\n" + "\n".join(lines)


def test_no_cycle_among_the_modules_of_dwdp() -> None:
    _none(module_cycle_report(SRC, "dwdp"))


def test_no_cycle_among_the_modules_of_dwdp_dev() -> None:
    _none(module_cycle_report(TOOLS, "dwdp_dev"))


def test_no_upward_arrow() -> None:
    _none([*upward_report(SRC, "dwdp"), *upward_report(TOOLS, "dwdp_dev")])


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


def test_the_module_graph_sees_lazy_and_dynamic_imports() -> None:
    """The module graph reads what it claims: ``dwdp.cli`` imports the command modules it
    names, and the worker's entry imports its sharded loader (torch) inside a function."""
    graph = module_graph(SRC, "dwdp")
    assert graph["dwdp.cli"]["dwdp.worker.cli"] == {"importlib"}
    assert graph["dwdp.worker.main"]["dwdp.worker.loading.sharded"] == {"function"}
    assert counts(SRC, "dwdp")["modules"] > 100


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


def test_module_cycles_and_upward_arrows_are_reported(tmp_path: Path) -> None:
    """Two modules that import each other (one inside a function, one under
    ``TYPE_CHECKING``) are a cycle; an own module of a package that a sub-package imports
    and that imports that sub-package back is an upward arrow, even through a third module;
    a ``COMMAND_MODULES`` entry is an import; the parents' ``__init__`` is no edge."""
    src = _tree(
        tmp_path,
        {
            "dwdp/__init__.py": "",
            "dwdp/cli.py": "COMMAND_MODULES: tuple[str, ...] = ('dwdp.worker.cli',)\n",
            "dwdp/worker/__init__.py": "",
            "dwdp/worker/cli.py": "def f():\n    from dwdp.cli import X\n",
            "dwdp/worker/memory.py": "from dwdp.worker.server.status import Source\n",
            "dwdp/worker/server/__init__.py": "",
            "dwdp/worker/server/status.py": "Source = 1\n",
            "dwdp/worker/server/app.py": "from dwdp.worker.server import metrics\n",
            "dwdp/worker/server/metrics.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from dwdp.worker.memory import Ledger\n"
            ),
            "dwdp/worker/loading/__init__.py": "",
            "dwdp/worker/loading/a.py": "from . import b\n",
            "dwdp/worker/loading/b.py": "def f():\n    from .a import X\n",
        },
    )
    assert module_cycle_report(src, "dwdp") == [
        "dwdp.cli <-> dwdp.worker.cli: dwdp.cli -> dwdp.worker.cli (importlib); "
        "dwdp.worker.cli -> dwdp.cli (function)",
        "dwdp.worker.loading.a <-> dwdp.worker.loading.b: "
        "dwdp.worker.loading.a -> dwdp.worker.loading.b; "
        "dwdp.worker.loading.b -> dwdp.worker.loading.a (function)",
    ]
    assert upward_report(src, "dwdp") == [
        "dwdp.cli -> dwdp.worker.cli (importlib), but dwdp.worker depends on dwdp.cli: "
        "dwdp.worker.cli -> dwdp.cli",
        "dwdp.worker.memory -> dwdp.worker.server.status, but dwdp.worker.server depends on "
        "dwdp.worker.memory: dwdp.worker.server.metrics -> dwdp.worker.memory",
    ]
    assert counts(src, "dwdp") == {"modules": 12, "edges": 7, "cycles": 2, "upward": 2}

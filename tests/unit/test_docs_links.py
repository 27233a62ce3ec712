"""Product text cites only files that exist in the repository.

A product file (everything under src/, charts/, crds/, docs/ and images/, and the README) may
name a markdown document
(``operations.md``), a repository path (``src/dwdp/worker/engine/cuda_path.py``) or link one
(``[text](docs/install.md#anchor)``). Each must resolve to a file of this repository: a user
reading the text can open what it names. Resolution rules, the same for every file:

- a markdown link target (``](target)``, not a URL) is relative to the linking file, as a
  markdown viewer reads it; its ``#anchor``, when it points into a markdown file, must be the
  GitHub slug of one of that file's headings;
- a path with a folder part and a file extension (``worker/engine/cuda_path.py``) resolves
  against the citing file's folder or any folder above it, up to the repository root (so a
  docstring may name a module relative to its package);
- a folder in backquotes with a trailing slash (``src/dwdp/worker/``) resolves the same way;
- a bare markdown name (``design.md``) resolves the same way or in ``docs/``.

So an internal brief that is not in the repository (``DESIGN.md``) or a path of an earlier
layout (``tools/devcluster/images.py``) is reported with its file and line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_TREES = ("src", "charts", "crds", "docs", "images")
PRODUCT_FILES = ("README.md",)
SKIPPED_PARTS = frozenset({"__pycache__"})

_EXTENSIONS = "py|md|yaml|yml|cu|cuh|sh|go|toml|json|txt|cfg|ini|tpl"
# A path with at least one folder part, not inside a URL, an absolute path, a home path or a
# placeholder (no '/', '.', '~', '<', '$', ':' or a word character right before it).
_PATH = re.compile(rf"(?<![\w./~<>$:@-])((?:[\w.-]+/)+[\w.-]+\.(?:{_EXTENSIONS}))(?![\w/-])")
# A folder in backquotes (`src/dwdp/worker/`), named as a folder by its trailing '/'.
_FOLDER = re.compile(r"`((?:[\w.-]+/)+)`")
_BARE_MD = re.compile(r"(?<![\w./~<>$:@-])([\w-][\w.-]*\.md)(?![\w/-])")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class Broken:
    """One citation that names no file of the repository."""

    file: str
    line: int
    target: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.target!r}: {self.why}"


def product_files(root: Path = REPO) -> list[Path]:
    """Every text file of the product trees and the product READMEs, sorted."""
    files = [root / name for name in PRODUCT_FILES if (root / name).is_file()]
    for tree in PRODUCT_TREES:
        for path in sorted((root / tree).rglob("*")):
            if path.is_file() and not SKIPPED_PARTS & set(path.parts):
                files.append(path)
    return sorted(files)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, inline markup and punctuation other
    than '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    """The heading anchors of a markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    in_fence = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _resolves(root: Path, citing: Path, target: str, extra: tuple[Path, ...] = ()) -> bool:
    folder = citing.parent
    bases = [folder, *(above for above in folder.parents if above.is_relative_to(root))]
    return any((base / target).exists() for base in [*bases, *extra])


def _check_link(root: Path, citing: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None  # a URL (https:, mailto:) or an anchor of the page itself
    path, _, anchor = target.partition("#")
    resolved = (citing.parent / path).resolve()
    if not resolved.exists() or not resolved.is_relative_to(root):
        return "the link target is no file of the repository"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no heading of {resolved.relative_to(root)} has the anchor #{anchor}"
    return None


def broken_citations(root: Path = REPO) -> Iterator[Broken]:
    """Every citation of a product file that names no file of the repository."""
    for citing in product_files(root):
        try:
            text = citing.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        name = str(citing.relative_to(root))
        is_markdown = citing.suffix == ".md"
        for number, line in enumerate(text.splitlines(), start=1):
            if is_markdown:
                for target in _LINK.findall(line):
                    why = _check_link(root, citing, target)
                    if why:
                        yield Broken(name, number, target, why)
                line = _LINK.sub("]()", line)  # a link target is checked once, as a link
            for target in _PATH.findall(line):
                if not _resolves(root, citing, target):
                    yield Broken(name, number, target, "no such file in the repository")
            for target in _FOLDER.findall(line):
                if not _resolves(root, citing, target):
                    yield Broken(name, number, target, "no such folder in the repository")
            for target in _BARE_MD.findall(line):
                if not _resolves(root, citing, target, extra=(root / "docs",)):
                    yield Broken(name, number, target, "no such markdown file in the repository")


_SECTION_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
_SECTION_CITE = re.compile(r"§(\d+(?:\.\d+)*)")
DESIGN = "docs/design.md"
CITING_TREES = (*PRODUCT_TREES, "tools", "tests", "bench", "scripts")


def design_sections(root: Path = REPO) -> set[str]:
    """The numbers of docs/design.md's headings (``3``, ``3.1``, ...)."""
    return set(_SECTION_HEADING.findall((root / DESIGN).read_text(encoding="utf-8")))


def unknown_section_citations(root: Path = REPO) -> Iterator[Broken]:
    """Every ``§N.M`` on a line citing docs/design.md (or in it) that is no heading there."""
    sections = design_sections(root)
    files = [root / name for name in PRODUCT_FILES if (root / name).is_file()]
    for tree in CITING_TREES:
        files += [p for p in sorted((root / tree).rglob("*")) if p.is_file()]
    for citing in files:
        if SKIPPED_PARTS & set(citing.parts) or citing == Path(__file__).resolve():
            continue  # this file's cases cite missing sections on purpose
        try:
            text = citing.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        itself = citing == root / DESIGN
        for number, line in enumerate(text.splitlines(), start=1):
            if not itself and "design.md" not in line:
                continue
            for section in _SECTION_CITE.findall(line):
                if section not in sections:
                    name = str(citing.relative_to(root))
                    yield Broken(name, number, f"§{section}", f"no such section in {DESIGN}")


def test_citations_of_design_sections_name_existing_headings() -> None:
    """``docs/design.md §6.3`` in code, tests and docs names a numbered heading there."""
    broken = [str(b) for b in unknown_section_citations()]
    assert not broken, "citations of missing sections:\n" + "\n".join(broken)


def test_a_citation_of_a_missing_design_section_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## 1. One\n\n### 1.1 Sub\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text('"""As docs/design.md §1 and §1.2 say."""\n')
    broken = [(b.file, b.line, b.target) for b in unknown_section_citations(tmp_path)]
    assert broken == [("src/m.py", 1, "§1.2")]


def test_product_text_cites_only_files_of_the_repository() -> None:
    broken = [str(b) for b in broken_citations()]
    assert not broken, "product text cites files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("Startup order (DESIGN.md 5): read the launch", "DESIGN.md"),
        ("see [the brief](../DESIGN.md#5-the-worker)", "../DESIGN.md#5-the-worker"),
        ("built by `tools/devcluster/images.py`", "tools/devcluster/images.py"),
        ("the corpus `worker/testing/demo_corpus.py` writes", "worker/testing/demo_corpus.py"),
        ("the engine (`worker/engine/`) packs it", "worker/engine/"),
        ("see [operations](operations.md#no-such-heading)", "operations.md#no-such-heading"),
    ],
)
def test_a_citation_of_a_missing_file_is_reported(tmp_path: Path, text: str, target: str) -> None:
    """Each kind of citation, naming a file the repository lacks, is reported with its line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "operations.md").write_text("# Operating\n\n## Field reference\n")
    (tmp_path / "docs" / "page.md").write_text(f"# Page\n\n{text}\n")
    broken = list(broken_citations(tmp_path))
    assert [(b.file, b.line, b.target) for b in broken] == [("docs/page.md", 3, target)]


@pytest.mark.parametrize(
    ("folder", "text"),
    [
        ("docs", "see [the reference](operations.md#field-reference) and design.md"),
        ("docs", "[the code](../src/dwdp/api/crd.py), [up](#page)"),
        ("src/dwdp/api", "see docs/design.md, operations.md and [a site](https://example.com)"),
        ("src/dwdp/api", "`src/dwdp/api/crd.py`; examples: https://example.com/x/README.md"),
        ("src/dwdp/api", "a home ~/.cache/dwdp/x.yaml, an absolute /etc/x.yaml, a <dir>/x.yaml"),
        ("src/dwdp/api", "relative to the package: `api/crd.py`"),
    ],
)
def test_a_citation_of_an_existing_file_passes(tmp_path: Path, folder: str, text: str) -> None:
    """Links with a heading anchor, root paths, URLs and non-repository paths pass; a
    docstring's path may be relative to a folder above it."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "operations.md").write_text("# Operating\n\n## Field reference\n")
    (tmp_path / "docs" / "design.md").write_text("# Design\n")
    (tmp_path / "src" / "dwdp" / "api").mkdir(parents=True)
    (tmp_path / "src" / "dwdp" / "api" / "crd.py").write_text("")
    (tmp_path / folder / "page.md").write_text(f"# Page\n\n{text}\n")
    assert list(broken_citations(tmp_path)) == []


def test_github_slug_of_a_heading_with_markup() -> None:
    assert (
        github_slug("Disaggregated serving: vLLM's `kv_transfer_params` over NIXL")
        == "disaggregated-serving-vllms-kv_transfer_params-over-nixl"
    )

"""Print the requirements of the dwdp distribution's extras, one per line, from pyproject.toml
alone: what an image's dependency layer installs before the product's own layer, so that the
layer is rebuilt when the dependencies change and not when the sources do.

    python3 images/requirements.py pyproject.toml worker,cuda,mpi

Prints ``[project].dependencies`` and each named extra's list, an extra that names the
distribution itself (``dwdp[operator,worker]``) expanded in its place; standard library only
(it runs in the image's build stage before anything is installed).
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(project: dict, extras: list[str]) -> list[str]:
    """The requirements of ``project`` (pyproject's ``[project]`` table) with ``extras``, in
    order, each once. Raises KeyError naming an extra the project lacks."""
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    todo = list(project.get("dependencies", []))
    seen: set[str] = set()
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"{name} has no extra {extra!r} (it has {', '.join(sorted(optional))})")
        todo += optional[extra]
    while todo:
        req = todo.pop(0)
        own = re.fullmatch(rf"{re.escape(name)}\[([\w,\s-]+)\]", req.strip())
        if own:
            for extra in own.group(1).split(","):
                if extra.strip() not in seen:
                    seen.add(extra.strip())
                    todo += optional[extra.strip()]
        elif req not in out:
            out.append(req)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: requirements.py PYPROJECT EXTRA[,EXTRA...]", file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [e for e in argv[2].split(",") if e]
    try:
        print("\n".join(requirements(project, extras)))
    except KeyError as exc:
        print(f"requirements.py: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

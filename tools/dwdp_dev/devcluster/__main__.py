"""``python3 -m dwdp_dev.devcluster ACTION ...``: ``dwdp dev ACTION ...`` without the virtual
environment, on the standard library alone (``src`` and ``tools`` on ``PYTHONPATH``), for the
actions that need nothing else (``build``, ``images``): scripts/demo.sh builds the control plane
and the images with it while .venv is still being made."""

from __future__ import annotations

import argparse
import sys

from dwdp.cli_types import UserError
from dwdp_dev.devcluster import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dwdp")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dev", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"dwdp dev: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The ``dwdp testing`` sub-commands (test and demo helpers). Imports nothing heavy at import."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``testing make-checkpoint`` to the ``dwdp`` command line."""
    testing = subparsers.add_parser("testing", help="test and demo helpers")
    sub = testing.add_subparsers(dest="testing_command", metavar="COMMAND", required=True)
    make = sub.add_parser(
        "make-checkpoint", help="write a tiny seeded Hugging Face MoE checkpoint directory"
    )
    make.add_argument("--arch", required=True, choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    make.add_argument("--out", required=True, help="output directory (created)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-experts", type=int, default=6)
    make.add_argument("--num-layers", type=int, default=3)
    make.add_argument("--hidden-size", type=int, default=32)
    make.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    make.set_defaults(func=_make_checkpoint)


def _make_checkpoint(args: argparse.Namespace) -> int:
    from dwdp.worker.testing.checkpoint import make_checkpoint

    try:
        out = make_checkpoint(
            args.arch,
            args.out,
            seed=args.seed,
            num_experts=args.num_experts,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            dtype=args.dtype,
        )
    except ValueError as exc:
        from dwdp.cli import UserError

        raise UserError(str(exc)) from exc
    print(out)
    return 0

"""The ``dwdp testing`` sub-commands (test and demo helpers). Imports nothing heavy at import."""

from __future__ import annotations

import argparse

from dwdp.cli_types import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``testing make-checkpoint`` and ``testing train-demo-model`` to the ``dwdp`` command
    line."""
    testing = subparsers.add_parser("testing", help="test and demo helpers")
    sub = testing.add_subparsers(dest="testing_command", metavar="COMMAND", required=True)
    make = sub.add_parser(
        "make-checkpoint", help="write a tiny seeded Hugging Face MoE checkpoint directory"
    )
    make.add_argument("--arch", required=True, choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    make.add_argument("--out", required=True, type=_out_dir, help="output directory (created)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-experts", type=int, default=6)
    make.add_argument("--num-layers", type=int, default=3)
    make.add_argument("--hidden-size", type=int, default=32)
    make.add_argument("--head-dim", type=int, default=8,
                      help="attention head size (vLLM's CPU attention serves 32, 64, 96, 128, "
                      "160, 192, 224, 256 and 512: use one of those for a vLLM tier)")
    make.add_argument("--moe-width", type=int, default=16, help="each expert's width")
    make.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    make.set_defaults(func=_make_checkpoint)
    train = sub.add_parser(
        "train-demo-model",
        help="train the demo's tiny DeepSeek-V3-family model on its fact corpus "
        "(seeded, deterministic; about half a minute on one core)",
    )
    train.add_argument("--out", required=True, type=_out_dir, help="output directory (created)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--epochs", type=int, default=40, help="passes over the corpus")
    train.set_defaults(func=_train_demo_model)


def _out_dir(text: str) -> str:
    """``--out``: a directory path that is not empty and not an existing non-directory."""
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (give the output directory)")
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def _os_error(out: str, exc: OSError) -> Exception:
    return UserError(f"--out {out}: {exc.strerror or exc}")


def _make_checkpoint(args: argparse.Namespace) -> int:
    from dwdp_dev.worker.checkpoint import make_checkpoint

    try:
        out = make_checkpoint(
            args.arch,
            args.out,
            seed=args.seed,
            num_experts=args.num_experts,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            head_dim=args.head_dim,
            moe_width=args.moe_width,
            dtype=args.dtype,
        )
    except OSError as exc:
        raise _os_error(args.out, exc) from exc
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(out)
    return 0


def _train_demo_model(args: argparse.Namespace) -> int:
    from dwdp_dev.worker.demo_model import TrainSettings, train_demo_model

    try:
        out = train_demo_model(args.out, TrainSettings(seed=args.seed, epochs=args.epochs))
    except OSError as exc:
        raise _os_error(args.out, exc) from exc
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(out)
    return 0

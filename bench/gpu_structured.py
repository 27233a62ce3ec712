"""The sampler's cost of a grammar mask on one GPU, per step: ``sampler.choose`` on a batch of
free rows against the same batch with every row constrained to ``gpu_serve``'s JSON schema,
and the parts of ``grammar.masked``.

For each batch size of ``--batches``: ``rows`` greedy requests of the bench tokenizer
(``dwdp_dev.worker.tokenizer``, the vocabulary of ``bench/gpu_decode.py``'s checkpoint), each
constrained request's matcher advanced into its integer array (``{"items": [1, 23, ``), and
bf16 logits of [rows, vocab] on the device, fresh random values for every call. Timed on the
host with a device sync before the start and after the end of each call (the median of
``--iters`` calls after 20 warm-up calls): ``free`` and ``json``: ``choose`` (argmax and its
copy to the host; with the mask, ``masked`` first); ``fill``: xgrammar's batched bitmask fill
alone (host only); ``masked``: ``grammar.masked`` whole (fill, the float32 copy, the bitmask's
copy to the device, xgrammar's kernel); ``serial`` and ``m_serial``: the same two with each
row's mask filled by its own matcher on the calling thread (``fill_next_token_bitmask``, no
thread pool) into one pinned bitmask made once, and no index list when every row is
constrained (``serial_masked``: a candidate for ``grammar.masked``, measured here only).
``json - free`` is what a step pays for the mask when nothing of it overlaps the device's
work; the engine fills the masks while the step's forward runs, so a served step pays less.

Usage: python bench/gpu_structured.py [--batches 1,8,32] [--iters 200] [--device cuda]
                                      [--out bench/results]
Writes OUT/gpu_structured.json and OUT/gpu_structured.txt (the printed table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_result
from gpu_serve import structured_body

PREFIX = '{"items": [1, 23, '


_PINNED: dict[tuple[int, int], Any] = {}


def serial_masked(logits: Any, constraints: list) -> Any:
    """``grammar.masked`` with the serial fill of the module docstring (``m_serial``)."""
    import torch
    import xgrammar as xgr

    rows, vocab = len(constraints), int(logits.shape[-1])
    key = (rows, vocab)
    if key not in _PINNED:
        mask = xgr.allocate_token_bitmask(rows, vocab)
        _PINNED[key] = mask.pin_memory() if logits.is_cuda else mask
    bitmask = _PINNED[key]
    idx = [i for i, c in enumerate(constraints) if c is not None]
    for i in idx:
        constraints[i].matcher.fill_next_token_bitmask(bitmask, i)
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                    vocab_size=vocab, indices=None if len(idx) == rows else idx)
    return out


def _timed(fn: Any, device: str, iters: int) -> float:
    """The median wall time of ``fn()`` in microseconds, synced before and after each call."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for i in range(20 + iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(rows: int, device: str, iters: int) -> dict[str, float]:
    """The four times (module docstring) of one batch size."""
    import torch
    import xgrammar as xgr

    from dwdp.worker.engine import grammar
    from dwdp.worker.engine.grammar import Grammars
    from dwdp.worker.engine.protocol import SamplingParams, StructuredOutput
    from dwdp.worker.engine.requests import RequestState
    from dwdp.worker.engine.sampler import choose
    from dwdp_dev.worker.tokenizer import build_tokenizer

    tok = build_tokenizer()
    vocab = len(tok)
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    schema = structured_body("json", 96)["structured_outputs"]["json"]
    spec = StructuredOutput("json", json.dumps(schema))
    free = [RequestState(f"f{i}", [1], SamplingParams()) for i in range(rows)]
    con = [RequestState(f"c{i}", [1], SamplingParams(structured=spec),
                        constraint=grammars.constraint(spec)) for i in range(rows)]
    for state in con:
        for t in tok.encode(PREFIX, add_special_tokens=False):
            assert state.constraint.accept(t)
    pool = [torch.randn(rows, vocab, device=device).to(torch.bfloat16) for _ in range(8)]
    turn = iter(range(1 << 30))

    def logits() -> Any:
        return pool[next(turn) % len(pool)]

    matchers = [s.constraint.matcher for s in con]
    if not grammar._BATCH:
        grammar._BATCH.append(xgr.BatchGrammarMatcher())

    def fill() -> None:
        mask = xgr.allocate_token_bitmask(rows, vocab)
        grammar._BATCH[0].batch_fill_next_token_bitmask(matchers, mask,
                                                        indices=list(range(rows)))

    def serial() -> None:
        mask = _PINNED.setdefault((-rows, vocab), xgr.allocate_token_bitmask(rows, vocab))
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    constraints = [s.constraint for s in con]
    sample = logits()
    assert torch.equal(serial_masked(sample, constraints), grammar.masked(sample, constraints))
    return {"free": _timed(lambda: choose(logits(), free), device, iters),
            "json": _timed(lambda: choose(logits(), con), device, iters),
            "fill": _timed(fill, device, iters),
            "masked": _timed(lambda: grammar.masked(logits(), constraints), device, iters),
            "serial": _timed(serial, device, iters),
            "m_serial": _timed(lambda: serial_masked(logits(), constraints), device, iters)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import torch

    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    rows = {int(b): measure(int(b), args.device, args.iters) for b in args.batches.split(",")}
    lines = [f"sampler.choose with a JSON grammar mask, {name}; median us per call "
             f"(synced before and after)",
             f"{'rows':>4} {'free':>8} {'json':>8} {'json-free':>9} {'fill':>8} {'masked':>8} "
             f"{'serial':>8} {'m_serial':>8}"]
    for b, r in rows.items():
        lines.append(f"{b:>4} {r['free']:>8.1f} {r['json']:>8.1f} {r['json'] - r['free']:>9.1f} "
                     f"{r['fill']:>8.1f} {r['masked']:>8.1f} {r['serial']:>8.1f} "
                     f"{r['m_serial']:>8.1f}")
    write_result(args, "gpu_structured", "\n".join(lines), {"device_name": name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

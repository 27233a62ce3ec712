"""Grammar engines for structured outputs on the CPU: xgrammar against llguidance.

What it measures, for each engine and each of two byte-level BPE tokenizers (the project's small
test tokenizer, ~384 tokens, and a large one trained here on the ``*.py`` files of a few
site-packages, ~131k tokens, pre-tokenized like GPT-4/Llama 3: a split regex with digits in runs
of at most 3, then ByteLevel), with a model vocabulary padded above the tokenizer's (as a
model's ``lm_head`` often is):

* setup: building the engine's tokenizer info from the ``transformers`` tokenizer;
* compile: a JSON schema of moderate size (8 properties: strings, integers, an enum, a nested
  object, an array of objects, required fields, ``additionalProperties: false``), the generic
  JSON object grammar, a regex (an e-mail address) and an EBNF (GBNF) choice of 4 strings.
  "cold" is a compile on a fresh compiler (xgrammar) / a fresh ``LLMatcher`` (llguidance,
  which compiles in its constructor and has no grammar cache), the median of 3, and the very
  first one; "cached" is a second compile of the same grammar on the same compiler. Also the
  time to create a matcher from the compiled grammar and to fill its first bitmask;
* decode: a matcher driven through a valid JSON instance of the schema, tokenized with the
  tokenizer: per token, fill the next-token bitmask then accept the token; mean and p99 in
  microseconds of fill + accept (the first walk right after compiling, then warm walks);
* batch: 32 matchers, staggered over the instance, filled one after the other into one
  [32, vocab] bitmask, then each accepting its token: the server's step at concurrency 32.
  Also each engine's multi-threaded batch fill (``BatchGrammarMatcher`` / ``LLExecutor``);
* apply: each library's CPU function that applies a [32, vocab] bitmask to float32 logits;
* correctness: every token of each grammar's valid example is allowed by the mask and
  accepted, the matcher accepts EOS and ends, padded vocabulary ids are masked, an invalid
  token is rejected, a rollback re-accepts the same tokens;
* errors: the message text for a malformed schema, unsupported schema features, an
  unsupported regex and a broken EBNF grammar (or, where an engine compiles an unsupported
  feature anyway, whether it then accepts an instance that violates it), and what building
  the tokenizer info does with a tokenizer that holds a token longer than 1024 bytes.

In decode and batch the two engines take turns (walk by walk, step by step) so that both see
the same background load; apply runs with one torch thread. All work runs in this one process
on the CPU, and the 1-minute load average at start and end is recorded. The large tokenizer
is cached under ``/tmp/grammar-bench/`` so reruns skip its training. Nothing is downloaded.

Usage: PYTHONPATH=tools:src .venv/bin/python bench/grammar_engines.py [--out bench/results]
       [--cache /tmp/grammar-bench] [--large-vocab 131072] [--batch 32]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar

THREADS = os.cpu_count() or 1
CORPUS_PACKAGES = ("sympy", "numpy", "pandas")
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending", "banned"]},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "status", "address", "orders"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 4217,
    "name": "Jane Q. Doe",
    "email": "jane.doe@example.com",
    "status": "pending",
    "age": 41,
    "address": {"street": "12 Harbour Road", "city": "Lyon", "zip": "69002"},
    "tags": ["priority", "returning customer", "eu"],
    "orders": [
        {"sku": "KB-0042", "quantity": 2, "price": 19.99},
        {"sku": "MS-7", "quantity": 1, "price": 5.5},
        {"sku": "CBL-USB-C", "quantity": 3},
    ],
}
EMAIL_REGEX = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}"
CHOICES = ("positive", "negative", "neutral", "mixed")
CHOICE_EBNF = "root ::= " + " | ".join(json.dumps(c) for c in CHOICES)

# (name, kind, spec, a valid output as text)
WORKLOADS = (
    ("json_schema", "json_schema", json.dumps(SCHEMA), json.dumps(INSTANCE)),
    ("json_object", "json_object", "", '{"any": [1, 2.5, {"x": null}], "ok": true, "s": "t"}'),
    ("regex_email", "regex", EMAIL_REGEX, "jane.doe@mail.example.com"),
    ("ebnf_choice4", "ebnf", CHOICE_EBNF, "neutral"),
)

# (name, kind, spec, an output that the spec forbids or None): what each engine says.
ERROR_CASES = (
    ("malformed schema: type nonsense", "json_schema",
     '{"type": "object", "properties": {"a": {"type": "nonsense"}}}', None),
    ("schema not valid JSON", "json_schema", '{"type": "object", "properties": {', None),
    ("unsupported: not", "json_schema", '{"not": {"type": "string"}}', '"abc"'),
    ("unsupported: uniqueItems", "json_schema",
     '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}', "[1, 1]"),
    ("unsupported: if/then", "json_schema",
     '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},'
     ' "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}', '{"a": 1}'),
    ("unsupported: remote $ref", "json_schema", '{"$ref": "https://example.com/s.json"}', "123"),
    ("unsupported regex: lookahead", "regex", "(?=ab)a.", None),
    ("EBNF: undefined rule", "ebnf", 'root ::= "a" | missing', None),
)


class XgrammarEngine:
    """xgrammar: compile with a GrammarCompiler (cached), match with GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, hf_tok, model_vocab: int):
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tok, vocab_size=model_vocab, stop_token_ids=[hf_tok.eos_token_id])
        self.setup_s = time.perf_counter() - start
        self.vocab = model_vocab
        self.compiler = self.fresh_compiler()
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=THREADS)

    def fresh_compiler(self):
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=THREADS)
        return self.compiler

    def compile(self, kind: str, spec: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar(spec)  # EBNF text, root rule "root"

    def matcher(self, compiled):
        return xgrammar.GrammarMatcher(compiled)

    def allocate(self, batch: int):
        return xgrammar.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, bitmask, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def complete(self, matcher) -> bool:
        return matcher.is_completed()

    def ended(self, matcher) -> bool:
        return matcher.is_terminated()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher) -> None:
        matcher.reset()

    def fill_parallel(self, matchers, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def error_state(self, matcher) -> str:
        return ""


class LlguidanceEngine:
    """llguidance: LLMatcher compiles its grammar when constructed; copies share the grammar."""

    name = "llguidance"

    def __init__(self, hf_tok, model_vocab: int):
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(
            hf_tok, n_vocab=model_vocab, eos_token=hf_tok.eos_token_id)
        self.setup_s = time.perf_counter() - start
        self.vocab = model_vocab
        self.executor = llguidance.LLExecutor(num_threads=THREADS)

    def fresh_compiler(self):
        return None  # no compiler object and no grammar cache

    @staticmethod
    def grammar(kind: str, spec: str) -> str:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.grammar_from("gbnf", spec)  # GBNF -> Lark; raises ValueError

    def compile(self, kind: str, spec: str):
        matcher = llguidance.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def allocate(self, batch: int):
        return llguidance.torch.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, bitmask, row: int = 0) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def complete(self, matcher) -> bool:
        return matcher.is_accepting()

    def ended(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher) -> None:
        matcher.reset()

    def fill_parallel(self, matchers, bitmask) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def error_state(self, matcher) -> str:
        return matcher.get_error() if matcher.is_error() else ""


ENGINES = (XgrammarEngine, LlguidanceEngine)


# ---------------------------------------------------------------- tokenizers and helpers


def padded_vocab(n_tokens: int) -> int:
    """A model vocabulary above the tokenizer's: the next multiple of 128 past it."""
    return (n_tokens // 128 + 1) * 128


def corpus_texts(packages) -> list[str]:
    site = Path(torch.__file__).resolve().parent.parent
    texts = []
    for package in packages:
        for path in sorted(glob.glob(str(site / package / "**" / "*.py"), recursive=True)):
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    return texts


def train_bpe(texts: list[str], vocab_size: int):
    """Byte-level BPE as modern ~128k tokenizers are built: split text with a GPT-4 style regex
    (digits in runs of at most 3), then ByteLevel bytes-to-unicode; ByteLevel decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dwdp_dev.worker.tokenizer import BOS, EOS, PAD

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD)


def token_bytes(tok) -> list[int]:
    return [len(tok.convert_tokens_to_string([t]).encode()) for t in tok.get_vocab()]


def large_tokenizer(cache: Path, vocab_size: int) -> tuple[object, dict]:
    """Train (or load from ``cache``) the large byte-level BPE on site-packages sources."""
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-split-{vocab_size}-{'-'.join(CORPUS_PACKAGES)}"
    meta_path = path / "bench-meta.json"
    if meta_path.exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path)), json.loads(meta_path.read_text())
    texts = corpus_texts(CORPUS_PACKAGES)
    start = time.perf_counter()
    tok = train_bpe(texts, vocab_size)
    meta = {"corpus_packages": list(CORPUS_PACKAGES), "corpus_files": len(texts),
            "corpus_mb": round(sum(len(t.encode()) for t in texts) / 1e6, 1),
            "train_s": round(time.perf_counter() - start, 1), "target_vocab": vocab_size,
            "longest_token_bytes": max(token_bytes(tok))}
    tok.save_pretrained(str(path))
    meta_path.write_text(json.dumps(meta))
    return tok, meta


def long_token_check(engine_cls) -> dict:
    """Tokenizer info for a small BPE holding one token of > 1024 bytes (a long digit run, as
    BPE learns with the GPT-2 pre-tokenizer on data files); records what the engine does."""
    from dwdp_dev.worker.tokenizer import build_tokenizer

    tok = build_tokenizer(vocab_size=400, texts=["value = " + "7" * 1100 + "\n"] * 4)
    stderr: list[str] = []
    try:
        with captured_stderr(stderr):
            engine_cls(tok, padded_vocab(len(tok)))
        outcome = "ok"
    except BaseException as exc:
        outcome = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return {"longest_token_bytes": max(token_bytes(tok)), "outcome": outcome,
            "stderr": " | ".join(line for line in stderr[0].splitlines()[:2])}


def allowed(bitmask, row: int, vocab: int) -> torch.Tensor:
    """The token ids whose bit is set in ``bitmask[row]``."""
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def is_set(bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def pct(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def us_stats(seconds) -> dict:
    values = [s * 1e6 for s in seconds]
    return {"mean_us": round(statistics.fmean(values), 2),
            "p50_us": round(pct(values, 50), 2), "p99_us": round(pct(values, 99), 2),
            "n": len(values)}


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


@contextlib.contextmanager
def captured_stderr(sink: list):
    """Collect what native code writes to file descriptor 2 (xgrammar prints warnings there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace").strip())


def clean(message: str) -> str:
    """Drop xgrammar's "[hh:mm:ss] /project/cpp/file.cc:N: " prefix and trailing space."""
    text = message.strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[1] if ": " in text else text
    return text


# ---------------------------------------------------------------- measurements


def measure_compile(engine, kind: str, spec: str, repeats: int = 3) -> dict:
    """Cold (fresh compiler) and cached compile, matcher creation and first mask, in ms."""
    cold, cached = [], []
    for _ in range(repeats):
        engine.fresh_compiler()
        compiled, seconds = timed(engine.compile, kind, spec)
        cold.append(seconds)
        cached.append(timed(engine.compile, kind, spec)[1])
    matcher, create_s = timed(engine.matcher, compiled)
    bitmask = engine.allocate(1)
    fill_s = timed(engine.fill, matcher, bitmask, 0)[1]
    ms = lambda s: round(s * 1e3, 3)  # noqa: E731
    return {"cold_first_ms": ms(cold[0]), "cold_median_ms": ms(statistics.median(cold)),
            "cached_median_ms": ms(statistics.median(cached)),
            "matcher_create_ms": ms(create_s), "first_fill_ms": ms(fill_s),
            "cache": engine.name == "xgrammar"}


def walk(engine, compiled, ids: list[int]) -> tuple[list[float], list[float], bool]:
    """One matcher through ``ids``: per token fill then accept. Returns fill s, accept s, ok."""
    matcher = engine.matcher(compiled)
    bitmask = engine.allocate(1)
    fills, accepts, ok = [], [], True
    for token in ids:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask, 0)
        t1 = time.perf_counter()
        accepted = engine.accept(matcher, token)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
        if not accepted:
            ok = False
            break
    return fills, accepts, ok


def in_string_flags(tok, text: str, ids: list[int]) -> list[bool]:
    """Per token: does it start inside a JSON string literal (after its opening quote)?"""
    inside, state, escaped = [], False, False
    for ch in text:
        inside.append(state)
        if state and escaped:
            escaped = False
        elif state and ch == "\\":
            escaped = True
        elif ch == '"':
            state = not state
    starts = [len(tok.decode(ids[:i])) for i in range(len(ids))]
    return [inside[start] if start < len(inside) else False for start in starts]


def decode_stats(first: tuple, fills: list, accepts: list, inside: list[bool],
                 ok: bool) -> dict:
    both = [f + a for f, a in zip(fills, accepts, strict=True)]
    flags = inside * (len(both) // len(inside))
    return {"tokens": len(inside), "tokens_in_strings": sum(inside), "all_accepted": ok,
            "first_walk": us_stats([f + a for f, a in zip(*first, strict=True)]),
            "fill": us_stats(fills), "accept": us_stats(accepts), "fill_accept": us_stats(both),
            "in_strings": us_stats([b for b, f in zip(both, flags, strict=False) if f]),
            "structure": us_stats([b for b, f in zip(both, flags, strict=False) if not f])}


def measure_decode(engines, ids: list[int], inside: list[bool], samples: int = 3000) -> dict:
    """Per-token fill + accept through the schema instance: the first walk after a fresh
    compile, then warm walks, the engines taking turns walk by walk so that both see the same
    background load; the warm ones also split by tokens inside JSON strings and the rest."""
    compiled, first, runs = {}, {}, {}
    for engine in engines:
        engine.fresh_compiler()
        compiled[engine.name] = engine.compile("json_schema", json.dumps(SCHEMA))
        fills, accepts, ok = walk(engine, compiled[engine.name], ids)
        first[engine.name] = (fills, accepts)
        runs[engine.name] = ([], [], ok)
    for _ in range(max(3, samples // len(ids))):
        for engine in engines:
            fills, accepts, ok = walk(engine, compiled[engine.name], ids)
            all_fills, all_accepts, all_ok = runs[engine.name]
            runs[engine.name] = (all_fills + fills, all_accepts + accepts, all_ok and ok)
    return {name: decode_stats(first[name], *runs[name][:2], inside, runs[name][2])
            for name in runs}


def staggered(engine, compiled, ids: list[int], batch: int):
    """``batch`` matchers, matcher i advanced by i * len(ids) / batch tokens."""
    matchers, positions = [], []
    for i in range(batch):
        matcher = engine.matcher(compiled)
        position = i * len(ids) // batch
        for token in ids[:position]:
            assert engine.accept(matcher, token)
        matchers.append(matcher)
        positions.append(position)
    return matchers, positions


def advance(engine, matchers, positions, ids) -> float:
    """Every matcher accepts its next token (timed); finished ones restart (untimed)."""
    start = time.perf_counter()
    for matcher, position in zip(matchers, positions, strict=True):
        engine.accept(matcher, ids[position])
    seconds = time.perf_counter() - start
    for i, matcher in enumerate(matchers):
        positions[i] += 1
        if positions[i] == len(ids):
            engine.reset(matcher)
            positions[i] = 0
    return seconds


def fill_rows(engine, matchers, bitmask, parallel: bool) -> float:
    """Fill one bitmask row per matcher: one after the other, or the engine's threaded call."""
    start = time.perf_counter()
    if parallel:
        engine.fill_parallel(matchers, bitmask)
    else:
        for row, matcher in enumerate(matchers):
            engine.fill(matcher, bitmask, row)
    return time.perf_counter() - start


def measure_batch(engines, compiled: dict, ids: list[int], batch: int,
                  parallel: bool) -> tuple[dict, dict]:
    """Decode steps of ``batch`` staggered matchers per engine (engines take turns step by
    step): fill all rows, then every matcher accepts its token. Returns stats and bitmasks."""
    state, times = {}, {}
    for engine in engines:
        matchers, positions = staggered(engine, compiled[engine.name], ids, batch)
        state[engine.name] = (matchers, positions, engine.allocate(batch))
        times[engine.name] = ([], [])
    for _ in range(2 * len(ids)):
        for engine in engines:
            matchers, positions, bitmask = state[engine.name]
            fills, accepts = times[engine.name]
            fills.append(fill_rows(engine, matchers, bitmask, parallel))
            accepts.append(advance(engine, matchers, positions, ids))
    stats = {name: {"steps": len(f), "fill": us_stats(f), "accept": us_stats(a),
                    "step": us_stats([x + y for x, y in zip(f, a, strict=True)])}
             for name, (f, a) in times.items()}
    return stats, {name: st[2] for name, st in state.items()}


APPLY_KERNELS = (
    ("xgrammar.apply_token_bitmask_inplace", xgrammar.apply_token_bitmask_inplace),
    ("llguidance.torch.apply_token_bitmask_inplace", llguidance.torch.apply_token_bitmask_inplace),
)


def time_apply(kernel, bitmask, vocab: int, threads: int, repeats: int = 30) -> dict:
    """Apply ``bitmask`` to [batch, vocab] float32 logits with ``threads`` torch threads:
    the first call, then ``repeats`` calls after a warm-up of 10."""
    torch.set_num_threads(threads)
    try:
        logits = torch.randn(bitmask.shape[0], vocab, dtype=torch.float32)
        first_s = timed(kernel, logits, bitmask)[1]
        for _ in range(10):  # after a thread-count change the first calls run slow
            kernel(logits, bitmask)
        times = [timed(kernel, logits, bitmask)[1] for _ in range(repeats)]
    finally:
        torch.set_num_threads(THREADS)
    return {"first_call_ms": round(first_s * 1e3, 2), **us_stats(times)}


def apply_correct(kernel, bitmask, vocab: int) -> bool:
    """-inf exactly where the bitmask has a 0 bit, logits untouched elsewhere."""
    logits = torch.randn(bitmask.shape[0], vocab, dtype=torch.float32)
    kernel(logits, bitmask)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for row in range(bitmask.shape[0]):
        keep[row, allowed(bitmask, row, vocab)] = True
    return bool(torch.equal(torch.isfinite(logits), keep))


def measure_apply(bitmasks: dict, vocab: int) -> list[dict]:
    """Both libraries' CPU apply functions with one torch thread (on this shared 2-core host
    two threads stall on the busy core); timed on xgrammar's filled batch bitmask, checked on
    each engine's (the layout is the same: bit j of int32 word i is token 32 * i + j)."""
    rows = []
    for name, kernel in APPLY_KERNELS:
        row = {"kernel": name, "threads": 1, **time_apply(kernel, bitmasks["xgrammar"], vocab, 1)}
        row["correct_on_masks_of"] = {
            engine: apply_correct(kernel, bm, vocab) for engine, bm in bitmasks.items()}
        rows.append(row)
    return rows


# ---------------------------------------------------------------- correctness and errors


def smoke_walk(engine, compiled, ids: list[int], eos: int, real_vocab: int) -> dict:
    """Feed a valid output: every token allowed + accepted, then EOS allowed and ending."""
    matcher = engine.matcher(compiled)
    bitmask = engine.allocate(1)
    in_mask = accepted = True
    pad_masked = True
    for token in ids:
        engine.fill(matcher, bitmask, 0)
        in_mask = in_mask and is_set(bitmask, 0, token)
        ids_allowed = allowed(bitmask, 0, engine.vocab)
        pad_masked = pad_masked and not bool((ids_allowed >= real_vocab).any())
        accepted = accepted and engine.accept(matcher, token)
    complete = engine.complete(matcher)
    engine.fill(matcher, bitmask, 0)
    eos_allowed = is_set(bitmask, 0, eos)
    eos_accepted = engine.accept(matcher, eos)
    return {"tokens": len(ids), "all_in_mask": in_mask, "all_accepted": accepted,
            "complete_before_eos": complete, "eos_allowed": eos_allowed,
            "eos_accepted": eos_accepted, "ended": engine.ended(matcher),
            "padding_ids_masked": pad_masked}


def smoke_reject_and_rollback(engine, compiled, ids: list[int], bad: int) -> dict:
    """An invalid first token is masked and rejected (is the matcher still usable after?);
    rollback(3) then re-accepting the same 3 tokens works."""
    matcher = engine.matcher(compiled)
    bitmask = engine.allocate(1)
    engine.fill(matcher, bitmask, 0)
    result = {"invalid_token": bad, "invalid_in_mask": is_set(bitmask, 0, bad),
              "invalid_accepted": engine.accept(matcher, bad)}
    result["error_state_after_reject"] = engine.error_state(matcher)
    result["valid_accepted_after_reject"] = engine.accept(matcher, ids[0])
    matcher = engine.matcher(compiled)
    for token in ids[:10]:
        engine.accept(matcher, token)
    engine.rollback(matcher, 3)
    result["rollback_reaccept"] = all(engine.accept(matcher, t) for t in ids[7:10])
    return result


def try_compile(engine, kind: str, spec: str, sink: list):
    """Compile inside captured stderr; returns (compiled or None, error text)."""
    try:
        with captured_stderr(sink):
            return engine.compile(kind, spec), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {clean(str(exc))}"


def error_report(engine, tok) -> list[dict]:
    """What the engine says for each ERROR_CASES entry."""
    rows = []
    for name, kind, spec, violating in ERROR_CASES:
        engine.fresh_compiler()
        stderr: list[str] = []
        compiled, error = try_compile(engine, kind, spec, stderr)
        row = {"case": name, "error": error,
               "stderr": " | ".join(clean(line) for line in stderr[0].splitlines() if line)}
        if compiled is not None and violating is not None:
            ids = tok.encode(violating, add_special_tokens=False)
            _, _, ok = walk(engine, compiled, ids)
            matcher = engine.matcher(compiled)
            done = all(engine.accept(matcher, t) for t in ids) and engine.complete(matcher)
            row["violating_output"] = violating
            row["violating_output_accepted"] = ok and done
        rows.append(row)
    return rows


# ---------------------------------------------------------------- driver


def bench_tokenizer(label: str, tok, batch: int) -> dict:
    """Every measurement for both engines with one tokenizer."""
    real_vocab = len(tok)
    model_vocab = padded_vocab(real_vocab)
    strings = [tok.convert_tokens_to_string([t]) for t in tok.get_vocab()]
    out = {"tokens": real_vocab, "model_vocab": model_vocab, "eos": tok.eos_token_id,
           "batch": batch, "tokens_with_quote": sum('"' in t for t in strings),
           "longest_token_bytes": max(len(t.encode()) for t in strings), "engines": {}}
    engines = [engine_cls(tok, model_vocab) for engine_cls in ENGINES]
    for engine in engines:
        print(f"[{label}] {engine.name}: setup {engine.setup_s * 1e3:.1f} ms", flush=True)
        out["engines"][engine.name] = bench_engine(engine, tok, real_vocab)
        out["engines"][engine.name]["setup_ms"] = round(engine.setup_s * 1e3, 2)
    ids = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    inside = in_string_flags(tok, json.dumps(INSTANCE), ids)
    for name, stats in measure_decode(engines, ids, inside).items():
        out["engines"][name]["decode"] = stats
    compiled = {e.name: e.compile("json_schema", json.dumps(SCHEMA)) for e in engines}
    for key, parallel in (("batch_parallel", True), ("batch_sequential", False)):
        stats, bitmasks = measure_batch(engines, compiled, ids, batch, parallel)
        for name, result in stats.items():
            out["engines"][name][key] = result
    out["apply"] = measure_apply(bitmasks, model_vocab)
    print(f"[{label}] done", flush=True)
    return out


def bench_engine(engine, tok, real_vocab: int) -> dict:
    """Compile times, correctness smoke and error messages for one engine."""
    result = {"compile": {}, "smoke": {}}
    for name, kind, spec, text in WORKLOADS:
        result["compile"][name] = measure_compile(engine, kind, spec)
        ids = tok.encode(text, add_special_tokens=False)
        compiled = engine.compile(kind, spec)
        result["smoke"][name] = smoke_walk(engine, compiled, ids, tok.eos_token_id, real_vocab)
    ids = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    compiled = engine.compile("json_schema", json.dumps(SCHEMA))
    bad = tok.encode("]", add_special_tokens=False)[0]
    result["smoke"]["reject_rollback"] = smoke_reject_and_rollback(engine, compiled, ids, bad)
    result["errors"] = error_report(engine, tok)
    return result


def environment(large_meta: dict) -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    version = importlib.metadata.version
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu_model": model, "cpu_count": os.cpu_count(), "threads": THREADS,
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_start": os.getloadavg()[0],
            "versions": {p: version(p) for p in
                         ("xgrammar", "llguidance", "torch", "transformers", "tokenizers")},
            "large_tokenizer": large_meta, "batch_note": "sequential = rows filled one after"
            " the other on the calling thread; parallel = engine's threaded batch fill"}


# ---------------------------------------------------------------- report


def table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths]), *[fmt(r) for r in cells[1:]], ""]


def each(data: dict):
    """(tokenizer label, engine name, engine result) over the whole run."""
    for label, tok in data["tokenizers"].items():
        for name, res in tok["engines"].items():
            yield label, name, res


def header_lines(data: dict) -> list[str]:
    env, lines = data["environment"], []
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines.append("Grammar engines for structured outputs on the CPU (bench/grammar_engines.py)")
    lines.append(f"date {env['date']}; CPU {env['cpu_model']} x{env['cpu_count']}; "
                 f"threads {env['threads']}; python {env['python']}")
    lines.append(versions)
    for label, tok in data["tokenizers"].items():
        lines.append(f"tokenizer {label}: {tok['tokens']} tokens, model vocab {tok['model_vocab']}"
                     f" (bitmask padded), eos id {tok['eos']}, {tok['tokens_with_quote']} tokens"
                     f" contain '\"', longest token {tok['longest_token_bytes']} bytes")
    meta = env["large_tokenizer"]
    lines.append(f"large tokenizer trained on {meta['corpus_files']} .py files "
                 f"({meta['corpus_mb']} MB) of {', '.join(meta['corpus_packages'])} "
                 f"in {meta['train_s']} s (cached after the first run)")
    lines.append(f"load average (1 min) at start {env['loadavg_start']}, at end"
                 f" {env['loadavg_end']}; run took {env['total_s']} s")
    return [*lines, ""]


def compile_lines(data: dict) -> list[str]:
    rows = []
    for label, name, res in each(data):
        rows.append([label, name, "tokenizer info", res["setup_ms"], "", "", "", ""])
        for grammar, c in res["compile"].items():
            cached = c["cached_median_ms"] if c["cache"] else f"({c['cached_median_ms']})"
            rows.append([label, name, grammar, c["cold_median_ms"], c["cold_first_ms"], cached,
                         c["matcher_create_ms"], c["first_fill_ms"]])
    lines = ["Compile, ms. cold = fresh compiler / fresh LLMatcher, median of 3; first = the"
             " first of those; cached = same grammar again on the same compiler (llguidance"
             " has no cache: value in parentheses is a plain recompile); matcher = create a"
             " matcher from the compiled grammar (llguidance: deep_copy); first fill = first"
             " bitmask of that matcher."]
    return lines + table(["tokenizer", "engine", "grammar", "cold", "first", "cached",
                          "matcher", "first fill"], rows)


def decode_lines(data: dict) -> list[str]:
    rows = []
    for label, name, res in each(data):
        d = res["decode"]
        rows.append([label, name, f"{d['tokens']} ({d['tokens_in_strings']} in str)",
                     d["first_walk"]["mean_us"],
                     d["first_walk"]["p99_us"], d["fill"]["mean_us"], d["accept"]["mean_us"],
                     d["fill_accept"]["mean_us"], d["fill_accept"]["p50_us"],
                     d["fill_accept"]["p99_us"], d["in_strings"]["mean_us"],
                     d["structure"]["mean_us"], d["fill_accept"]["n"]])
    lines = ["Decode, one matcher through the schema instance, us per token (fill bitmask +"
             " accept). first walk = right after compiling; the rest = warm walks; string /"
             " structure = mean over tokens that start inside a JSON string / the others."]
    return lines + table(["tokenizer", "engine", "tokens", "first mean", "first p99",
                          "fill mean", "accept mean", "mean", "p50", "p99", "string",
                          "structure", "n"], rows)


def batch_lines(data: dict) -> list[str]:
    rows = []
    for label, name, res in each(data):
        s, p = res["batch_sequential"], res["batch_parallel"]
        rows.append([label, name, s["fill"]["mean_us"], s["accept"]["mean_us"],
                     s["step"]["mean_us"], s["step"]["p99_us"], p["fill"]["mean_us"],
                     p["step"]["mean_us"], p["step"]["p99_us"], s["steps"]])
    batch = next(iter(data["tokenizers"].values()))["batch"]
    lines = [f"Batch of {batch} staggered matchers, us per decode step (all rows filled, then"
             f" all accept). seq = filled one after the other; par = the engine's threaded"
             f" batch fill ({data['environment']['threads']} threads on a shared 2-core host:"
             f" sensitive to other load)."]
    return lines + table(["tokenizer", "engine", "seq fill", "accept", "seq step",
                          "seq p99", "par fill", "par step", "par p99", "steps"], rows)


def apply_lines(data: dict) -> list[str]:
    rows = []
    for label, tok in data["tokenizers"].items():
        for a in tok["apply"]:
            correct = ", ".join(f"{k} {v}" for k, v in a["correct_on_masks_of"].items())
            rows.append([label, a["kernel"], a["threads"], a["mean_us"], a["p50_us"],
                         a["p99_us"], a["first_call_ms"], correct])
    batch = next(iter(data["tokenizers"].values()))["batch"]
    lines = [f"Apply a filled bitmask to [{batch}, model vocab] float32 logits on the CPU, us,"
             " one torch thread; first = first call in ms (llguidance's includes torch.compile"
             " when not yet compiled); correct = -inf exactly at masked ids, on both engines'"
             " masks."]
    return lines + table(["tokenizer", "function", "threads", "mean", "p50", "p99",
                          "first ms", "correct"], rows)


def smoke_lines(data: dict) -> list[str]:
    rows = []
    for label, name, res in each(data):
        for grammar, s in res["smoke"].items():
            if grammar == "reject_rollback":
                continue
            rows.append([label, name, grammar, s["tokens"], s["all_in_mask"],
                         s["all_accepted"], s["complete_before_eos"], s["eos_allowed"],
                         s["eos_accepted"], s["ended"], s["padding_ids_masked"]])
    lines = ["Correctness smoke: each grammar's valid output fed token by token (in mask = each"
             " token allowed by the mask filled before it; complete = grammar satisfied before"
             " EOS; ended = terminated after EOS; pad masked = ids past the tokenizer never"
             " allowed)."]
    lines += table(["tokenizer", "engine", "grammar", "tokens", "in mask", "accepted",
                    "complete", "eos in mask", "eos accepted", "ended", "pad masked"], rows)
    rows = []
    for label, name, res in each(data):
        r = res["smoke"]["reject_rollback"]
        rows.append([label, name, r["invalid_token"], r["invalid_in_mask"],
                     r["invalid_accepted"], r["valid_accepted_after_reject"],
                     r["rollback_reaccept"], r["error_state_after_reject"][:60] or "-"])
    lines.append("Schema matcher: an invalid first token (']') and rollback.")
    return lines + table(["tokenizer", "engine", "token", "in mask", "accepted",
                          "usable after", "rollback(3)+reaccept", "error state"], rows)


def error_lines(data: dict) -> list[str]:
    label = next(iter(data["tokenizers"]))
    lines = [f"Errors (tokenizer {label}): message text, or what happens when it compiles."]
    for name, res in data["tokenizers"][label]["engines"].items():
        for row in res["errors"]:
            text = " | ".join(row["error"].splitlines()) or "compiled without error"
            if row.get("stderr"):
                text += f"; stderr: {row['stderr']}"
            if "violating_output_accepted" in row:
                text += (f"; accepts forbidden output {row['violating_output']}:"
                         f" {row['violating_output_accepted']}")
            lines.append(f"  {name:<10} {row['case']:<32} {text}")
    for name, row in data["long_token"].items():
        text = row["outcome"] + (f"; stderr: {row['stderr']}" if row["stderr"] else "")
        lines.append(f"  {name:<10} {'token of ' + str(row['longest_token_bytes']) + ' bytes':<32}"
                     f" tokenizer info: {text}")
    return [*lines, ""]


def render(data: dict) -> str:
    parts = (header_lines, compile_lines, decode_lines, batch_lines, apply_lines,
             smoke_lines, error_lines)
    return "\n".join(line for part in parts for line in part(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/grammar-bench"))
    parser.add_argument("--large-vocab", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from dwdp_dev.worker.tokenizer import build_tokenizer

    started = time.perf_counter()
    large, meta = large_tokenizer(args.cache, args.large_vocab)
    tokenizers = {"small": build_tokenizer(), "large": large}
    data = {"environment": environment(meta), "schema": SCHEMA, "instance": INSTANCE,
            "regex": EMAIL_REGEX, "ebnf": CHOICE_EBNF, "tokenizers": {}}
    for label, tok in tokenizers.items():
        data["tokenizers"][label] = bench_tokenizer(label, tok, args.batch)
    data["long_token"] = {cls.name: long_token_check(cls) for cls in ENGINES}
    data["environment"]["loadavg_end"] = os.getloadavg()[0]
    data["environment"]["total_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    text = render(data)
    (args.out / "grammar-engines.txt").write_text(text + "\n")
    (args.out / "grammar-engines.json").write_text(json.dumps(data, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Token choice for a batch of requests: greedy, sampled, with logprobs; one home for both engines.

``choose(logits, states)`` takes the [batch, vocab] logits of one step (on the model's device)
and the ``RequestState`` of each row. Greedy rows take the argmax (one batched op); sampled rows
go through transformers' logits warpers (temperature, then top-k, then top-p) and draw from a
per-request ``torch.Generator`` on the logits' device, seeded by ``seed`` when the request set
one, so a seeded request draws the same tokens whatever else shares its batch. A constrained
request's row (``RequestState.constraint``) first gets the tokens its grammar forbids at minus
infinity (``dwdp.worker.engine.grammar.masked``: the masks are filled on the host before the
first read of the logits, while the device may still compute them). A request's
``logit_bias`` is added to its row first (a copy), greedy or sampled, and the tokens it may
not choose yet (``min_tokens``: EOS and its stop tokens) are set to minus infinity. Rows that ask
for ``logprobs`` get the log-softmax of the raw logits (float32) at the chosen token and the
top ``logprobs`` alternatives. Results cross to the host once per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dwdp.worker.engine.grammar import masked
from dwdp.worker.engine.protocol import TokenLogprob
from dwdp.worker.engine.requests import RequestState


@dataclass(frozen=True, slots=True)
class Choice:
    """The token chosen for one row and, when asked for, its logprob entry."""

    token: int
    logprob: TokenLogprob | None = None


def _prepare(state: RequestState, device: Any) -> None:
    """Build the warpers and the seeded generator of a sampled request (once)."""
    import torch
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    p = state.params
    procs = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    state.processors = procs
    state.generator = torch.Generator(device=device)
    if p.seed is not None:
        state.generator.manual_seed(p.seed)
    else:
        state.generator.seed()


def choose(logits: Any, states: list[RequestState]) -> list[Choice]:
    """The token of each row of ``logits`` ([len(states), vocab], any float dtype)."""
    import torch

    constraints = [s.constraint for s in states]
    constrained = any(c is not None for c in constraints)
    allowed = masked(logits, constraints) if constrained else logits
    tokens = torch.argmax(allowed, dim=-1)  # float32 is exact for bf16/fp16: the same argmax
    plain = all(_plain(s) for s in states)
    if plain:  # the decode hot path: one argmax, one copy
        return [Choice(t) for t in tokens.tolist()]
    rows = logits.float()  # the raw model's: logprobs and kept logits
    allowed = rows if allowed is logits else allowed
    for i, state in enumerate(states):
        if state.keep_logits:
            state.logits.append(rows[i].cpu().clone())
        scores = allowed[i : i + 1]
        if _changes_logits(state):  # on a copy: logprobs stay the raw model's
            scores = _processed(scores, state)
            if state.params.greedy:
                tokens[i] = torch.argmax(scores[0])
        if state.params.greedy:
            continue
        if state.generator is None:
            _prepare(state, rows.device)
        scores = state.processors(_NO_HISTORY, scores)
        probs = torch.softmax(scores, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=state.generator)[0, 0]
    want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not want:
        return [Choice(int(t)) for t in tokens.tolist()]
    logp = torch.log_softmax(rows[want], dim=-1)
    chosen = logp.gather(1, tokens[want].unsqueeze(1))[:, 0]
    k = max(states[i].params.logprobs or 0 for i in want)
    top = torch.topk(logp, k, dim=-1)  # k = 0: empty [len(want), 0]
    # one copy to the host: tokens, then per wanted row its logprob, top ids, top values
    # (float64 holds every token id exactly)
    packed = torch.cat([
        tokens.double(),
        torch.cat([chosen.double()[:, None], top.indices.double(), top.values.double()],
                  dim=1).reshape(-1),
    ]).tolist()
    host_tokens = [int(t) for t in packed[: len(states)]]
    width = 1 + 2 * k
    rest = packed[len(states) :]
    host_chosen = [rest[r * width] for r in range(len(want))]
    top_ids = [[int(t) for t in rest[r * width + 1 : r * width + 1 + k]] for r in range(len(want))]
    top_vals = [rest[r * width + 1 + k : (r + 1) * width] for r in range(len(want))]
    out = [Choice(t) for t in host_tokens]
    for row, i in enumerate(want):
        n = states[i].params.logprobs or 0
        pairs = tuple(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
        out[i] = Choice(host_tokens[i], TokenLogprob(host_tokens[i], host_chosen[row], pairs))
    return out


def greedy_tokens(logits: Any, states: list[RequestState]) -> list[int] | None:
    """The argmax of every row of ``logits`` (a step's kept rows, whatever request each is of),
    in one copy to the host, when every request of ``states`` is plain greedy without a
    grammar (its rows depend on nothing it takes: ``choose_each``); else ``None``. A verify
    step's drafts then cost no copy of their own."""
    import torch

    if not plain_greedy(states):
        return None
    return torch.argmax(logits, dim=-1).tolist()


def plain_greedy(states: list[RequestState]) -> bool:
    """Whether every request of ``states`` takes its rows' argmax, whatever it takes before
    (plain greedy, no grammar): its tokens can be chosen on the device."""
    return all(_plain(s) and s.constraint is None for s in states)


def choose_each(rows: Any, state: RequestState) -> Iterator[Choice]:
    """The token of each of ``rows`` ([n, vocab]) for one request, in order, as the caller
    takes them (a verify step's draft positions): the request's state may change between rows
    (its grammar, ``min_tokens``, its generator), so each row is chosen once the one before
    was taken; a plain greedy request's rows, which depend on nothing it takes, cross to the
    host in one copy."""
    import torch

    if plain_greedy([state]):  # a grammar's mask moves with each token
        yield from (Choice(t) for t in torch.argmax(rows, dim=-1).tolist())
        return
    for i in range(rows.shape[0]):
        yield choose(rows[i : i + 1], [state])[0]


def _plain(state: RequestState) -> bool:
    """Greedy on the raw logits, nothing kept or reported: one argmax decides the token (its
    rules cannot start to apply later: ``min_tokens`` only ends)."""
    p = state.params
    return p.greedy and p.logprobs is None and not state.keep_logits \
        and not _changes_logits(state)


def _changes_logits(state: RequestState) -> bool:
    """Whether :func:`_processed` changes this step's logits of the request."""
    return bool(state.params.logit_bias) or state.holding()


def _processed(scores: Any, state: RequestState) -> Any:
    """A copy of one row's logits ([1, vocab]) as the request asks before its token is chosen:
    its ``logit_bias`` added, and the tokens it may not choose yet (``held_back`` while under
    ``min_tokens``) at minus infinity. The one place a request's own rules change logits."""
    import torch

    scores = scores.clone()
    if state.params.logit_bias:
        ids, biases = zip(*state.params.logit_bias, strict=True)
        scores[0, list(ids)] += torch.tensor(biases, device=scores.device)
    if state.holding():
        scores[0, list(state.held_back)] = float("-inf")
    return scores


class _NoHistory:
    """The warpers' ``input_ids`` argument: temperature, top-k and top-p never read it."""


_NO_HISTORY: Any = _NoHistory()


def prompt_logprobs(logits: Any, prompt: list[int], top: int) -> list[TokenLogprob]:
    """The entries of a prompt's tokens after the first from ``logits`` ([len(prompt), vocab],
    any float dtype, row ``t`` the logits after token ``t``): token ``t`` gets the
    log-softmax (float32) of row ``t - 1`` at its id, its rank (1 + the ids more likely) and
    the ``top`` most likely (id, logprob) pairs. One copy to the host."""
    import torch

    if len(prompt) < 2:
        return []
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(prompt[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, target[:, None])
    rank = (logp > chosen).sum(dim=1) + 1
    best = torch.topk(logp, top, dim=-1)  # top = 0: empty [T - 1, 0]
    packed = torch.cat(
        [chosen.double(), rank.double()[:, None], best.indices.double(), best.values.double()],
        dim=1,
    ).tolist()  # float64 holds every token id and rank exactly
    return [
        TokenLogprob(
            token,
            row[0],
            tuple(zip((int(i) for i in row[2 : 2 + top]), row[2 + top :], strict=True)),
            int(row[1]),
        )
        for token, row in zip(prompt[1:], packed, strict=True)
    ]

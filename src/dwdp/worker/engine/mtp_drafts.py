"""Draft tokens from a DeepSeek MTP layer (``engine.speculative.method: mtp``).

After every step of the continuous engine (``ContinuousEngine._step``), :meth:`MtpDrafts.after`
runs the MTP layer (``dwdp.worker.engine.speculative.DraftLayer``) over the positions the step
kept: every prompt position a chunk computed and, of a decoding request, its pending token and
the drafts the target accepted. Position ``p`` gets the target's last hidden state there
(captured from the model's final norm during the step's forward) and the token at ``p + 1``,
so the layer's KV follows the target's, and its output at a decoding request's last kept
position predicts the token after the one the step chose: the first draft of the next step.
Further drafts run the layer one position on, its own output standing in for the target's
hidden state (vLLM's ``deepseek_mtp``); their cache entries are overwritten by the next step's
pass. The drafts land in ``Sequence.draft``.

The layer's KV is layer ``layer_index`` (the model's layer count, as in the checkpoint) of the
engine's own ``PagedKVCache``, in the requests' blocks: the prefix cache shares it with the
model's, and the KV transfer moves it with the model's (``dwdp.worker.disagg.agent``). A context
server runs the pass over a prefill whose KV it holds for a generation server before the hold
is answered (``held``), so that server's MTP layer drafts from its first step.

The target's hidden states reach the layer through a buffer of the step's largest token count:
a forward hook on the model's final norm copies its output there. Under CUDA graphs that copy is
one of the captured kernels, so a replayed step (decode graphs or piecewise graphs) refreshes the
buffer as an eager one does. After a replayed decode or verify step, the layer's pass replays
graphs of its own (``capture``: ``dwdp.worker.engine.graphs.DecodeGraphs`` of the same slabs,
reading the buffer in place); after any other step, and for the drafts after the first, it
runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dwdp.worker.engine.graphs import DecodeGraphs
from dwdp.worker.engine.paged import Chunk, KernelLayout, PagedKVCache, use_paged_attention

if TYPE_CHECKING:
    from collections.abc import Callable

    from dwdp.worker.engine.scheduler import Scheduled, Scheduler, Sequence
    from dwdp.worker.engine.speculative import DraftLayer


def hidden_rows(max_num_tokens: int, max_batch_size: int, num_speculative_tokens: int) -> int:
    """Rows of the hidden-state buffer: the most tokens of one forward, a step's (at most
    ``max_num_tokens``, the scheduler's budget) or a verify graph's bucket (``max_batch_size``
    slabs of ``1 + num_speculative_tokens`` tokens)."""
    return max(max_num_tokens, max_batch_size * (1 + num_speculative_tokens))


class MtpDrafts:
    """The MTP layer of one engine, its KV cache and the target's captured hidden states."""

    def __init__(self, layer: DraftLayer, target: Any, cache: PagedKVCache, *, layer_index: int,
                 cache_kwarg: str, num_speculative_tokens: int, max_tokens: int) -> None:
        import torch

        self.layer = layer
        self.k = num_speculative_tokens
        block = layer.block
        use_paged_attention(block)
        for module in block.modules():  # its attention's cache layer: after the model's
            if hasattr(module, "layer_idx"):
                module.layer_idx = layer_index
        self.cache = cache
        self._cache_kwarg = cache_kwarg
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=block.device)
        hidden = int(target.config.get_text_config().hidden_size)
        self.hidden = torch.zeros((max_tokens, hidden), dtype=block.dtype, device=block.device)
        """The target's last hidden states of the step that ran last, a row per token of the
        step ([``max_tokens``, H]: a step's tokens at most, or its graph bucket's)."""
        target.model.norm.register_forward_hook(self._capture)
        self.graphs: dict[int, DecodeGraphs] = {}
        """The layer's pass after a replayed step, by the step's slab (``q``): ``capture``."""

    def _capture(self, module: Any, args: Any, output: Any) -> None:
        """The final norm's output [1, T, H] into ``hidden`` (recorded in a captured graph)."""
        tokens = output.shape[1]
        if tokens > self.hidden.shape[0]:
            raise RuntimeError(f"MTP drafts: a step of {tokens} tokens, the hidden-state buffer "
                               f"holds {self.hidden.shape[0]}")
        self.hidden[:tokens].copy_(output[0])

    def capture(self, *steps: DecodeGraphs | None, pool: Any) -> None:
        """Capture the layer's pass after each of the target's decode graphs ``steps`` (None:
        not captured), over the same buckets and slabs, into the graph memory pool ``pool``."""
        for step in steps:
            if step is None:
                continue
            self.graphs[step.q] = DecodeGraphs.capture(
                self.cache, self._slabs, max_batch_size=step.buckets[-1],
                max_model_len=step.width * self.cache.block_size, pool=pool, q=step.q,
                what="the MTP layer's pass")

    def after(self, plan: list[Scheduled], accepted: dict[int, int], scheduler: Scheduler,
              room: Callable[[Sequence], int], held: dict[int, int] | None = None,
              replayed: DecodeGraphs | None = None) -> None:
        """Run the layer over the kept positions of ``plan`` (``accepted``: drafts accepted per
        ``id(seq)``) and set the drafts of the decoding requests, up to ``room(seq)`` each.
        ``held``: per ``id(seq)``, the token a prefill chose whose KV is to be held for a
        generation server, not taken yet (the pass covers its prompt). ``replayed``: the
        target's decode graphs the step replayed (its hidden states in their slabs), if any."""
        import torch

        held = held or {}
        chunks: list[Chunk | None] = []  # per plan entry; None: nothing of it to run
        rows: list[int] = []
        ids: list[int] = []
        wanting: list[tuple[Sequence, int]] = []
        q = 0
        for p in plan:
            c, seq = p.chunk, p.seq
            q0, q = q, q + len(c.token_ids)
            chunks.append(None)
            if seq.state.finished or seq not in scheduler.running:
                continue
            kept = len(c.token_ids) - c.draft + accepted.get(id(seq), 0)
            following = _following(seq, c.start, kept, held.get(id(seq)))
            if len(following) < kept:
                continue  # its last token is not taken (a prefill parked for its KV hold)
            want = c.sample and room(seq) > 0
            chunks[-1] = Chunk(following, c.start, seq.blocks, want)
            rows.extend(range(q0, q0 + kept))
            ids.extend(following)
            if want:
                wanting.append((seq, c.start + kept - 1))  # its last kept position
        if not rows:
            return
        graphs = self.graphs.get(replayed.q) if replayed is not None else None
        if graphs is not None:  # the hidden states are in the replayed step's slabs
            last, tokens = graphs.replay(chunks)
        else:
            hidden = self.hidden.index_select(0, torch.tensor(rows, device=self.cache.device))
            last = self._forward([c for c in chunks if c is not None], ids, hidden)
            tokens = self.layer.logits(last).argmax(dim=-1)
        drafts = tokens.tolist()
        for (seq, _), token in zip(wanting, drafts, strict=True):
            seq.draft = [int(token)]
        self._chain(wanting, last, scheduler, room)

    def launch(self, chunks: list[Chunk], replayed: DecodeGraphs) -> EarlyPass | None:
        """Queue the layer's pass right behind a replayed decode or verify step of plain greedy
        requests (``chunks``, the step's, in ``replayed``'s slabs), before the host has its
        tokens: on the device, each slab's greedy tokens (the logits' argmax), the drafts they
        accept (while a token equals the draft after it) and so its kept positions, which
        become the pass's tokens (the token at position ``p + 1`` is the target's argmax at
        ``p`` wherever ``p`` is kept), lengths and cache slots (the rest on the scratch
        block). ``None`` when no graphs of this slab were captured."""
        import torch

        graphs = self.graphs.get(replayed.q)
        if graphs is None:
            return None
        q = replayed.q
        batch = replayed.bucket(len(chunks))
        slab = replayed.outputs[batch].argmax(dim=-1).view(batch, q)  # the greedy tokens
        inputs, lengths, _ = replayed.slabs(batch)  # the step's tokens and lengths
        col = torch.arange(q, device=slab.device)
        match = (slab[:, :-1] == inputs[0, :, 1:]) & (col[None, 1:] < lengths[:, None])
        kept = 1 + match.long().cumprod(dim=1).sum(dim=1)  # [batch]

        def prepare(bucket: int) -> None:  # after run's fill of the step's positions
            ids, lens, seq_lens = graphs.slabs(bucket)
            ids[0].copy_(slab)
            lens.copy_(kept)
            seq_lens.copy_(ids[1, :, 0] + kept)
            ids[2].masked_fill_(col[None, :] >= kept[:, None], graphs.scratch_slot)

        _, (hidden, proposed) = graphs.run(chunks, prepare)
        last_rows = torch.arange(batch, device=slab.device) * q + kept - 1
        packed = torch.cat([slab.reshape(-1), proposed.index_select(0, last_rows)])
        return EarlyPass(q, batch, packed, hidden.index_select(0, last_rows))

    def finish(self, early: EarlyPass, plan: list[Scheduled], accepted: dict[int, int],
               scheduler: Scheduler, room: Callable[[Sequence], int]) -> None:
        """Set the drafts of ``plan``'s decoding requests from the pass ``launch`` queued
        (``accepted``: the drafts the host accepted, as the device did), up to ``room(seq)``
        each: the first from it, the others as :meth:`after` makes them."""
        import torch

        drafts = early.drafts()
        wanting: list[tuple[Sequence, int]] = []
        rows: list[int] = []
        for i, p in enumerate(plan):
            c, seq = p.chunk, p.seq
            if seq.state.finished or seq not in scheduler.running or room(seq) <= 0:
                continue
            kept = len(c.token_ids) - c.draft + accepted.get(id(seq), 0)
            seq.draft = [drafts[i]]
            wanting.append((seq, c.start + kept - 1))
            rows.append(i)
        if wanting and self.k > 1:
            last = early.last.index_select(0, torch.tensor(rows, device=early.last.device))
            self._chain(wanting, last, scheduler, room)

    def _chain(self, wanting: list[tuple[Sequence, int]], hidden: Any, scheduler: Scheduler,
               room: Callable[[Sequence], int]) -> None:
        """Drafts after the first: the layer one position on per round, fed its own output
        (``hidden``: a row per ``wanting`` request) and the draft before, while a request has
        room and its blocks hold the position."""
        import torch

        active = wanting
        for j in range(1, self.k):
            keep = [i for i, (seq, pos) in enumerate(active)
                    if room(seq) > j and scheduler.reserve(seq, pos + j + 1)]
            if not keep:
                return
            active = [active[i] for i in keep]
            hidden = hidden.index_select(0, torch.tensor(keep, device=hidden.device))
            chunks = [Chunk([seq.draft[-1]], pos + j, seq.blocks, True) for seq, pos in active]
            hidden = self._forward(chunks, [seq.draft[-1] for seq, _ in active], hidden)
            for (seq, _), token in zip(active, self.layer.logits(hidden).argmax(-1).tolist(),
                                       strict=True):
                seq.draft.append(int(token))

    def _forward(self, chunks: list[Chunk], ids: list[int], hidden: Any) -> Any:
        """The layer over ``chunks`` (the next tokens ``ids``, the hidden states before them
        [T, H]): its output rows at the sampling chunks' last positions [R, H]."""
        import torch

        layout = self.cache.layout(chunks)
        embeds = self.layer.inputs(torch.tensor(ids, device=hidden.device), hidden)
        with torch.inference_mode():
            out = self._block(layout, embeds)
        return out.index_select(0, layout.logits_index)

    def _slabs(self, layout: KernelLayout) -> tuple[Any, Any]:
        """The layer over a decode graph's static ``layout``, the hidden states read in place
        from the buffer's first rows: its output row per token [T, H] and the draft token
        each row predicts [T] (what ``capture`` records)."""
        tokens = layout.input_ids.shape[1]
        out = self._block(layout, self.layer.inputs(layout.input_ids[0], self.hidden[:tokens]))
        return out, self.layer.logits(out).argmax(dim=-1)

    def _block(self, layout: Any, embeds: Any) -> Any:
        """The layer's block over ``embeds`` [1, T, H] in ``layout``: [T, H]."""
        with self.cache.step(layout):
            return self.layer.block.model(
                inputs_embeds=embeds, position_ids=layout.position_ids,
                attention_mask=self._no_mask, use_cache=True, **{self._cache_kwarg: self.cache},
            ).last_hidden_state[0]


class EarlyPass:
    """The MTP layer's pass :meth:`MtpDrafts.launch` queued behind a replayed step: on the
    device ``packed`` (each slab row's greedy token, then each slab's first draft) and
    ``last`` (the layer's output at each slab's last kept row, [batch, H]); one copy to the
    host serves the step's tokens and the drafts."""

    def __init__(self, q: int, batch: int, packed: Any, last: Any) -> None:
        self.q, self.batch, self.packed, self.last = q, batch, packed, last
        self._host: list[int] | None = None

    def _fetch(self) -> list[int]:
        if self._host is None:
            self._host = self.packed.tolist()
        return self._host

    def tokens(self, chunks: list[Chunk]) -> list[int]:
        """The greedy token of every logits row the step keeps (``Chunk.rows`` of each chunk,
        in order: what ``sampler.greedy_tokens`` gives)."""
        host, q = self._fetch(), self.q
        return [host[i * q + r] for i, c in enumerate(chunks)
                for r in range(len(c.token_ids) - c.rows, len(c.token_ids))]

    def drafts(self) -> list[int]:
        """Each slab's first draft, request by request."""
        return self._fetch()[self.batch * self.q :]


def _following(seq: Sequence, start: int, count: int, held: int | None) -> list[int]:
    """The tokens at positions ``start + 1`` to ``start + count`` of ``seq`` (its prompt, its
    output, then ``held`` when given), fewer where they do not exist yet; read in place, not
    from a copy of the whole sequence."""
    prompt, output = seq.state.prompt, seq.state.tokens
    low, high, n = start + 1, start + count + 1, len(prompt)
    got = prompt[low:high] + output[max(low - n, 0) : max(high - n, 0)]
    if held is not None and len(got) < count and low + len(got) == n + len(output):
        got.append(held)
    return got

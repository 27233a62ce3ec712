"""The wave engine: waves of requests, prefill then decode, on a transformers causal LM.

A background thread takes up to ``max_batch_size`` queued requests (and at most
``max_num_tokens`` prompt tokens), left-pads them into one prefill forward over a
``DynamicCache``, then runs one decode forward per step until every request of the wave has
stopped. Requests that arrive during a wave wait for the next one. A wave also fits the KV
cache pool (``EngineConfig.kv_capacity_tokens``): each request reserves the tokens it may fill.

The continuous engine (``dwdp.worker.engine.continuous``) replaced it in the worker; it stays
as the baseline ``bench/gpu_serve.py`` measures against, in the same run.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

from dwdp.worker.engine.base import EngineBase, EngineConfig
from dwdp.worker.engine.protocol import RequestError, SamplingParams
from dwdp.worker.engine.requests import RequestState
from dwdp.worker.engine.sampler import choose
from dwdp.worker.engine.stats import EngineStats

__all__ = ["BatchingEngine", "EngineConfig", "EngineStats"]


class BatchingEngine(EngineBase):
    """The wave engine of one rank (implements ``EngineClient``; see ``EngineBase``)."""

    _wave: tuple[RequestState, ...] = ()

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """``EngineBase.validate``, and a prompt must fit one forward (no chunked prefill)."""
        super().validate(prompt_token_ids, params)
        if len(prompt_token_ids) > self.config.max_num_tokens:
            raise RequestError(
                f"prompt: {len(prompt_token_ids)} tokens > max_num_tokens "
                f"{self.config.max_num_tokens}"
            )

    def _run_states(self, states: list[RequestState]) -> None:
        """The batch API runs its requests as one wave on the calling thread."""
        self._run_wave(states)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                continue
            wave = [r for r in self._take_wave(first) if not self._drop_if_aborted(r)]
            if not wave:
                continue
            self.stats.kv_tokens_in_use = sum(self._kv_tokens(r) for r in wave)
            self._wave = tuple(wave)
            self._run_wave(wave)
            self._wave = ()
            self.stats.kv_tokens_in_use = 0

    def _live_states(self) -> list[RequestState]:
        return list(self._wave)

    def _kv_tokens(self, req: RequestState) -> int:
        """The KV cache tokens ``req`` may fill: its prompt and every token it may
        generate, at most the model's context."""
        return min(len(req.prompt) + req.params.max_tokens, self.max_model_len)

    def _take_wave(self, first: RequestState) -> list[RequestState]:
        """``first`` and the queued requests that fit beside it: at most ``max_batch_size``
        requests, ``max_num_tokens`` prompt tokens and ``kv_capacity_tokens`` reserved KV
        tokens; the first that does not fit waits for the next wave."""
        wave = [first]
        tokens, reserved = len(first.prompt), self._kv_tokens(first)
        capacity = self.config.kv_capacity_tokens
        while len(wave) < self.config.max_batch_size:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                continue
            need = self._kv_tokens(nxt)
            if tokens + len(nxt.prompt) > self.config.max_num_tokens or (
                capacity is not None and reserved + need > capacity
            ):
                self._queue.put(nxt)  # next wave; order within a wave does not matter
                break
            wave.append(nxt)
            tokens += len(nxt.prompt)
            reserved += need
        return wave

    def _drop_if_aborted(self, req: RequestState) -> bool:
        if req.aborted:
            self._finish(req, "abort")
            return True
        return False

    def _run_wave(self, wave: list[RequestState]) -> None:
        import torch
        from transformers import DynamicCache

        self.stats.waves += 1
        width = max(len(r.prompt) for r in wave)
        ids = torch.full((len(wave), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(wave), width), dtype=torch.long)
        for i, req in enumerate(wave):
            ids[i, width - len(req.prompt) :] = torch.tensor(req.prompt, dtype=torch.long)
            mask[i, width - len(req.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in wave)
        device = self.model.device  # inputs are built on the host; the model may not be
        while True:
            out = self._forward(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                cache=cache,
                logits_to_keep=1,
            )
            for req in wave:
                if req.aborted:
                    self._finish(req, "abort")
            live = [i for i, r in enumerate(wave) if not r.finished]
            if not live or self._stopping.is_set():
                for req in wave:
                    self._finish(req, "abort")
                return
            ids = torch.full((len(wave), 1), self.pad_token_id, dtype=torch.long)
            choices = choose(out.logits[live, -1, :], [wave[i] for i in live])
            for i, choice in zip(live, choices, strict=True):
                ids[i, 0] = choice.token
                self._deliver(wave[i], choice)
            if all(r.finished for r in wave):
                return
            mask = torch.cat([mask, torch.ones((len(wave), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1

"""The generation engine of one rank: continuous batching over a paged KV cache.

``protocol`` holds the engine interface the HTTP server depends on (``EngineClient``:
generate, abort, check_health) and the values that cross it; ``base`` what every engine
shares (limits, counters, the request lifecycle, the one background thread); ``continuous``
the continuous-batching engine, over ``scheduler`` (who runs each step, how many tokens,
preemption), ``blocks`` (the block allocator), ``paged`` (the paged KV cache and the attention
that reads it), ``requests`` (one request's tokens, stop and streaming rules) and ``sampler``
(token choice, logprobs); ``kv_pool`` sizes the pool of KV tokens the engine admits requests
against. Loading the model is ``dwdp.worker.loading``; what a model is switched to on a GPU is
``dwdp.worker.gpu``.
"""

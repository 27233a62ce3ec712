"""The generation engine of one rank: a batching loop over a transformers causal LM.

``protocol`` holds the engine interface the server depends on (``EngineClient``: generate,
abort, check_health) and its value types; ``batching`` the engine (a background thread that
runs prefill and decode over waves of requests with transformers' logits processors);
``loader`` loads and checks a local Hugging Face checkpoint.
"""

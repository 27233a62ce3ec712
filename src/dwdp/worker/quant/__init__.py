"""Quantized checkpoints: what the worker runs besides bf16, fp16 and fp32 (``fp8``)."""

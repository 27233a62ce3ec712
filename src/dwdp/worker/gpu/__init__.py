"""What a model runs on a CUDA device: the model patches and the Triton kernel they use.

``cuda_path`` switches a loaded model to its GPU path once, before it serves
(``use_cuda_kernels``: experts through two grouped GEMMs, ``torch.compile``-d RMSNorm and
rotary embedding) and picks the SDPA kernels per attention call (``sdpa_backends``);
``moe_combine`` is the Triton kernel that sums each token's top-k expert rows. Nothing here
changes the CPU path; ``moe_combine`` imports triton and is imported only on a CUDA device.
The DWDP gather kernels (weights copied between ranks) are ``dwdp.kernels``.
"""

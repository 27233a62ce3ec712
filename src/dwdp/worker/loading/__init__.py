"""Loading a checkpoint on one rank: a local Hugging Face checkpoint, checked before any read.

``validate`` checks a checkpoint before any weight is read (``validate_checkpoint``: the
safetensors headers against the tensors of the model built on the meta device; names,
shapes, dtypes; ``CheckpointError``, one line); ``checkpoint`` loads a whole checkpoint
(``load_checkpoint``: model and tokenizer through transformers); ``tokenizer`` loads the
tokenizer alone (``load_tokenizer``, which both loads and the API server process use);
``sharded`` is a DWDP rank's load (``load_sharded``: the model built on the meta device,
every tensor read from the safetensors files, of each managed MoE layer only the expert rows
of this rank's range); ``load_vote`` is the group-wide vote after the load (``load_together``: a
rank whose load failed fails its whole group, every rank raising the same ``LoadError``). No
download: the checkpoint is a local directory.
"""

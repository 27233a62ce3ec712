"""dwdp.worker: the DWDP runtime, the engine glue and the HTTP server of one rank.

The runtime (stores, peer views, prefetch schedules, copy plans, the six-collective setup)
is device-independent; a device backend (``dwdp.worker.backend``) supplies memory,
streams, events and copies. Nothing here is imported by the operator.

Sub-packages, one concern each: ``backend`` (device memory, streams, copies),
``transport`` (the group's small-message collectives), ``models`` (architecture adapters),
``dense`` and ``expert`` (what each DWDP kind stores and copies), ``setup`` (the
fail-together setup collectives), ``schedule`` (when each prefetch slot is filled),
``loading`` (checkpoint checks, the load and its group vote), ``gpu`` (the model's CUDA
path), ``engine`` (continuous batching over a paged KV cache), ``server`` (the HTTP server),
``disagg`` (prefill/decode KV transfer). ``main`` runs one rank start to finish.
"""

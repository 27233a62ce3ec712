"""dwdp.worker: the DWDP runtime, the engine glue and the HTTP server of one rank.

The runtime (stores, peer views, prefetch schedules, copy plans, the six-collective setup)
is device-independent; a device backend (``dwdp.worker.backend``) supplies memory,
streams, events and copies. Nothing here is imported by the operator.
"""

"""Expert DWDP: each rank stores its range of routed experts; slots hold full tables.

``layout`` places every rank's expert chunks in its store and builds the copy plans that
fill a prefetch slot from the owners of each expert. The setup protocol is
``dwdp.worker.setup.expert``.
"""

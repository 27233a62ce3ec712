"""dwdp_dev: the development tooling of dwdp, a distribution apart from the product.

- ``dwdp_dev.devcluster``: the local control plane (``dwdp dev``): a Go multi-call binary of
  etcd and the Kubernetes control plane, its Python launcher, the process kubelet and the
  daemonless image builder.
- ``dwdp_dev.worker``: test and demo helpers of the worker (tiny checkpoints, the demo model,
  servers started by tests), the recording fake backend and the wave engine that benches
  compare against (``dwdp testing``).
- ``dwdp_dev.operator``: test helpers of the operator: the stand-in rank program (no model,
  no torch) and the helpers that run the operator as a process.
"""

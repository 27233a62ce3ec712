"""dwdp: DWDP (Distributed Weight Data Parallelism) for mixture-of-experts inference.

The product distribution holds one package, ``dwdp`` (src/dwdp): ``dwdp.api`` (settings, the
DwdpDeployment resource, the rank contract), ``dwdp.operator`` (the Kubernetes operator),
``dwdp.worker`` (the inference worker and the DWDP runtime) and ``dwdp.kernels`` (the gather
kernels). The local control plane and the test helpers are the development distribution
``dwdp-dev`` (tools/, package ``dwdp_dev``), never part of this one. See docs/design.md.
"""

__version__ = "0.1.0"

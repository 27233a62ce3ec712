"""dwdp: DWDP (Distributed Weight Data Parallelism) for mixture-of-experts inference.

The distribution holds one package (src/dwdp) whose sub-packages live in top-level folders of the
repository (DESIGN.md section 2): ``dwdp.api`` (api/), ``dwdp.operator`` (operator/),
``dwdp.worker`` (worker/), ``dwdp.kernels`` (kernels/) and ``dwdp.devcluster``
(tools/devcluster/).
"""

__version__ = "0.1.0"

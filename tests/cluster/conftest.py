"""Fixtures of the cluster tests: a real local control plane (tools/devcluster).

``cluster``, ``process_cluster``, ``operator_image`` and ``worker_image`` (session) and
``namespace`` (per test)
come from dwdp_dev.devcluster.testing, where their contract is written down.
"""

from dwdp_dev.devcluster.testing import (
    cluster,
    namespace,
    operator_image,
    process_cluster,
    worker_image,
)

__all__ = ["cluster", "namespace", "operator_image", "process_cluster", "worker_image"]

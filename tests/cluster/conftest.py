"""Fixtures of the cluster tests: a real local control plane (tools/devcluster).

``cluster`` (session) and ``namespace`` (per test) come from dwdp.devcluster.testing,
where their contract is written down.
"""

from dwdp.devcluster.testing import cluster, namespace

__all__ = ["cluster", "namespace"]

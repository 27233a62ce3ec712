"""dwdp.operator: the kopf operator that runs DwdpDeployments as DWDP groups of pods.

Layers, from the outside in: :mod:`~dwdp.operator.cli` (``dwdp operator``) and
:mod:`~dwdp.operator.handlers` (kopf settings and thin handlers) start one reconcile loop per
deployment (:mod:`~dwdp.operator.reconcile`: gather -> plan -> apply); the pure
:func:`~dwdp.operator.plan.plan` decides from :mod:`~dwdp.operator.observe` summaries using
the group lifecycle (:mod:`~dwdp.operator.group`), :mod:`~dwdp.operator.builders`,
:mod:`~dwdp.operator.status`, :mod:`~dwdp.operator.conditions`, :mod:`~dwdp.operator.naming`,
:mod:`~dwdp.operator.revision` and :mod:`~dwdp.operator.constants`; only
:mod:`~dwdp.operator.kube` talks to the API. Importing this package imports nothing heavy.
"""

"""DWDP setup: the collectives that make every rank commit together or fail together.

``phases`` names the phases, the errors and the failure-injection hook and runs a phase's
work and vote (``run_phase``), ``group_vote`` the one collective each phase ends with,
``dense`` the six-collective dense setup P1-P6 (docs/design.md §6.3), ``expert`` the expert
setup (handshake, allocation vote, peer mapping, final vote) and
``expert_repoint`` its gather check, repoint and drop, ``scalars`` the exchange of the
per-layer scalars every rank must agree on, ``attached`` both setups in order on one model.
What each setup builds lives with its kind (``dwdp.worker.dense``, ``dwdp.worker.expert``);
the resident bytes both report are ``dwdp.worker.resident``. The load's vote, which follows
the same fail-together rule, is ``dwdp.worker.loading.load_vote``.
"""

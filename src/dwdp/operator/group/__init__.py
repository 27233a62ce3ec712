"""The group lifecycle: one DWDP group, a unit of pods whose ranks start, commit, serve,
fail and restart together, and the rollout that replaces groups whole.

An incarnation of a group is created with its gang (:mod:`.create`), waits for scheduling
and the rendezvous of its ranks, opens its commit gate once every rank committed
(:mod:`.verdict`, :mod:`.commit`), fails together and restarts after a backoff
(:mod:`.failure`, :mod:`.restart`), and is drained by the rollout (:mod:`.drain`,
:mod:`.rollout`). :func:`.step.decide_group` picks one group's case; :func:`.role.decide_role`
runs every group of a role, then its rollout step. Every function is pure: no I/O, no
clock (``now`` is an argument); :mod:`.state` holds the values they read and return.
"""

"""DWDP setup: the collectives that make every rank commit together or fail together.

``phases`` names the phases and the errors, ``inject`` the failure-injection hook,
``vote`` the one collective each phase ends with, ``dense`` the six-collective dense
setup P1-P6 (docs/design.md §6.3), ``expert`` the expert setup (handshake, allocation vote,
peer mapping, final vote) and ``status`` the per-rank resident bytes.
"""

"""dwdp.api: the one source of truth for valid DWDP settings and DwdpDeployments.

Depends only on pydantic and PyYAML, so the operator, the worker and the CLI share it.
"""

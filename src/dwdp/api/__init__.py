"""dwdp.api: the one source of truth for valid DWDP settings and DwdpDeployments.

Depends only on pydantic and PyYAML, so the operator, the worker and the CLI share it.

- ``dwdp.api.enums``: CopyMode, GatherKernel, HandleType, Role, Transport, DenseMode.
- ``dwdp.api.partition``: expert_partition, ExpertPartition, PartitionKind, PartitionError.
- ``dwdp.api.config``: DwdpConfig (docs/design.md §3.1).
- ``dwdp.api.launch``: LaunchConfig, validate_launch / launch_problems (3.2), roles.
- ``dwdp.api.support``: the settings this worker does not run (refused everywhere alike).
- ``dwdp.api.deployment``: the DwdpDeployment spec and status (3.3), deployment_problems,
  launch_config_for.
- ``dwdp.api.placement``: image pull Secrets, Affinity and GpuSpec (device plugin or DRA)
  of the worker pods.
- ``dwdp.api.names``: Kubernetes name formats (DNS-1123 names, qualified names) and their
  rule in words.
- ``dwdp.api.crd``: the CRD generated from the models (``dwdp crd``).
- ``dwdp.api.errors``: Problem (field path, value, rule) and DwdpValidationError.
- ``dwdp.api.contract``: the rank contract (pod environment names, ``/dwdp/status`` phases,
  termination-message words) the operator, the worker and the test rank program share.

This package imports nothing at import time; import the module you need.
"""

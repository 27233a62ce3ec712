"""The command line and environment of a vLLM generation server (``spec.generation.vllm``),
as pure functions; :func:`dwdp.operator.builders.worker_pod` puts them in the pod.

A vLLM generation pod runs vLLM 0.32.0's OpenAI server as a module (``python3 -m
vllm.entrypoints.openai.api_server``: the ``vllm serve`` console script is broken on the CPU
wheel) on the pod's address and ``server.port`` (the port the router's decode URLs name, as
for dwdp generation servers), serving the mounted checkpoint (``model.path``, the string the
context ranks hash as vLLM's ``--model``) under the name the context ranks answer to. Its NIXL
connector is a ``kv_consumer`` with host buffers (``kv_buffer_device: cpu``): the context ranks
speak vLLM's CPU attention layout only (``dwdp.worker.disagg.vllm_nixl``), so the vLLM servers
run on CPU. The API key reaches vLLM as ``VLLM_API_KEY`` from the Secret
``server.apiKeySecretRef`` names (a rotated key reaches a vLLM server when its pod is replaced:
vLLM reads it once). Invariant: nothing here reads the cluster or the clock.
"""

from __future__ import annotations

import json
from typing import Any

from dwdp.api.deployment import DwdpDeploymentSpec, VllmGenerationSpec
from dwdp.api.launch import served_model_name

__all__ = [
    "API_KEY_ENV",
    "CONTAINER",
    "DEFAULT_ENV",
    "HEALTH_PATH",
    "KV_TRANSFER_CONFIG",
    "MODULE",
    "POD_IP_ENV",
    "SIDE_CHANNEL_HOST_ENV",
    "vllm_args",
    "vllm_command",
    "vllm_env",
    "vllm_spec",
]

MODULE = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI server module (run with ``python3 -m``)."""
CONTAINER = "vllm"
"""Name of the one container of a vLLM generation pod."""
HEALTH_PATH = "/health"
"""vLLM's health endpoint (200 once the engine serves; open without the API key)."""
POD_IP_ENV = "POD_IP"
"""The pod's address (a fieldRef), which vLLM binds."""
API_KEY_ENV = "VLLM_API_KEY"
"""vLLM reads its API key from this variable (same as ``--api-key``)."""
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
"""The address of the vLLM server's own NIXL side channel: the pod's (vLLM's default is
localhost); the serving NetworkPolicy admits no peer to its port."""
DEFAULT_ENV = {"UCX_TLS": "tcp", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""Defaults of a vLLM pod that ``spec.env`` may override: NIXL's UCX over TCP (the context
ranks use TCP too: host memory, no RDMA), and no usage reports (a read-only root, and no
traffic out of the cluster)."""
KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_consumer",
    "kv_buffer_device": "cpu",
}
"""vLLM's ``--kv-transfer-config``: the NIXL connector as ``kv_consumer`` (it reads the KV the
context ranks prefilled), with host buffers (the vLLM servers run on CPU)."""


def vllm_spec(spec: DwdpDeploymentSpec) -> VllmGenerationSpec:
    """``spec.generation.vllm``; ``ValueError`` when the generation servers are not vLLM's."""
    if spec.vllm is None:
        raise ValueError("the spec's generation servers are not vLLM's (generation.vllm)")
    return spec.vllm


def vllm_command() -> list[str]:
    """The container's command: ``python3 -m vllm.entrypoints.openai.api_server``."""
    return ["python3", "-m", MODULE]


def vllm_args(spec: DwdpDeploymentSpec) -> list[str]:
    """The container's arguments: the checkpoint (``model.path``, mounted as for the dwdp
    pods), the name the context ranks answer to, the pod's address and ``server.port``,
    ``model.dtype`` (never auto: the API refuses it), the KV transfer config, and
    ``--disable-hybrid-kv-cache-manager`` when ``hybridKvCacheManager`` is false, then
    ``generation.vllm.args`` (which may repeat none of these: the API refuses them)."""
    vllm = vllm_spec(spec)
    args = [
        "--model",
        spec.model.path,
        "--served-model-name",
        served_model_name(spec.model.served_name, spec.model.path),
        "--host",
        f"$({POD_IP_ENV})",
        "--port",
        str(spec.server.port),
        "--dtype",
        spec.model.dtype,
        "--kv-transfer-config",
        json.dumps(KV_TRANSFER_CONFIG, sort_keys=True, separators=(",", ":")),
    ]
    if not vllm.hybrid_kv_cache_manager:
        args.append("--disable-hybrid-kv-cache-manager")
    return args + list(vllm.args or ())


def vllm_env(spec: DwdpDeploymentSpec) -> list[dict[str, Any]]:
    """The variables the operator sets on a vLLM container: the pod's address (twice: the
    ``--host`` it binds and its side channel's host) and, with ``server.apiKeySecretRef``,
    ``VLLM_API_KEY`` from that Secret key (a reference: the key never appears in the pod)."""
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    env: list[dict[str, Any]] = [
        {"name": POD_IP_ENV, "valueFrom": pod_ip},
        {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": pod_ip},
    ]
    ref = spec.server.api_key_secret_ref
    if ref is not None:
        key = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        env.append({"name": API_KEY_ENV, "valueFrom": key})
    return env

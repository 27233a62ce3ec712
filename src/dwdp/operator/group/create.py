"""Create one group incarnation: its rendezvous Secret, its gang PodGroup (all pods scheduled
together or none), its ComputeDomain (fabric groups across pods) and its pods."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dwdp.api.enums import Role
from dwdp.operator import builders, naming
from dwdp.operator.actions import Actions, Event
from dwdp.operator.constants import Reason
from dwdp.operator.group.state import RoleContext
from dwdp.operator.observe import ChildKey, ObservedPod

__all__ = [
    "create_incarnation",
    "next_incarnation",
]


def create_incarnation(
    ctx: RoleContext,
    index: int,
    inc: int,
    revision: str,
    pod_indices: Iterable[int],
    *,
    fresh: bool = True,
) -> Actions:
    """Pods of one incarnation, after its rendezvous Secret (without its value: the apply
    step adds a random one; Secrets are never listed, so it is always planned and the apply
    step skips one it already made), gang PodGroup and ComputeDomain (created only when not
    there yet); a CreatedGroup Event when ``fresh``."""
    group = naming.group_name(ctx.owner.name, ctx.role, index)
    create: list[dict[str, Any]] = []
    keep: set[ChildKey] = set()
    gang_name = cd_template = secret = None
    if ctx.rendezvous_secret:
        obj = builders.rendezvous_secret(
            ctx.owner, role=ctx.role, group_index=index, incarnation=inc
        )
        secret = obj["metadata"]["name"]
        create.append(obj)
    if ctx.options.gang and ctx.observed.gang:
        gang_name = naming.incarnation(group, inc)
        obj = builders.pod_group(
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            min_count=ctx.shape.pods_per_group,
        )
        keep.add(ChildKey("PodGroup", gang_name))
        if ChildKey("PodGroup", gang_name) not in ctx.observed.children:
            create.append(obj)
    if ctx.role is Role.CONTEXT and ctx.fabric_pods:
        obj = builders.compute_domain(
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            nodes=ctx.shape.pods_per_group,
        )
        key = ChildKey("ComputeDomain", obj["metadata"]["name"])
        keep.add(key)
        cd_template = naming.channel_claim_template(group, inc)
        if key not in ctx.observed.children:
            create.append(obj)
    pods = tuple(
        builders.worker_pod(
            ctx.spec,
            ctx.owner,
            role=ctx.role,
            group_index=index,
            incarnation=inc,
            pod_index=i,
            revision=revision,
            command=ctx.options.command,
            pod_group=gang_name,
            channel_template=cd_template,
            secret=secret,
        )
        for i in pod_indices
    )
    events: tuple[Event, ...] = ()
    if fresh:
        shape = ctx.shape
        message = (
            f"created {ctx.role.value} group {group} incarnation {inc} "
            f"({shape.pods_per_group} pods, {shape.world_size} ranks, revision {revision})"
        )
        events = (Event(Reason.CREATED_GROUP, message, group=group),)
    return Actions(create=tuple(create), pods=pods, events=events, keep=frozenset(keep))


def next_incarnation(pods: Iterable[ObservedPod], recorded: int | None) -> int:
    seen = [p.incarnation for p in pods]
    if recorded is not None:
        seen.append(recorded)
    return max(seen) + 1 if seen else 0

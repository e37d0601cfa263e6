"""What a joiner under survive (a restart, or a rank new to the run) takes over from its sharer beside the
parameters: the optimizer's and scheduler's state (its moments and learning rate, not a fresh optimizer's),
as a rank without a checkpoint part does. A sharded model's moments travel as the sharer's shard of them:
with sharded groups the sharer holds the joiner's shard index (flodl/sharding/optimizer_shard.py)."""

from __future__ import annotations

from typing import Any

from flodl.links.membership import AveragingGroup
from flodl.sharding.fsdp import is_sharded
from flodl.sharding.optimizer_shard import load_local_optimizer_state, local_optimizer_state
from flodl.worker.rank_state import restore_stepper, shared_state, stepper_state
from flodl.worker.stepper import Stepper


def joiners_state(stepper: Stepper) -> dict[str, Any]:
    """The sharer's side: its state a joiner takes (plain data and tensors, for broadcast_state)."""
    parts = stepper.parts
    shard = local_optimizer_state(parts.optimizer) if is_sharded(parts.model) else None
    return {**shared_state(stepper_state(stepper)), "optimizer_shard": shard}


def restore_joiner(stepper: Stepper, state: dict[str, Any]) -> None:
    """The joiner's side: `joiners_state` of its sharer put in place."""
    restore_stepper(stepper, state)
    if state["optimizer_shard"] is not None:
        load_local_optimizer_state(stepper.parts.optimizer, state["optimizer_shard"])


def share_with_joiners(
    stepper: Stepper, group: AveragingGroup, sharer: int, rank: int, joining: list[int]
) -> None:
    """Every member of `group` (this one: `rank`): the joiners (`joining`) take the `sharer`'s state; the
    other members keep their own."""
    mine = joiners_state(stepper) if rank == sharer else None
    state = group.broadcast_state(mine, group.members.index(sharer))
    if rank in joining:
        restore_joiner(stepper, state)

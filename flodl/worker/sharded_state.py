"""What a rank writes of a sharded checkpoint and reads back (the dir and its keys: flodl/checkpoints/
sharded.py): the model, the optimizer's state, an outer optimizer's momentum, each rank its shard of them.

Under local SGD the groups train apart, so each group's optimizer state is its own; a resume on other groups
gives group g saved group g mod G's (G: the groups saved), as a rank without a part of its own takes saved
rank r mod n's (flodl/job/resize.py): a state a real optimizer reached at this consensus, never an average
of several (an average of second moments is no optimizer's state), as a new replica group of torchft takes
a peer's. The groups past a smaller world's are left. Under survive each group saves on its own (its
process's world is the group): a checkpoint holds the states of the groups in at its round, and a group out
then takes one of theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flodl.averaging.flat import by_dtype
from flodl.checkpoints.sharded import (
    GROUPS_KEY,
    MODEL_KEY,
    OUTER_KEY,
    group_dir,
    optimizer_key,
    read,
    regrouped,
    save_of,
    saved_apart,
    saved_groups,
    saved_keys,
    source_group,
    write,
)
from flodl.sharding.fsdp import laid_out_as

log = logging.getLogger("flodl")


def _no_momentum() -> list[Tensor]:
    return []


@dataclass(frozen=True)
class ShardedState:
    """A rank's sharded state, built once by the assembly for the rank's policy and groups."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    rank: int
    # The group whose optimizer state this rank's is, of `groups` that each keep their own (local SGD); None:
    # every group steps one state (sync: HSDP).
    group: int | None = None
    groups: int = 1
    # The outer optimizer's momentum (DiLoCo, SlowMo), a tensor per trainable parameter in flat order
    # (averaging/flat.by_dtype), shaped as the rank holds it: views a resume fills in place.
    outer_momentum: Callable[[], list[Tensor]] = _no_momentum
    # Each group saves on its own, under its group dir (survive: the groups share no process group).
    apart: bool = False

    def save(self, path: Path) -> None:
        """Each rank's shard of the model, its group's optimizer state and the outer momentum under `path`
        (collective: every rank of the job together, or `apart` of its group; a sharded model's parameters are
        its shards)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(self.model)}
        if self.optimizer.state:  # empty (DiLoCo's reset, plain SGD): none (torch would make one up to write)
            state[optimizer_key(self.group)] = get_optimizer_state_dict(self.model, self.optimizer)
        if self.group is not None:
            state[GROUPS_KEY] = torch.tensor(self.groups)
        momentum = self._momentum()
        if momentum:
            state[OUTER_KEY] = momentum
        write(state, group_dir(path, self.group) if self.apart and self.group is not None else path)

    def load(self, path: Path) -> None:
        """This rank's shard of the optimizer's state and of the outer momentum from `path`, however the run
        is grouped now (the model was read whole before it was sharded)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        source = self._source(path)
        path = save_of(path, source)
        keys = saved_keys(path)
        key = optimizer_key(source)
        if key in keys:
            state = {key: get_optimizer_state_dict(self.model, self.optimizer)}  # its shapes now
            read(state, path)
            set_optimizer_state_dict(self.model, self.optimizer, state[key])
        else:  # the group's state was empty at the checkpoint
            self.optimizer.state.clear()
        momentum = self._momentum()
        if momentum and OUTER_KEY in keys:
            read({OUTER_KEY: momentum}, path)

    def _source(self, path: Path) -> int | None:
        """The saved group whose optimizer state this rank's group takes (None: the one of sync)."""
        saved = saved_groups(path)
        if self.group is None or saved is None:
            return None
        source = source_group(self.group, saved)
        if saved != tuple(range(self.groups)):
            log.info(
                "rank %d: group %d takes saved group %d's: %s",
                self.rank,
                self.group,
                source,
                regrouped(saved, self.groups, saved_apart(path)),
            )
        return source

    def _momentum(self) -> dict[str, Tensor]:
        """The outer momentum by parameter name, each laid out as its parameter (sharded or whole)."""
        views = self.outer_momentum()
        if not views:
            return {}
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        names = {id(p): name for name, p in named}
        params = [p for group in by_dtype(p for _, p in named) for p in group]
        return {names[id(p)]: laid_out_as(p, view) for p, view in zip(params, views, strict=True)}

"""Who an averager reduces with (`ReduceGroup`), chosen once by the assembly (flodl/worker/group.py), and
the fixed world (`WorldGroup`)."""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from flodl.averaging.reducer import CAPTURE_AFTER


class ReduceGroup(Protocol):
    """Who an averager reduces with, chosen once by the assembly (flodl/worker/group.py): the fixed world
    (`WorldGroup`), or survive's members, whose group a death or a restart replaces under a round."""

    # Eager rounds before a round weighted on the device is replayed from a CUDA graph (None: never; a graph
    # cannot follow a group to its next communicator).
    capture_after: int | None
    # How long a collective of the group may take (a cut round's thread ends within it).
    timeout_s: float

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        """The members' process group now (None: the world's) and its backend (None: torch knows it)."""
        ...

    def settle(self, work: dist.Work) -> None:
        """Wait for `work`, one of the group's collectives."""
        ...

    def share_before_start(self, tensors: list[Tensor]) -> None:
        """Every member starts from the first member's `tensors`: the world's as the averager is built;
        survive's members once their first group is formed (the worker's start shares then)."""
        ...

    def keep_round_start(self, tensors: list[Tensor]) -> None:
        """A round begins on `tensors`: what a cut round goes back to (a group that cuts no round keeps
        nothing)."""
        ...

    def back_to_round_start(self, tensors: list[Tensor]) -> None:
        """A round was cut: `tensors` go back to what `keep_round_start` kept (they may be its first ones
        only)."""
        ...


class WorldGroup:
    """A group whose members never change: the world, over its default process group or `process_group` (a
    gloo group of the same ranks for host tensors). A failed collective ends the run: no round is undone."""

    capture_after: int | None = CAPTURE_AFTER

    def __init__(self, process_group: dist.ProcessGroup | None = None, timeout_s: float = 1800.0) -> None:
        """`timeout_s`: the world's collective timeout (torch's default unless the run sets its own)."""
        self.process_group = process_group
        self.timeout_s = timeout_s

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        return self.process_group, None

    def settle(self, work: dist.Work) -> None:
        work.wait()

    def share_before_start(self, tensors: list[Tensor]) -> None:
        for tensor in tensors:  # over the default group: the host averager's gloo group spans the same ranks
            dist.broadcast(tensor, src=0)

    def keep_round_start(self, tensors: list[Tensor]) -> None:
        """Nothing: a failed round ends the run."""

    def back_to_round_start(self, tensors: list[Tensor]) -> None:
        raise RuntimeError("a fixed group cuts no round: there is no round start to go back to")


WORLD = WorldGroup()

"""Sharded groups under local SGD (shard_group=k > 1): a group's ranks step together (each FSDP2 forward
and backward is a collective of the group), so every member of a group trains as many batches in a window
as the others; pure.

ElChe sizes each rank's window from its speed; a group marches at its slowest member's pace, so each member
gets the least of the group's counts (`even_in_groups`). The planner hands out whole windows from counts
even in each group and splits an epoch's tail in proportion to them (largest remainder, ties to the lower
rank: a group's consecutive ranks stay together); with an epoch of whole groups of batches (`whole_groups`)
every window, the tail too, gives a group's members the same count.
"""

from __future__ import annotations

from collections.abc import Sequence


def even_in_groups(counts: Sequence[int], size: int) -> list[int]:
    """Each rank's count made its group's least (groups of `size` consecutive ranks)."""
    if size < 1 or len(counts) % size:
        raise ValueError(f"{len(counts)} counts do not form groups of {size}")
    return [min(counts[start : start + size]) for start in range(0, len(counts), size) for _ in range(size)]


def whole_groups(batches: int, size: int) -> int:
    """An epoch's batches that groups of `size` ranks train in step: the last `batches % size` are left out,
    as the sub-batch remainder of an epoch is."""
    return batches - batches % size

"""The seats of a fault_tolerance=survive job that may grow (launch.max_ranks): a rank started later
(`flodl-join`) takes a free seat past the ranks the job started with.

A seat is free when no rank took it yet, or the last rank that took it left: cut by the coordinator, or its
process ended under flodl-join's supervisor (whichever is first says so). Each taking is numbered: the rank's
incarnation in that seat, which its Joined, its cut and its exit carry. The keys live at the root of the run's
store and a seat is taken with compare_set, so two joiners never take the same seat.
"""

from __future__ import annotations

import uuid

from torch.distributed import Store


def _taken_key(seat: int) -> str:
    return f"flodl/seat/{seat}/taken"  # "<number>:<token>": its latest taking, and whose


def _left_key(seat: int) -> str:
    return f"flodl/seat/{seat}/left"  # "<number>": the taking whose rank left


def take_seat(store: Store, first: int, capacity: int) -> tuple[int, int] | None:
    """Take the lowest free seat of `first`..`capacity`-1: (seat, its incarnation); None when none is free."""
    token = uuid.uuid4().hex
    for seat in range(first, capacity):
        taken, left = _taken_key(seat), _left_key(seat)
        if store.check([taken]):
            latest = store.get(taken).decode()
            number = int(latest.split(":")[0])
            if not store.check([left]) or int(store.get(left)) != number:
                continue  # its rank is still in
            expected, number = latest, number + 1
        else:
            expected, number = "", 0
        wanted = f"{number}:{token}"
        # The token makes the value this joiner's alone: another that took the seat first leaves its own.
        if store.compare_set(taken, expected, wanted).decode() == wanted:
            return seat, number
    return None


def seat_left(store: Store, seat: int, incarnation: int) -> None:
    """The rank that took `seat` as `incarnation` is gone: the seat is free (a no-op for a seat of the ranks
    the job started with, which no joiner takes)."""
    store.set(_left_key(seat), str(incarnation))


def count_start(exchange: Store, rank: int) -> int:
    """Number one more start of `rank` (0: its first) in the run's exchange: how a rank started apart, or the
    supervisor that starts it there (flodl/launcher/apart.py), learns its incarnation, so that a scheduler
    starting it again continues the count."""
    return exchange.add(f"incarnation/{rank}", 1) - 1

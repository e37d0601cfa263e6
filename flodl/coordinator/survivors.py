"""What the surviving roster (flodl/coordinator/roster.py) records and posts: how each membership change
went, and each cut.

A cut is posted in the store, where the self-launch supervisor reads it and kills the process (a hung rank
must not hold its peers' collectives), and the rank's inbox is emptied so that a restarted process never
reads what was meant for the dead one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import Store

from flodl.links.membership import cut_key
from flodl.links.seats import seat_left
from flodl.links.transport import inbox

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class SurviveSettings:
    # Fewer members than this stops the run with an error (its last consensus saved).
    min_ranks: int
    # The most ranks the run holds at once: seats past the ones it started with take ranks that join later.
    capacity: int
    # Ranks per sharded group (shard_group): a rank's death takes its group out.
    shard_group: int = 1


@dataclass
class MembershipChange:
    """One cut or admission, timed on rank 0's clock from its detection (a cut) or the admission order."""

    kind: str  # "cut" or "admitted"
    rank: int
    generation: int
    members: list[int]
    why: str
    started: float = field(default_factory=time.perf_counter)
    # The same instant as a wall-clock time (what an outside observer, a benchmark killing ranks, reads).
    wall: float = field(default_factory=time.time)
    # The members that formed the new group, and how long they took to let go of the old one and form it.
    formed: dict[int, tuple[float, float]] = field(default_factory=dict)
    formed_at: float | None = None
    # When a round first closed in this change's group, or a later one's (its first good round).
    first_round_at: float | None = None
    # An admission: the restarted process's start-up, and how long it then waited for a round boundary.
    startup_s: float | None = None
    waited_s: float | None = None

    def on_formed(self, rank: int, release_ms: float, form_ms: float) -> None:
        self.formed[rank] = (release_ms, form_ms)
        if set(self.formed) >= set(self.members):
            self.formed_at = time.perf_counter()

    def on_good_round(self, generation: int) -> None:
        """A round closed in group `generation`: the first in this change's group or after it marks it."""
        if self.first_round_at is None and generation >= self.generation:
            self.first_round_at = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.formed_at is not None and self.first_round_at is not None

    def event(self) -> dict[str, Any]:
        """The change as the timeline records it (seconds after it began). A change that the next one overtook
        before its group formed, or before a round closed in it, has those times as None."""

        def after(at: float | None) -> float | None:
            return None if at is None else at - self.started

        return {
            "event": f"rank_{self.kind}",
            "rank": self.rank,
            "at": self.wall,
            "why": self.why,
            "generation": self.generation,
            "members": self.members,
            "release_ms": max((r for r, _ in self.formed.values()), default=None),
            "form_ms": max((f for _, f in self.formed.values()), default=None),
            "formed_s": after(self.formed_at),
            "first_round_s": after(self.first_round_at),
            **({"startup_s": self.startup_s, "waited_s": self.waited_s} if self.kind == "admitted" else {}),
        }

    def line(self, run_ended: bool = False) -> str:
        """The change as the console says it; one not done was overtaken by the next, or `run_ended` first."""
        e = self.event()
        verb = "cut out" if self.kind == "cut" else "admitted"
        what = f"rank {self.rank} {verb} ({self.why}): members {self.members}"
        if not self.done:
            by = "the run's end" if run_ended else "the next change"
            return f"{what}; overtaken by {by} before its first good round"
        return (
            f"{what}; group re-formed {e['formed_s']:.2f} s after (release {e['release_ms']:.0f} ms, form "
            f"{e['form_ms']:.0f} ms), first good round {e['first_round_s']:.2f} s after"
        )


def root_store(store: Store) -> Store:
    """The run's store itself, under the prefix a mailbox uses: where the supervisor's keys are."""
    return getattr(store, "underlying_store", store)


def post_cut(store: Store, rank: int, incarnation: int) -> None:
    """Tell the supervisor to end the cut process, free its seat, and empty its inbox."""
    root_store(store).set(cut_key(rank), str(incarnation))
    seat_left(root_store(store), rank, incarnation)
    store.delete_key(inbox(rank))


def was_cut(store: Store, rank: int, incarnation: int) -> bool:
    """Whether post_cut cut the process `incarnation` of `rank`: a rank no supervisor ends (started apart)
    asks, as it waits for work, once it can reach the store again (a partition healed, a freeze over)."""
    key = cut_key(rank)
    return root_store(store).check([key]) and root_store(store).get(key).decode() == str(incarnation)

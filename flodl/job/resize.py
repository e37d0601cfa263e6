"""A checkpoint resumed on another number of ranks (pure): which saved part each rank restores, what the
global batch becomes, and the line that says so.

Every checkpoint is taken where the ranks hold one consensus (flodl/coordinator/commit.py), and an epoch's
order is one permutation shared by every rank, planned from where the checkpoint stands: the model, the
schedule's clock, the outer optimizer and the rest of the epoch belong to no rank, so any number of ranks
resumes them. What belongs to a rank is its part's optimizer state, RNG streams, counters and (reading a
stream) its readers' positions:

- a rank the checkpoint has a part for restores its own;
- under sync every rank steps one optimizer state, so a rank without a part takes the first part's
  (not its RNG streams);
- under local SGD (cadence, async) each rank's moments are its own: a rank without a part takes the optimizer
  and scheduler state of saved rank `rank mod parts` (`source`). Such a state is one a real optimizer reached
  on this run's data at this consensus; an average of several ranks' second moments is no optimizer's
  state, and a fresh optimizer's first steps (Adam's bias correction on empty moments) are the largest of
  the run. Its wire's error feedback (what that rank's earlier rounds left out) stays that rank's: the new
  rank starts with none;
- a stream's readers stand at positions of the saved world's split of its shards: another world would
  read them split otherwise, so a stream resumes only on the world that wrote it (`stream_problem`).

The global batch (sync) follows the new world, the learning rate by `lr_scale_ratio` as when a survive run
loses a rank, or with `keep_global_batch` stays the saved one: each rank then steps `grad_accum` micro-batches
enough to make it up (`grad_accum_for`), refused where the saved batch does not divide among the new ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flodl.config.layout import Layout


@dataclass(frozen=True)
class Resize:
    """A checkpoint of `parts` (the members at its round, of a world of `saved_world`) resumed on `world`."""

    saved_world: int
    parts: tuple[int, ...]
    world: int
    # Every rank steps the same optimizer state (sync).
    shares_optimizer: bool

    @property
    def changed(self) -> bool:
        return self.world != self.saved_world

    def owns(self, rank: int) -> bool:
        """The rank restores its own part (its RNG streams, counters and readers too)."""
        return rank in self.parts

    def source(self, rank: int) -> int:
        """The saved part a rank restores from: its own, else the first (sync) or the one by index."""
        if self.owns(rank):
            return rank
        if self.shares_optimizer:
            return self.parts[0]
        return self.parts[rank % len(self.parts)]

    def words(self) -> str:
        """What was resized, for the run's first lines and plan=true."""
        new = [rank for rank in range(self.world) if not self.owns(rank)]
        left = [rank for rank in self.parts if rank >= self.world]
        said = [f"resumed {self.saved_world} ranks' checkpoint on {self.world}"]
        if new:
            took = "rank 0's" if self.shares_optimizer else f"saved rank (r mod {len(self.parts)})'s"
            said.append(f"{_ranks(new)} {'starts' if len(new) == 1 else 'start'} with {took} optimizer state")
        if left:
            said.append(
                f"{'the part' if len(left) == 1 else 'the parts'} of {_ranks(left)} "
                f"{'is' if len(left) == 1 else 'are'} left (RNG streams and counters)"
            )
        return "; ".join(said)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def grad_accum_for(layout: Layout, world: int, batch_size: int) -> int | None:
    """Micro-batches per rank step that keep `layout`'s global batch on `world` ranks; None: it does not
    divide."""
    step = layout.member_step(world, batch_size)
    return None if step is None else step // batch_size


def keep_batch_problem(layout: Layout, world: int, batch_size: int) -> str | None:
    """Why `keep_global_batch` cannot keep the checkpoint's global batch on `world` ranks (None: it can)."""
    if grad_accum_for(layout, world, batch_size) is not None:
        return None
    fits = [
        n for n in range(1, layout.global_batch // batch_size + 1) if grad_accum_for(layout, n, batch_size)
    ]
    return (
        f"keep_global_batch=true: the checkpoint's global batch of {layout.global_batch} "
        f"({layout.world} ranks) does not divide into whole micro-batches of batch_size={batch_size} on "
        f"{world} ranks; resume on {' or '.join(map(str, fits))} ranks, or let the global batch follow the "
        "world (keep_global_batch=false)"
    )


def resumed_layout(fresh: Layout, saved: dict[str, Any] | None, members: int) -> Layout:
    """The layout of a run that would be laid out `fresh` on its world, resumed from a checkpoint's
    coordinator state `saved` with the parts of `members` ranks (None: a fresh run): its own, unless it
    keeps the global batch, which is then the checkpoint's."""
    if saved is None or not fresh.kept:
        return fresh
    return Layout.saved(saved, members, fresh.step, kept=True)


def stream_problem(saved_world: int, world: int) -> str | None:
    """A stream's readers resume only on the world whose split of its shards they stand at."""
    if saved_world == world:
        return None
    return (
        f"task.train_data is a stream: its readers' positions belong to {saved_world} ranks' split of its "
        f"shards, and {world} ranks would read them split otherwise (items of the interrupted pass read "
        f"twice or never); resume with {saved_world} ranks, or start fresh with resume=never"
    )

"""Lock-step epochs under fault_tolerance=survive (policy=sync): which picks each member trains, and how the
rest of an epoch is planned again when a member is cut in the middle of it (pure).

DDP steps every member together, so every member of a plan trains the same number of steps. An epoch opens
as equal whole-step slices of its permutation, one per member (as without survive): its first segment. When
the members change after `k` steps of a segment, whatever no member trained yet (each old member's picks from
step `k` on, a cut member's included) is cut again into equal whole-step shares of the new members: the next
segment. Every pick of an epoch is trained once, but for less than one global step's worth at each cut's
tail, dropped as an epoch's sub-step remainder always is.

Every member reports each segment it trained in (a ChunkReport of its generation), up to where the members
agreed the segment ended. A member cut in a segment never reports it: its steps there were trained with the
others, but it died before saying so. What the ledger waits for is what the reporting members trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flodl.config.layout import Layout
from flodl.counting import shown_epoch
from flodl.data.partition import equal_slices
from flodl.links.messages import EpochSlice


@dataclass(frozen=True)
class Segment:
    epoch: int
    generation: int
    members: tuple[int, ...]
    # Steps of the epoch the members trained before this segment.
    first_step: int
    steps: int
    # Each member's picks, `steps` whole steps of them, in training order.
    shares: dict[int, tuple[EpochSlice, ...]]
    # Picks left over that make no whole step of every member (not trained this epoch).
    dropped: int = 0
    # Samples of each member's step (keep_global_batch: the global step cut among fewer or more members).
    step_samples: int = 0

    @property
    def end_step(self) -> int:
        return self.first_step + self.steps


def opening_segment(
    epoch: int, total_picks: int, members: Iterable[int], step_samples: int, generation: int
) -> Segment:
    ordered = tuple(sorted(members))
    slices = equal_slices(total_picks, len(ordered), step_samples, epoch)
    shares: dict[int, tuple[EpochSlice, ...]] = {
        rank: (part,) for rank, part in zip(ordered, slices, strict=True)
    }
    dropped = total_picks - len(ordered) * slices[0].size
    steps = slices[0].size // step_samples
    return Segment(epoch, generation, ordered, 0, steps, shares, dropped, step_samples)


@dataclass(frozen=True)
class KeptBatch:
    """keep_global_batch: the run's layout (its global batch) kept by every membership, in whole
    micro-batches of `batch_size` where it divides."""

    layout: Layout
    batch_size: int

    def step_for(self, members: int, fallback: int) -> int:
        """Each member's step: its part of the global step, or `fallback` where that does not divide (the
        global batch then follows the world)."""
        step = self.layout.member_step(members, self.batch_size)
        return fallback if step is None else step


def laid_out(
    epoch: int,
    total_picks: int,
    members: Iterable[int],
    step_samples: int,
    generation: int,
    layout: Layout | None,
) -> Segment:
    """`epoch` opened as `members` train it when each of their steps holds several of a step of the world
    the run was laid out for (keep_global_batch on fewer ranks than that world; `layout` None: the global
    batch follows the world): the epoch as that world would open it, each of its global steps cut among
    `members`."""
    ordered = tuple(sorted(members))
    if layout is None or layout.step == step_samples or len(ordered) * step_samples % layout.step:
        return opening_segment(epoch, total_picks, ordered, step_samples, generation)
    world = layout.world_of(len(ordered), step_samples)
    saved = opening_segment(epoch, total_picks, range(world), layout.step, generation)
    return regrouped(saved, 0, ordered, step_samples, generation)


def regrouped(
    segment: Segment, trained_steps: int, members: Iterable[int], step_samples: int, generation: int
) -> Segment:
    """keep_global_batch: what `segment`'s members did not train in its first `trained_steps` steps, each of
    its global steps kept whole (every member's piece of it, in member order) and cut into equal parts of
    `step_samples` for `members`: the run's global steps, and so its trajectory, stay the same."""
    ordered = tuple(sorted(members))
    old_step = segment.step_samples
    if trained_steps == segment.steps:  # nothing left: no step to cut
        empty: dict[int, tuple[EpochSlice, ...]] = {rank: () for rank in ordered}
        first = segment.first_step + trained_steps
        return Segment(segment.epoch, generation, ordered, first, 0, empty, segment.dropped, step_samples)
    if len(ordered) * step_samples != len(segment.members) * old_step:
        raise ValueError(
            f"{len(segment.members)} steps of {old_step} make no {len(ordered)} equal steps of {step_samples}"
        )
    shares: dict[int, list[EpochSlice]] = {rank: [] for rank in ordered}
    for step in range(trained_steps, segment.steps):
        whole = tuple(
            piece
            for rank in segment.members
            for piece in _window(segment.shares[rank], step * old_step, old_step)
        )
        for i, rank in enumerate(ordered):
            shares[rank].extend(_window(whole, i * step_samples, step_samples))
    steps = segment.steps - trained_steps
    first = segment.first_step + trained_steps
    kept = {rank: _merged(pieces) for rank, pieces in shares.items()}
    return Segment(segment.epoch, generation, ordered, first, steps, kept, segment.dropped, step_samples)


def rest_of(
    segment: Segment, trained_steps: int, members: Iterable[int], step_samples: int, generation: int
) -> Segment:
    """What `segment`'s members did not train in its first `trained_steps` steps, shared by `members`."""
    if not 0 <= trained_steps <= segment.steps:
        raise ValueError(f"{trained_steps} steps trained of a segment of {segment.steps}")
    skip = trained_steps * step_samples
    rest = [piece for rank in segment.members for piece in _window(segment.shares[rank], skip, None)]
    ordered = tuple(sorted(members))
    total = sum(piece.size for piece in rest)
    steps = total // (len(ordered) * step_samples)
    size = steps * step_samples
    shares = {rank: _window(tuple(rest), i * size, size) for i, rank in enumerate(ordered)}
    first = segment.first_step + trained_steps
    dropped = total - len(ordered) * size
    return Segment(segment.epoch, generation, ordered, first, steps, shares, dropped, step_samples)


def _merged(pieces: list[EpochSlice]) -> tuple[EpochSlice, ...]:
    """`pieces` with each run of adjacent ones as one slice (a share travels in a message)."""
    out: list[EpochSlice] = []
    for piece in pieces:
        if out and out[-1].offset + out[-1].size == piece.offset:
            out[-1] = EpochSlice(piece.epoch, out[-1].offset, out[-1].size + piece.size)
        else:
            out.append(piece)
    return tuple(out)


def _window(pieces: tuple[EpochSlice, ...], start: int, size: int | None) -> tuple[EpochSlice, ...]:
    """Picks `[start, start + size)` of the concatenation of `pieces` (size None: to the end)."""
    end = sum(piece.size for piece in pieces) if size is None else start + size
    out: list[EpochSlice] = []
    at = 0
    for piece in pieces:
        lo, hi = max(start, at), min(end, at + piece.size)
        if lo < hi:
            out.append(EpochSlice(piece.epoch, piece.offset + lo - at, hi - lo))
        at += piece.size
    return tuple(out)


def segment_state(segment: Segment) -> dict[str, Any]:
    """`segment` as plain data (a checkpoint's: the rest of an epoch from the step it was taken at)."""
    return {
        "epoch": segment.epoch,
        "members": list(segment.members),
        "first_step": segment.first_step,
        "steps": segment.steps,
        "step_samples": segment.step_samples,
        "shares": [[rank, [asdict(piece) for piece in segment.shares[rank]]] for rank in segment.members],
    }


def segment_from_state(state: Mapping[str, Any], generation: int) -> Segment:
    shares = {int(rank): tuple(EpochSlice(**piece) for piece in pieces) for rank, pieces in state["shares"]}
    members = tuple(int(rank) for rank in state["members"])
    steps = int(state["steps"])
    # Checkpoints before segments said their step: each member's share holds `steps` of them.
    held = sum(piece.size for piece in shares[members[0]]) // steps if steps else 0
    step_samples = int(state.get("step_samples") or held)
    first = int(state["first_step"])
    return Segment(int(state["epoch"]), generation, members, first, steps, shares, 0, step_samples)


def checkpoint_steps(segment: Segment, steps_per_epoch: int, every: int) -> list[int]:
    """The steps of `segment`'s epoch, inside the segment and before its end, that end a multiple of `every`
    global steps, counted from the run's start as `epoch x steps_per_epoch + step of the epoch`."""
    start = segment.epoch * steps_per_epoch + segment.first_step
    # The segment's last step ends the epoch (its own checkpoint, if one is due) or a cut: none there.
    return [segment.first_step + k for k in range(1, segment.steps) if (start + k) % every == 0]


@dataclass
class _EpochPlan:
    segments: list[Segment] = field(default_factory=list)
    # Batches and samples of the epoch reported before its first segment here (a run resumed inside the
    # epoch: its steps may have been of another size).
    before: int = 0
    before_samples: int = 0
    # Per segment (by generation): the steps its members trained, once they agreed it ended early.
    trained: dict[int, int] = field(default_factory=dict)
    # Per segment (by generation): the members that reported it.
    reported: dict[int, set[int]] = field(default_factory=dict)
    # Per segment cut short: the members that were still in when it was, and report it.
    reporters: dict[int, frozenset[int]] = field(default_factory=dict)


class LockstepPlan:
    """The coordinator's record of each planned epoch's segments: what to send, what to expect back."""

    def __init__(self, total_picks: int, step_samples: int, kept: KeptBatch | None = None) -> None:
        """`kept` (keep_global_batch): the global step each membership trains, its members' steps holding
        several of the world's the run was laid out for (flodl/job/resize.py)."""
        self.total_picks = total_picks
        self.step_samples = step_samples
        self.kept = kept
        self._epochs: dict[int, _EpochPlan] = {}

    def step_for(self, members: int) -> int:
        """Samples of each member's step in a plan for `members` ranks."""
        return self.step_samples if self.kept is None else self.kept.step_for(members, self.step_samples)

    def open(self, epoch: int, members: Iterable[int], generation: int) -> Segment:
        """Plan `epoch` afresh for `members` (none of it trained yet)."""
        ordered = tuple(sorted(members))
        step = self.step_for(len(ordered))
        layout = None if self.kept is None else self.kept.layout
        segment = laid_out(epoch, self.total_picks, ordered, step, generation, layout)
        self._epochs[epoch] = _EpochPlan([segment])
        return segment

    def _rest(self, segment: Segment, trained: int, members: Iterable[int], generation: int) -> Segment:
        """What `segment`'s members did not train in its first `trained` steps, for `members`: its global
        steps whole where keep_global_batch keeps them, else its picks cut into steps of their own."""
        ordered = tuple(sorted(members))
        step = self.step_for(len(ordered))
        if self.kept is not None and len(ordered) * step == len(segment.members) * segment.step_samples:
            return regrouped(segment, trained, ordered, step, generation)
        return rest_of(segment, trained, ordered, step, generation)

    def resume(self, segment: Segment, members: Iterable[int], before: int, before_samples: int) -> Segment:
        """A run resumed inside `segment.epoch`: the rest a checkpoint recorded, `before` batches of the epoch
        reported already; shared by `members` (the same ones keep their own picks)."""
        if tuple(sorted(members)) != segment.members:
            segment = self._rest(segment, 0, members, segment.generation)
        self._epochs[segment.epoch] = _EpochPlan([segment], before=before, before_samples=before_samples)
        return segment

    def samples_before(self, epoch: int) -> int:
        """Picks of `epoch` its reporting members trained before its latest segment."""
        plan = self._epochs[epoch]
        trained = 0
        for segment in plan.segments[:-1]:
            reporters = plan.reporters.get(segment.generation, frozenset(segment.members))
            trained += (
                plan.trained.get(segment.generation, segment.steps) * len(reporters) * segment.step_samples
            )
        return trained + plan.before_samples

    def has(self, epoch: int) -> bool:
        return epoch in self._epochs

    def segment(self, epoch: int) -> Segment:
        """`epoch`'s latest segment."""
        return self._epochs[epoch].segments[-1]

    def end_steps(self) -> dict[int, int]:
        """The step each planned epoch's latest segment ends at."""
        return {epoch: plan.segments[-1].end_step for epoch, plan in self._epochs.items()}

    def current_generation(self, epoch: int) -> int | None:
        """The generation of `epoch`'s latest plan (None: the epoch is no longer planned)."""
        plan = self._epochs.get(epoch)
        return plan.segments[-1].generation if plan is not None else None

    def cut_short(self, epoch: int, step: int, members: Iterable[int], generation: int) -> Segment:
        """The members of `epoch`'s last segment trained up to `step` of the epoch, and `members` are in now:
        the segment ends there, and the rest of it is the returned segment (maybe of no steps)."""
        plan = self._epochs[epoch]
        segment = plan.segments[-1]
        trained = step - segment.first_step
        rest = self._rest(segment, trained, members, generation)
        plan.trained[segment.generation] = trained
        # Those in at the cut report it (the agreement told them where it ended); a member already gone
        # reports it only if it finished the segment before it went and said so.
        plan.reporters[segment.generation] = (frozenset(segment.members) & frozenset(rest.members)) | (
            frozenset(plan.reported.get(segment.generation, ())) if trained == segment.steps else frozenset()
        )
        plan.segments.append(rest)
        return rest

    def on_report(self, epoch: int, generation: int, rank: int) -> bool:
        """`rank` reported its share of the segment; False when it must not count (a member gone before the
        segment was cut short, whose report came late: the others' plan does not wait for it; or one of an
        epoch already emitted)."""
        plan = self._epochs.get(epoch)
        if plan is None and epoch < min(self._epochs, default=epoch + 1):
            return False  # an epoch already emitted without it
        if plan is None or not any(s.generation == generation for s in plan.segments):
            raise ValueError(f"a report of epoch {shown_epoch(epoch)}, generation {generation}: no such plan")
        reporters = plan.reporters.get(generation)
        if reporters is not None and rank not in reporters:
            return False
        plan.reported.setdefault(generation, set()).add(rank)
        return True

    def expected_batches(self, epoch: int) -> int:
        """Batches the members will have reported for `epoch` once every segment is done."""
        plan = self._epochs[epoch]
        total = plan.before
        for segment in plan.segments:
            reporters = plan.reporters.get(segment.generation, frozenset(segment.members))
            total += plan.trained.get(segment.generation, segment.steps) * len(reporters)
        return total

    def forget_before(self, epoch: int) -> None:
        for old in [e for e in self._epochs if e < epoch]:
            del self._epochs[old]

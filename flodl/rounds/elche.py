"""ElChe cadence balancer: per-rank reduce-window sizes and anchor growth (docs/ported.md).

"The column marches at the slowest one's pace": the slow (anchor) rank runs `anchor` batches per reduce
window and faster ranks run proportionally more, so everyone reaches the reduce at about the same time.
Timings come in as numbers and decisions go out as values; the coordinator owns I/O and the timeline.

Members (fault_tolerance=survive): a retired rank gets a count of 0 and drops out of the election and the
balance; an admitted one starts without speed history, as every rank starts a run (the anchor's count).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from flodl.rounds.group_pace import even_in_groups
from flodl.rounds.verdict import Verdict

TRUST_WINDOW = 5  # ms/batch samples kept per rank; also the zero-report streak that clears a window
COHORT_BAND = 0.15  # ranks within 15% of the slowest are anchor candidates
DOMINANCE_MARGIN = 0.10  # a challenger must be >10% slower than the anchor to take over (no churn on noise)
MAX_SPEED_RATIO = 64.0  # a degenerate tiny sample must not turn into a huge schedule
DEAD_ZONE = 0.05  # counts move only on changes above 5%: suppresses 1-batch chatter
GROWTH_STEP_CAP = 2.0  # at most x2 per grow step: ride the amortization curve without overshooting
GROWTH_REARM_STABLE = 5  # clean verdicts needed before growth may poke the convergence cliff again
STABLE_AT, MATURE_AT = 5, 20  # calibrations
OVERSHOOT_START, OVERSHOOT_MAX = 3, 15
# Trajectory beyond the original's ElCheState, saved so a resume continues exactly (see ElChe.state).
_RESUME = ("_zero_streak", "_counts", "_counts_anchor", "growth_enabled", "_stable_streak", "_auto_overshoot")


class Phase(IntEnum):
    PROBE = 0  # no calibration yet: equal counts
    WARMUP = 1  # anchor pick held; growth only on an unambiguous signal
    STABLE = 2  # election and growth at the real target
    MATURE = 3  # same ElChe behaviour; kept so a saved phase reads as the original's


@dataclass(frozen=True)
class AnchorChange:
    old: int
    new: int
    reason: str  # "grow" | "nudge_down"


@dataclass(frozen=True)
class ElCheSettings:
    world_size: int
    anchor: int = 10
    min_anchor: int | None = None  # None: the initial anchor
    max_anchor: int = 1000
    overhead_target: float = 0.05  # used clamped to [0.01, 0.50]
    max_batch_diff: int | None = None  # None: unlimited; 0: lockstep
    max_overshoot: int | None = None  # async only; None: auto 3 -> 15
    is_async: bool = False
    group_size: int = 1  # shard_group: a group's ranks get its slowest member's count (rounds/group_pace.py)

    def __post_init__(self) -> None:
        lows = {"world_size": 1, "anchor": 1, "max_anchor": 1, "min_anchor": 1, "group_size": 1}
        for name, low in {**lows, "max_batch_diff": 0, "max_overshoot": 0}.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"ElChe {name} must be >= {low}, got {value}")
        if not (math.isfinite(self.overhead_target) and self.overhead_target > 0):
            raise ValueError(f"ElChe overhead_target must be > 0, got {self.overhead_target}")

    @property
    def floor(self) -> int:
        """Growth floor (min_anchor resolved, never above max_anchor)."""
        return min(self.anchor if self.min_anchor is None else self.min_anchor, self.max_anchor)

    @property
    def target(self) -> float:
        return min(max(self.overhead_target, 0.01), 0.50)


def round_overhead_ms(round_ms: Sequence[float], idle_ms: Sequence[float]) -> float:
    """The fixed cost of one round that the anchor amortizes: the averaging itself (the longest time a
    rank was held up by it), or, when longer, what the round cost the rank that waited least: its
    window's wall time not spent training (messages to and from the coordinator, the reduce, the next
    window's dispatch). Waiting for a slower peer is balance's business, not the anchor's, hence the
    least-idle rank."""
    if not round_ms or len(round_ms) != len(idle_ms):
        raise ValueError("round_overhead_ms needs one round time and one idle time per rank")
    return max(max(round_ms), min(idle_ms))


def _round(x: float) -> int:
    return math.floor(x + 0.5)  # half away from zero (x > 0), like Rust's f64::round


class ElChe:
    """Cadence state for one run: `report_timing` once per reduce window, then `apply_verdict`.

    Public attributes (anchor, anchor_rank, phase, calibration_count, proposed_anchor, growth_enabled)
    are for reading; they change only through the methods. `epoch_batches` may be set by the caller."""

    def __init__(
        self,
        settings: ElCheSettings,
        anchor_rank: int | None = None,
        epoch_batches: int | None = None,
        first_members: int | None = None,
    ) -> None:
        n = settings.world_size
        if anchor_rank is not None and not 0 <= anchor_rank < n:
            raise ValueError(f"anchor_rank {anchor_rank} out of range for world_size {n}")
        self.settings = settings
        # Soft cold-start pin (partition ratios / spec prior); None: elected at the first calibration.
        self.anchor_rank = anchor_rank
        self.epoch_batches = epoch_batches  # window cap: a reduce window never spans more than an epoch
        self.anchor = min(max(settings.anchor, settings.floor), settings.max_anchor)
        self.phase = Phase.PROBE
        self.calibration_count = 0
        self._windows: list[deque[float]] = [deque(maxlen=TRUST_WINDOW) for _ in range(n)]
        self._zero_streak = [0] * n
        self._counts = [self.anchor] * n  # uncapped schedule; counts() applies the epoch cap
        self._counts_anchor = self.anchor  # anchor the schedule was last computed with
        self.proposed_anchor: int | None = None  # transient: staged by report_timing, settled by the verdict
        self.growth_enabled = True
        self._stable_streak = 0
        self._auto_overshoot = OVERSHOOT_START
        # Ranks 0..first_members-1 get counts from the start, the seats past them once admitted.
        self._members = set(range(n if first_members is None else first_members))

    # --- queries ------------------------------------------------------------------------------------

    @property
    def overshoot(self) -> int:
        """Async steps a rank may run past its count while the CPU reduce is in flight (0 otherwise)."""
        if not self.settings.is_async:
            return 0
        return self._auto_overshoot if self.settings.max_overshoot is None else self.settings.max_overshoot

    @property
    def members(self) -> frozenset[int]:
        """The ranks that get counts (the first members until one is retired or admitted)."""
        return frozenset(self._members)

    @property
    def window_cap_binding(self) -> bool:
        total = sum(self._counts[r] for r in self._members)
        return self.epoch_batches is not None and total > self.epoch_batches

    def smoothed_ms(self, rank: int) -> float | None:
        """Mean of the rank's trust window; None before it has a valid reading."""
        w = self._windows[rank]
        return sum(w) / len(w) if w else None

    def counts(self) -> list[int]:
        """Per-rank batches for the next window, scaled to fit the epoch (floor, >= 1, remainder to the
        largest), even in a sharded group; 0 for a rank that is no member (the planner splits epoch tails)."""
        members = sorted(self._members)
        counts = [self._counts[r] for r in members]
        cap, total = self.epoch_batches, sum(counts)
        if cap is not None and 0 < cap < total:
            counts = [max(1, c * cap // total) for c in counts]
            counts[counts.index(max(counts))] += max(cap - sum(counts), 0)
            # The floor of 1 can overshoot the cap: take the excess from the largest (the original
            # leaves it; it only stays over when there are more ranks than batches).
            while sum(counts) > cap and max(counts) > 1:
                counts[counts.index(max(counts))] -= 1
        full = [0] * self.settings.world_size
        for rank, count in zip(members, counts, strict=True):
            full[rank] = count
        return even_in_groups(full, self.settings.group_size)

    # --- membership ----------------------------------------------------------------------------

    def retire(self, rank: int) -> None:
        """The rank is gone: count 0, out of the election; the others are balanced on the slowest left."""
        if rank not in self._members:
            raise ValueError(f"rank {rank} is not a member (members: {sorted(self._members)})")
        if len(self._members) == 1:
            raise ValueError(f"rank {rank} is the last member")
        self._members.discard(rank)
        self._forget(rank)
        if self.anchor_rank == rank:  # elected or pinned, it is gone: the slowest member left takes over
            self.anchor_rank = self._elect()
            slow = None if self.anchor_rank is None else self.smoothed_ms(self.anchor_rank)
            if slow is not None:
                self._recompute(slow)

    def admit(self, rank: int) -> None:
        """A restarted rank joins. It has no speed yet: it gets the anchor's count, as every rank does
        before its first reading, until its own windows are measured."""
        if not 0 <= rank < self.settings.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.settings.world_size}")
        if rank in self._members:
            raise ValueError(f"rank {rank} is already a member")
        self._members.add(rank)
        self._forget(rank)
        self._counts[rank] = self.anchor

    def _forget(self, rank: int) -> None:
        """A rank's speed history belongs to its process: a restarted one is measured afresh."""
        self._windows[rank].clear()
        self._zero_streak[rank] = 0

    # --- timing feed -------------------------------------------------------------------------------

    def report_timing(
        self,
        wall_ms: Sequence[float],
        batches: Sequence[int],
        reduce_ms: float = 0.0,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """One reduce window: per-rank busy time (ms) over `batches`, and the fixed cost of the round
        that closed it (`round_overhead_ms`). Entries are for `ranks` (None: the members, in rank order);
        a member admitted since the window opened is not among them and keeps its state."""
        ranks = sorted(self._members) if ranks is None else list(ranks)
        if len(wall_ms) != len(ranks) or len(batches) != len(ranks):
            raise ValueError(f"timing feed needs one entry per rank ({len(ranks)})")
        if not set(ranks) <= self._members:
            raise ValueError(f"timing for ranks {sorted(set(ranks) - self._members)}, which are no members")
        readings = [
            w / b if b > 0 and w > 0 and math.isfinite(w) else None
            for w, b in zip(wall_ms, batches, strict=True)
        ]
        if all(ms is None for ms in readings):
            return  # an idle window carries no signal and must not count as a calibration
        for r, ms in zip(ranks, readings, strict=True):
            if ms is not None:
                self._windows[r].append(ms)
                self._zero_streak[r] = 0
            else:
                self._zero_streak[r] += 1
                if self._zero_streak[r] >= TRUST_WINDOW:
                    self._windows[r].clear()  # react fast when the rank comes back
        # Election holds through Probe/Warmup so cold-start skew cannot crown the wrong rank.
        if self.anchor_rank is None or self.phase >= Phase.STABLE:
            self.anchor_rank = self._elect()
        b = self.anchor_rank
        if b is None:
            return
        slow = self.smoothed_ms(b)
        if slow is None and self._zero_streak[b] >= TRUST_WINDOW:
            # A pinned anchor that never reports would freeze calibration; stop trusting the pin.
            self.anchor_rank = b = self._elect()
            slow = None if b is None else self.smoothed_ms(b)
        if b is None or slow is None:
            return
        # A proposal lives for one window. The first report never proposes: one sample is not a trend.
        self.proposed_anchor = self._propose(slow, reduce_ms) if self.phase >= Phase.WARMUP else None
        self._recompute(slow)
        self.calibration_count += 1
        c = self.calibration_count
        due = Phase.MATURE if c >= MATURE_AT else Phase.STABLE if c >= STABLE_AT else Phase.WARMUP
        self.phase = max(self.phase, due)

    def _elect(self) -> int | None:
        ms = {r: m for r in sorted(self._members) if (m := self.smoothed_ms(r)) is not None}
        if not ms:
            return None
        top = max(ms.values())
        cohort = [r for r, m in ms.items() if m >= top * (1 - COHORT_BAND)]
        cur = self.anchor_rank
        if cur not in cohort:
            return min(cohort)
        others = [r for r in cohort if r != cur]
        if not others:
            return cur
        # Exact ties between challengers go to the lowest index (the original leaves them unspecified).
        challenger = max(others, key=lambda r: ms[r])
        return challenger if ms[challenger] > ms[cur] * (1 + DOMINANCE_MARGIN) else cur

    def _propose(self, slow: float, reduce_ms: float) -> int | None:
        """Window pressure: the anchor rank's fixed per-window cost (the round's overhead) as a fraction of
        its window wall. Grow-only; the guard verdict decides whether it lands."""
        s = self.settings
        if not self.growth_enabled or self.window_cap_binding:
            return None  # at the cap a larger anchor delivers nothing and detaches from the schedule
        if reduce_ms <= 0:
            return None
        overhead = reduce_ms / (self.anchor * slow + reduce_ms)
        # Before Stable only an unambiguous signal acts (it is cap-clamped by construction).
        if overhead <= s.target * (1.0 if self.phase >= Phase.STABLE else GROWTH_STEP_CAP):
            return None
        new = math.ceil(self.anchor * min(overhead / s.target, GROWTH_STEP_CAP))
        new = min(max(new, s.floor), s.max_anchor)
        return new if new > self.anchor else None

    def _recompute(self, slow: float) -> None:
        limit = self.settings.max_batch_diff
        shift = self.anchor - self._counts_anchor
        for r in sorted(self._members):
            ms, cur = self.smoothed_ms(r), self._counts[r]
            if ms is None or abs(ms - slow) < 1e-6:
                target = self.anchor
            else:
                target = max(1, _round(self.anchor * min(slow / ms, MAX_SPEED_RATIO)))
            moved = abs(target - cur) > DEAD_ZONE * cur or self.calibration_count == 0
            new = target if moved else cur
            if limit is not None:
                # max_batch_diff bounds each rank's per-update change beyond the anchor's own move, from the
                # first calibration: 0 keeps every rank at `anchor` (lockstep); growth and nudges still act.
                base = max(1, cur + shift)
                new = min(max(new, base - limit), base + limit)
            self._counts[r] = max(1, new)
        self._counts_anchor = self.anchor

    # --- anchor moves ------------------------------------------------------------------------------

    def _set_anchor(self, new: int, reason: str) -> AnchorChange | None:
        if new == self.anchor:
            return None
        change = AnchorChange(self.anchor, new, reason)
        self.anchor = new
        slow = None if self.anchor_rank is None else self.smoothed_ms(self.anchor_rank)
        if slow is not None:
            self._recompute(slow)
        else:  # uncalibrated: the schedule is still equal counts
            self._counts = [new] * self.settings.world_size
            self._counts_anchor = new
        return change

    def nudge_anchor_down(self, factor: float) -> AnchorChange | None:
        """anchor = ceil(anchor * clamp(factor, 0.1, 1)); bypasses min_anchor (divergence outranks
        overhead), so it can reach 1. Does not touch the proposal: use apply_verdict(NUDGE_DOWN)."""
        if not math.isfinite(factor):
            return None  # a NaN factor would silently collapse the anchor to 1
        new = math.ceil(self.anchor * min(max(factor, 0.1), 1.0))
        return self._set_anchor(min(max(new, 1), self.anchor), "nudge_down")

    def apply_verdict(self, verdict: Verdict, factor: float = 0.5) -> list[AnchorChange]:
        """Settle the pending proposal with the guard's verdict, once per round. `factor` is
        NudgeDown's shrink factor. Growth latches off on any non-Stable verdict and re-arms after 5
        consecutive Stables; async overshoot (auto) steps +1 per Stable and resets on NudgeDown."""
        changes = []
        if verdict is Verdict.STABLE:
            self._stable_streak += 1
            if self._stable_streak >= GROWTH_REARM_STABLE:
                self.growth_enabled = True
            if self.proposed_anchor is not None:
                changes.append(self._set_anchor(self.proposed_anchor, "grow"))
                self.proposed_anchor = None
            self._auto_overshoot = min(self._auto_overshoot + 1, OVERSHOOT_MAX)
        else:
            # Drop the proposal first: it was computed from the pre-nudge anchor.
            self.proposed_anchor, self._stable_streak, self.growth_enabled = None, 0, False
            if verdict is Verdict.NUDGE_DOWN:
                changes.append(self.nudge_anchor_down(factor))
                self._auto_overshoot = OVERSHOOT_START
        return [c for c in changes if c is not None]

    # --- checkpoint ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able state. The original's ElCheState fields come first; `resume` carries the rest of the
        trajectory so a resume behaves exactly like the run it continues. The guard saves its own."""
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": [self.smoothed_ms(r) or 0.0 for r in range(self.settings.world_size)],
            "phase": self.phase.name.lower(),
            "calibration_count": self.calibration_count,
            "members": sorted(self._members),
            "resume": {"ms_windows": [list(w) for w in self._windows]}
            | {key.lstrip("_"): copy.copy(getattr(self, key)) for key in _RESUME},
        }

    @classmethod
    def from_state(
        cls,
        settings: ElCheSettings,
        state: dict[str, Any],
        epoch_batches: int | None = None,
        first_members: int | None = None,
    ) -> ElChe:
        """Rebuild from `state()` for a job that starts with ranks 0..first_members-1 (None: every seat).
        Knobs come from `settings` (a resume may re-bind them). The anchor the run grew to, its phase,
        calibrations and growth streaks carry over; on other seats its ranks' speeds do not (they belong to
        the old processes and devices): every rank starts at the anchor's count, the anchor elected again."""
        el = cls(settings, None, epoch_batches, first_members)
        el.anchor = el._counts_anchor = int(state["anchor"])
        el._counts = [el.anchor] * settings.world_size
        el.phase = Phase[str(state["phase"]).upper()]
        el.calibration_count = int(state["calibration_count"])
        extra = state["resume"]
        if len(state["smoothed_ms_per_batch"]) != settings.world_size:
            el.growth_enabled = bool(extra["growth_enabled"])
            el._stable_streak = int(extra["stable_streak"])
            el._auto_overshoot = int(extra["auto_overshoot"])
            return el
        if state["anchor_rank"] in el._members:  # else elected again among the ranks there are
            el.anchor_rank = state["anchor_rank"]
        for r, w in enumerate(extra["ms_windows"]):
            el._windows[r].extend(float(x) for x in w)
        for key in _RESUME:
            setattr(el, key, copy.copy(extra[key.lstrip("_")]))
        for rank in el._members - set(state.get("members", el._members)):  # cut before it: measured afresh
            el._forget(rank)
            el._counts[rank] = el.anchor
        return el

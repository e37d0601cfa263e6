"""Convergence guards: read each reduce's divergence and advise ElChe (pure: no torch.distributed, no I/O).

The coordinator calls `guard.report(report, k_max)` once per reduce, with k_max = the most steps any
rank took since the last reduce, and applies the returned Action to ElChe: Stable commits a proposed
anchor growth, SuppressGrowth drops it and latches growth off, NudgeDown also shrinks the anchor by
`factor`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

from flodl.rounds.verdict import Verdict

# make_guard defaults: overwrite adoption vs the softer EASGD blend, whose replicas stay further apart.
DEFAULT_THRESHOLD = 0.05
EASGD_THRESHOLD = 0.3
# TrendGuard's ring buffer length.
TREND_HISTORY = 5


@dataclass(frozen=True)
class Action:
    verdict: Verdict
    # Anchor multiplier for NUDGE_DOWN (0.5 halves it); 1.0 otherwise.
    factor: float = 1.0


STABLE = Action(Verdict.STABLE)
SUPPRESS_GROWTH = Action(Verdict.SUPPRESS_GROWTH)


@dataclass(frozen=True)
class DivergenceReport:
    """One reduce's divergence measurements: ‖θ_k,pre - θ_post‖ / ‖θ_post‖, one entry per rank."""

    divergences: list[float]

    def max_divergence(self) -> float:
        """D = max_k d_k, the primary signal: the worst replica's drift. NaN entries are ignored and an
        empty report reads 0, like the original's fold over f64::max."""
        return max((d for d in self.divergences if not math.isnan(d)), default=0.0)


class ConvergenceGuard(ABC):
    kind: ClassVar[str]

    @abstractmethod
    def report(self, report: DivergenceReport, k_max: int) -> Action: ...

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """JSON-able snapshot (config and history) for checkpoints; `guard_from_state` inverts it."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: dict[str, Any]) -> ConvergenceGuard: ...


class NoGuard(ConvergenceGuard):
    """Always Stable: the unconditioned baseline (`divergence_guard=none`)."""

    kind = "none"

    def report(self, report: DivergenceReport, k_max: int) -> Action:
        return STABLE

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> NoGuard:
        return cls()


class TrendGuard(ConvergenceGuard):
    """SuppressGrowth when D rose on `rises` consecutive reports and the latest is above `threshold`.

    flodl's "3 rises" is the rule h[-1] > h[-2] > h[-3] (and h[-1] > threshold) on the last 5 D values:
    `rises` counts the strictly increasing values at the tail of the history, so rises=3 means three
    values in a row, each above the previous. Only the latest must exceed the threshold. Never nudges.
    """

    kind = "trend"

    def __init__(self, threshold: float, rises: int = 3, history: Iterable[float] = ()) -> None:
        if not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"threshold must be finite and >= 0, got {threshold}")
        if rises < 1:
            raise ValueError(f"rises must be >= 1, got {rises}")
        self.threshold = float(threshold)
        self.rises = rises
        # Restoring the ring on resume spares the post-resume warm-up of `rises` silent reports.
        self.history: deque[float] = deque((float(d) for d in history), maxlen=max(TREND_HISTORY, rises))

    def report(self, report: DivergenceReport, k_max: int) -> Action:
        self.history.append(report.max_divergence())
        if len(self.history) < self.rises:
            return STABLE
        tail = list(self.history)[-self.rises :]
        rising = all(a < b for a, b in pairwise(tail))
        return SUPPRESS_GROWTH if rising and tail[-1] > self.threshold else STABLE

    def state(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "threshold": self.threshold,
            "rises": self.rises,
            "history": list(self.history),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrendGuard:
        return cls(state["threshold"], state.get("rises", 3), state.get("history", ()))


@dataclass
class MsfGuard(ConvergenceGuard):
    """Growth-rate guard on the across-reduce Lyapunov proxy of the divergence.

    λ_raw = ln(D_t / D_{t-1}) / k_max (per-rank steps: the window's time axis), only when both D values
    are above `noise_floor`; λ_ema is its Adam-style bias-corrected EMA (ema / (1 - alpha^t)). λ_ema above
    `suppress_threshold` for `suppress_sustain` reports in a row → SuppressGrowth; above
    `nudge_threshold` for `nudge_sustain` reports → NudgeDown(nudge_factor). The two streaks count
    independently, nudge wins when both fire, and a firing resets only its own streak.
    `nudge_threshold=None` disables nudging.
    """

    kind: ClassVar[str] = "msf"

    alpha: float = 0.9
    suppress_threshold: float = 1e-3
    suppress_sustain: int = 3
    nudge_threshold: float | None = 1e-2
    nudge_sustain: int = 3
    nudge_factor: float = 0.5
    noise_floor: float = 1e-8
    # Estimator and streak state.
    prev_d: float | None = None
    ema_raw: float = 0.0
    ema_t: int = 0
    suppress_streak: int = 0
    nudge_streak: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and 0.0 < self.alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def lambda_ema(self) -> float | None:
        if self.ema_t == 0:
            return None
        denom = 1.0 - self.alpha**self.ema_t
        return self.ema_raw / denom if denom > 0.0 else self.ema_raw

    def _observe(self, d: float, k_max: int) -> None:
        floor = self.noise_floor
        if self.prev_d is not None and self.prev_d > floor and d > floor and k_max > 0:
            lam = math.log(d / self.prev_d) / k_max
            self.ema_raw = self.alpha * self.ema_raw + (1.0 - self.alpha) * lam
            self.ema_t += 1
        # Below the floor the pairing restarts: the next λ needs two readings above it again. The EMA
        # itself is kept, as in the original's estimator.
        self.prev_d = d if d > floor else None

    def report(self, report: DivergenceReport, k_max: int) -> Action:
        self._observe(report.max_divergence(), k_max)
        lam = self.lambda_ema()
        lam_v = -math.inf if lam is None else lam
        self.suppress_streak = self.suppress_streak + 1 if lam_v > self.suppress_threshold else 0
        nudging = self.nudge_threshold is not None and lam_v > self.nudge_threshold
        self.nudge_streak = self.nudge_streak + 1 if nudging else 0
        if self.nudge_threshold is not None and self.nudge_streak >= self.nudge_sustain:
            self.nudge_streak = 0
            return Action(Verdict.NUDGE_DOWN, self.nudge_factor)
        if self.suppress_streak >= self.suppress_sustain:
            self.suppress_streak = 0
            return SUPPRESS_GROWTH
        return STABLE

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f: getattr(self, f) for f in self.__dataclass_fields__}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MsfGuard:
        return cls(**{k: v for k, v in state.items() if k != "kind"})


_GUARDS: dict[str, type[ConvergenceGuard]] = {g.kind: g for g in (NoGuard, TrendGuard, MsfGuard)}


def guard_from_state(state: dict[str, Any]) -> ConvergenceGuard:
    kind = state.get("kind")
    if kind not in _GUARDS:
        raise ValueError(f"unknown guard kind {kind!r}; expected one of {sorted(_GUARDS)}")
    return _GUARDS[kind].from_state(state)


def make_guard(kind: str, divergence_threshold: float | None, easgd: bool) -> ConvergenceGuard:
    """The run's guard from config: NoGuard for kind="none"; MsfGuard (growth rate) for kind="msf"; else a
    TrendGuard whose threshold defaults to 0.05, or 0.3 when EASGD blending is in effect (`easgd`:
    easgd_alpha is set and honoured)."""
    if kind == "none":
        return NoGuard()
    if kind == "msf":
        return MsfGuard()
    if divergence_threshold is None:
        divergence_threshold = EASGD_THRESHOLD if easgd else DEFAULT_THRESHOLD
    return TrendGuard(divergence_threshold)

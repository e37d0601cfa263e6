"""What the keys allow of each other: the policy's knobs, the outer optimizer, the wire, the guard,
overlapped rounds, the loader."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

from flodl.config.rules.problem import problem, schema_defaults
from flodl.config.schema import FlodlConfig

# Knobs of local SGD (cadence/async): under sync every rank takes exactly one step per averaging,
# so they would have no effect, and a silently ignored knob is a bug report waiting to happen.
LOCAL_SGD_KNOBS = (
    "gamma",
    "anchor",
    "min_anchor",
    "max_anchor",
    "overhead_target",
    "max_batch_diff",
    "max_overshoot",
    "divergence_threshold",
    "divergence_guard",
    "quantized_wire",
)
# The smallest normal float64: every consensus weight n^gamma and its share must stay above it.
TINY = sys.float_info.min
# Steps of an async window past its count when max_overshoot is null (auto, rounds/elche.py's ceiling).
AUTO_OVERSHOOT = 15


def combination_problems(cfg: FlodlConfig, world_size: int) -> Iterator[str]:
    yield from _policy_problems(cfg)
    yield from _outer_problems(cfg)
    if cfg.quantized_wire and cfg.bf16_wire:
        yield problem(
            "quantized_wire",
            cfg.quantized_wire,
            "one wire at a time: set bf16_wire=false (the quantized wire sends fewer bytes)",
        )
    if cfg.divergence_guard != "trend" and cfg.divergence_threshold is not None:
        yield problem(
            "divergence_threshold",
            cfg.divergence_threshold,
            f"applies to divergence_guard=trend (divergence_guard={cfg.divergence_guard}: "
            + ("no guard reads it)" if cfg.divergence_guard == "none" else "the divergence growth rate)"),
        )
    if cfg.policy != "sync":
        yield from _gamma_problems(cfg, world_size)
    yield from _overlap_problems(cfg)
    yield from _loader_problems(cfg)


def _policy_problems(cfg: FlodlConfig) -> Iterator[str]:
    """Keys that apply to some policies only."""
    if cfg.easgd_alpha is not None and cfg.policy != "async":
        yield problem(
            "easgd_alpha",
            cfg.easgd_alpha,
            f"EASGD blending applies to policy=async only (policy={cfg.policy})",
        )
    if cfg.max_overshoot is not None and cfg.policy != "async":
        yield problem(
            "max_overshoot", cfg.max_overshoot, f"applies to policy=async only (policy={cfg.policy})"
        )
    if cfg.policy != "sync":
        return
    defaults = schema_defaults()
    for key in LOCAL_SGD_KNOBS:
        if getattr(cfg, key) != defaults[key]:
            yield problem(
                key,
                getattr(cfg, key),
                "applies to local SGD (policy=cadence or async); policy=sync averages gradients every step, "
                f"so leave it at its default ({defaults[key]!r})",
            )
    if cfg.on_nonfinite == "skip":
        yield problem(
            "on_nonfinite",
            "skip",
            "policy=sync mixes every step's gradients (DDP), so a bad window cannot be dropped; use "
            "on_nonfinite=error, or policy=cadence/async",
        )


def _outer_problems(cfg: FlodlConfig) -> Iterator[str]:
    if cfg.outer != "avg" and cfg.policy == "sync":
        yield problem(
            "outer", cfg.outer, "an outer optimizer steps averaged parameters: use policy=cadence or async"
        )
    for key in ("outer_lr", "outer_momentum", "outer_reset_inner"):
        if getattr(cfg, key) is not None and cfg.outer == "avg":
            yield problem(key, getattr(cfg, key), "applies to outer=slowmo or diloco (outer=avg)")
    if cfg.outer == "diloco" and cfg.outer_momentum == 0:
        yield problem("outer_momentum", 0.0, "DiLoCo's Nesterov step needs a momentum > 0")


def _gamma_problems(cfg: FlodlConfig, world_size: int) -> Iterator[str]:
    """n^gamma for every window length n the run can form, summed over the ranks, and each rank's share of
    that sum must be normal float64s: |gamma| * log(n_max) + log(world) stays below -log(TINY)."""
    overshoot = (
        (AUTO_OVERSHOOT if cfg.max_overshoot is None else cfg.max_overshoot) if cfg.policy == "async" else 0
    )
    longest = cfg.max_anchor + overshoot
    if longest <= 1 or not math.isfinite(cfg.gamma):
        return
    bound = (-math.log(TINY) - math.log(world_size)) / math.log(longest)
    if abs(cfg.gamma) > bound:
        yield problem(
            "gamma",
            cfg.gamma,
            f"must be within +-{bound:.4g}: a window of up to {longest} steps (max_anchor + overshoot) would "
            "weigh n^gamma outside float64's normal range, so rounds would overflow or silently drop ranks",
        )


def _overlap_problems(cfg: FlodlConfig) -> Iterator[str]:
    """What overlapped rounds cannot do (yet): they run on the cpu backend's thread, under cadence."""
    if not cfg.overlap_rounds:
        return
    why = {
        "sync": "sync averages gradients inside every step's backward (DDP overlaps them already)",
        "async": "async already trains on while its round is in flight (backend=cpu), and a window's "
        "overshoot is known only to its rank",
    }
    if cfg.policy in why:
        yield problem("overlap_rounds", True, f"applies to policy=cadence: {why[cfg.policy]}")
    if cfg.backend != "cpu":
        yield problem(
            "overlap_rounds",
            True,
            f"needs backend=cpu, whose round runs on a thread while the next window trains (on a GPU too: a "
            f"pinned host snapshot, gloo); backend={cfg.backend} reduces in place on the device and is not "
            "overlapped yet",
        )
    if cfg.fault_tolerance == "survive":
        yield problem(
            "overlap_rounds",
            True,
            "not with fault_tolerance=survive yet: a round cut while the next window trains is not undone; "
            "set overlap_rounds=false",
        )


def _loader_problems(cfg: FlodlConfig) -> Iterator[str]:
    if cfg.prefetch_factor is not None and cfg.num_workers == 0:
        yield problem("prefetch_factor", cfg.prefetch_factor, "applies to num_workers > 0 (as in torch)")
    if cfg.num_workers > 0 and cfg.task.cacheable:
        yield problem(
            "num_workers",
            cfg.num_workers,
            "task.cacheable=true serves samples from this rank's RAM and disk tiers, which worker processes "
            "cannot fill; use num_workers=0 (after the first read every sample comes from the tiers), or "
            "task.cacheable=false to read afresh in workers",
        )

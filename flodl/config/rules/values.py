"""Each key alone: the values it may take (`CHOICES`, which docs/configuration.md lists too) and its range."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from flodl.config.rules.problem import problem, value_at
from flodl.config.schema import (
    BACKENDS,
    CHECKPOINT_WRITERS,
    COMPILE_MODES,
    DEVICES,
    FAULT_TOLERANCE,
    GUARDS,
    ON_NONFINITE,
    OUTERS,
    POLICIES,
    PRECISIONS,
    QUANTIZED_WIRES,
    STREAM_SPLITS,
    FlodlConfig,
)

# numpy's seed range (torch takes wider ones): a seed beyond it fails wherever a library reseeds from it.
MAX_SEED = (1 << 32) - 1
# Longer than any collective or rendezvous wait worth having; far inside what datetime.timedelta holds.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Ranks take seconds to start (importing torch) and meet: a shorter wait for them fails a sound run.
MIN_LAUNCH_TIMEOUT_S = 10.0
# A slow rank simulated past this is a hang: simulate.hang_* tests that.
MAX_SLOW_FACTOR = 1000.0
# Views of one sample per epoch: beyond this the epoch's pick index outgrows memory for any real dataset.
MAX_AUGMENT = 4096
# A heartbeat beats at most every 0.2 s (links/heartbeat.py): a shorter silence is scheduling noise.
MIN_HEARTBEAT_S = 1.0
# torch's elastic agent kills its ranks this long after it forwards a stop signal to them.
MAX_STOP_GRACE_S = 30.0
START_METHODS = ("spawn", "fork", "forkserver")
LOGGERS = ("console", "wandb")
WANDB_MODES = ("online", "offline", "disabled")
KILL_MOMENTS = ("window", "round", "start")

# The keys of a fixed set of values, and those values.
CHOICES: dict[str, tuple[str, ...]] = {
    "policy": POLICIES,
    "backend": BACKENDS,
    "device": DEVICES,
    "divergence_guard": GUARDS,
    "task.stream_split": STREAM_SPLITS,
    "outer": OUTERS,
    "quantized_wire": QUANTIZED_WIRES,
    "precision": PRECISIONS,
    "compile_mode": COMPILE_MODES,
    "on_nonfinite": ON_NONFINITE,
    "fault_tolerance": FAULT_TOLERANCE,
    "checkpoint_writer": CHECKPOINT_WRITERS,
    "simulate.kill_in": KILL_MOMENTS,
    "logger.name": LOGGERS,
    "logger.mode": WANDB_MODES,
    "launch.start_method": START_METHODS,
}
# Choices that may also be null, and what null means.
NULL_MEANS = {"quantized_wire": "", "logger.mode": " (W&B decides)"}


def _finite_above(low: float) -> Callable[[Any], bool]:
    return lambda v: math.isfinite(v) and v > low


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


def _within(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: low <= v <= high


# (key, the test its value passes, the rule in words, whether null is allowed).
RANGES: tuple[tuple[str, Callable[[Any], bool], str, bool], ...] = (
    ("outer_lr", _finite_above(0), "must be finite and > 0", True),
    ("outer_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)", True),
    ("seed", _within(0, MAX_SEED), f"must be in [0, {MAX_SEED}] (numpy's seed range)", False),
    ("epochs", _at_least(1), "must be >= 1", False),
    ("steps_per_epoch", _at_least(1), "must be >= 1 (optimizer steps per rank)", True),
    ("batch_size", _at_least(1), "must be >= 1 (samples per rank per micro-batch)", False),
    (
        "augment",
        _within(1, MAX_AUGMENT),
        f"must be in [1, {MAX_AUGMENT}] (views per sample per epoch)",
        False,
    ),
    ("grad_accum", _at_least(1), "must be >= 1 micro-batches per optimizer step (1: no accumulation)", False),
    ("peak_tflops", _finite_above(0), "must be finite and > 0 (one device's TFLOPS)", True),
    ("eval_every", _at_least(0), "must be >= 0 (0 disables eval)", False),
    ("max_grad_norm", _finite_above(0), "must be a finite value > 0", True),
    ("lr_scale_ratio", lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0", False),
    ("gamma", math.isfinite, "must be finite", False),
    ("easgd_alpha", lambda v: 0 < v <= 1, "must be in (0, 1]", True),
    ("anchor", _at_least(1), "must be >= 1", False),
    ("min_anchor", _at_least(1), "must be >= 1", True),
    ("overhead_target", _within(0.01, 0.5), "must be in [0.01, 0.5]", False),
    ("max_batch_diff", _at_least(0), "must be >= 0", True),
    ("max_overshoot", _at_least(0), "must be >= 0", True),
    ("divergence_threshold", _finite_above(0), "must be finite and > 0", True),
    ("vram_max_usage", _within(0.5, 0.99), "must be in [0.5, 0.99]", False),
    ("ram_max_usage", _within(0.0, 0.9), "must be in [0, 0.9]", False),
    ("disk_stage_gb", lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0 (0: off)", False),
    ("num_workers", _at_least(0), "must be >= 0 (0: read in the rank's process)", False),
    ("prefetch_factor", _at_least(1), "must be >= 1 (batches each worker reads ahead)", True),
    ("checkpoint_every", _at_least(1), "must be >= 1 (epochs)", True),
    ("checkpoint_every_steps", _at_least(1), "must be >= 1 (global steps)", True),
    ("checkpoint_every_s", _finite_above(0), "must be finite and > 0 (seconds)", True),
    ("checkpoint_keep", _at_least(1), "must be >= 1", False),
    (
        "stop_grace_s",
        _within(0, MAX_STOP_GRACE_S),
        f"must be in [0, {MAX_STOP_GRACE_S:g}] seconds (0: a stop does not save; torch's launcher kills the "
        f"ranks {MAX_STOP_GRACE_S:g} s after it forwards the signal)",
        False,
    ),
    (
        "heartbeat_timeout_s",
        _within(MIN_HEARTBEAT_S, MAX_TIMEOUT_S),
        f"must be in [{MIN_HEARTBEAT_S:g}, {MAX_TIMEOUT_S:g}] seconds (ranks beat every 0.2-1 s; a shorter "
        "silence is ordinary scheduling noise)",
        True,
    ),
    ("launch.max_restarts", _at_least(0), "must be >= 0", False),
    ("launch.max_ranks", _at_least(1), "must be >= 1", True),
    ("min_ranks", _at_least(1), "must be >= 1", False),
    ("shard_group", _at_least(1), "must be >= 1 ranks per sharded group (1: full replicas)", False),
    ("simulate.nan_at_step", _at_least(1), "must be >= 1 (a 1-based step)", True),
    ("simulate.hang_at_step", _at_least(1), "must be >= 1 (a 1-based step)", True),
    ("simulate.kill_at_step", _at_least(1), "must be >= 1 (a 1-based step)", True),
    ("launch.nproc_per_node", _at_least(1), "must be >= 1", False),
    ("logger.log_every", _at_least(0), "must be >= 0 steps (0: per epoch only)", False),
    (
        "launch.timeout_s",
        _within(MIN_LAUNCH_TIMEOUT_S, MAX_TIMEOUT_S),
        f"must be in [{MIN_LAUNCH_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds (ranks take seconds to start and "
        "meet; a shorter wait fails a sound run)",
        False,
    ),
    (
        "simulate.factor",
        _within(1, MAX_SLOW_FACTOR),
        f"must be in [1, {MAX_SLOW_FACTOR:g}] (1: off; a slower rank is a hang: use simulate.hang_*)",
        False,
    ),
)


def value_problems(cfg: FlodlConfig) -> Iterator[str]:
    for key, allowed in CHOICES.items():
        value = value_at(cfg, key)
        if value is None and key in NULL_MEANS:
            continue
        if value not in allowed:
            null = f" or null{NULL_MEANS[key]}" if key in NULL_MEANS else ""
            yield problem(key, value, f"must be one of {', '.join(allowed)}{null}")
    for key, ok, rule, optional in RANGES:
        value = value_at(cfg, key)
        if value is None and optional:
            continue
        if value is None or not ok(value):
            yield problem(key, value, rule)
    yield from _anchor_problems(cfg)
    yield from _objective_problems(cfg)
    ratios = cfg.partition_ratios
    if ratios is not None and (not ratios or not all(math.isfinite(r) and r > 0 for r in ratios)):
        yield problem("partition_ratios", ratios, "must be a non-empty list of finite values > 0")


def _anchor_problems(cfg: FlodlConfig) -> Iterator[str]:
    """max_anchor and min_anchor are bounds around anchor."""
    if cfg.max_anchor < cfg.anchor:
        yield problem("max_anchor", cfg.max_anchor, f"must be >= anchor ({cfg.anchor})")
    if cfg.min_anchor is not None and cfg.min_anchor > min(cfg.anchor, cfg.max_anchor):
        yield problem(
            "min_anchor",
            cfg.min_anchor,
            f"must be <= anchor ({cfg.anchor}) and max_anchor ({cfg.max_anchor})",
        )


def _objective_problems(cfg: FlodlConfig) -> Iterator[str]:
    """objective names a value every epoch record holds (loss) or an eval metric of a run that evaluates."""
    name = cfg.objective
    if name is None or name == "loss":
        return
    if not name.startswith("eval/") or not name[len("eval/") :].strip():
        yield problem("objective", name, "must be loss, eval/<a metric of task.eval_fn> or null (eval/loss)")
    elif cfg.eval_every == 0 or cfg.task.eval_data is None:
        yield problem(
            "objective",
            name,
            "names an eval metric, but the run does not evaluate (eval_every=0 or no task.eval_data); use "
            "objective=loss, or turn eval on",
        )

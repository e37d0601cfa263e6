"""Config validation, run before any rank is started.

Pure: host facts (GPU count, free disk) come in as a `HostFacts` value, so every rule is tested
without the hardware. All violations are reported together, each naming key, value and rule.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from flodl.config.host import HostFacts, stage_dir_of
from flodl.config.policy import CHECKPOINT_KEYS, checkpoints_on, writes_in_background
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
    FlodlConfig,
)

GIB = 1 << 30
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
# A heartbeat beats at most every 0.2 s (wire/heartbeat.py): a shorter silence is scheduling noise.
MIN_HEARTBEAT_S = 1.0
# torch's elastic agent kills its ranks this long after it forwards a stop signal to them.
MAX_STOP_GRACE_S = 30.0
# The smallest and largest normal float64: every consensus weight n^gamma and its share must stay in between.
TINY = sys.float_info.min
# Steps of an async window past its count when max_overshoot is null (auto, rounds/elche.py's ceiling).
AUTO_OVERSHOOT = 15
START_METHODS = ("spawn", "fork", "forkserver")
LOGGERS = ("console", "wandb")
WANDB_MODES = ("online", "offline", "disabled")

# Knobs of local SGD (cadence/async): under sync every rank takes exactly one step per averaging,
# so they would have no effect, and a silently ignored knob is a bug report waiting to happen.
LOCAL_SGD_KNOBS = (
    "gamma", "anchor", "min_anchor", "max_anchor", "overhead_target", "max_batch_diff",
    "max_overshoot", "divergence_threshold", "divergence_guard", "quantized_wire",
)  # fmt: skip

# Keys that exist in the schema but whose feature has not landed yet: a value that would need the
# feature is refused rather than ignored. (key, the value that needs no feature, why)
NOT_IMPLEMENTED: tuple[tuple[str, object, str], ...] = (
    ("partition_ratios", None, "partition_ratios (static per-rank split) is not implemented yet"),
)


class ConfigError(ValueError):
    """One or more config values break a rule; the message lists each as `key=value: rule`."""

    def __init__(self, problems: list[str]) -> None:
        # One line per problem, whatever an error's text holds; one problem, one line; several, one block.
        self.problems = [" ".join(p.split()) for p in problems]
        block = "".join(f"\n  - {p}" for p in self.problems)
        lines = self.problems[0] if len(self.problems) == 1 else block
        super().__init__(f"invalid flodl config: {lines}")


def validate(cfg: FlodlConfig, host: HostFacts) -> None:
    """Raise ConfigError listing every broken rule; return quietly when the config is sound."""
    problems = [*_range_problems(cfg), *_cross_field_problems(cfg, host), *_not_implemented(cfg)]
    if problems:
        raise ConfigError(problems)


def _problem(key: str, value: object, rule: str) -> str:
    return f"{key}={value!r}: {rule}"


def _range_problems(cfg: FlodlConfig) -> Iterator[str]:
    # `ok` takes the key's value as the schema types it: a number, or a string of a fixed set.
    def check(key: str, ok: Callable[[Any], bool], rule: str, optional: bool = False) -> Iterator[str]:
        value = _get(cfg, key)
        if value is None and optional:
            return
        if value is None or not ok(value):
            yield _problem(key, value, rule)

    finite = math.isfinite
    yield from check("policy", lambda v: v in POLICIES, f"must be one of {', '.join(POLICIES)}")
    yield from check("backend", lambda v: v in BACKENDS, f"must be one of {', '.join(BACKENDS)}")
    yield from check("device", lambda v: v in DEVICES, f"must be one of {', '.join(DEVICES)}")
    yield from check("divergence_guard", lambda v: v in GUARDS, f"must be one of {', '.join(GUARDS)}")
    yield from check("outer", lambda v: v in OUTERS, f"must be one of {', '.join(OUTERS)}")
    yield from check(
        "quantized_wire",
        lambda v: v in QUANTIZED_WIRES,
        f"must be one of {', '.join(QUANTIZED_WIRES)} or null",
        optional=True,
    )
    yield from check("outer_lr", lambda v: finite(v) and v > 0, "must be finite and > 0", True)
    yield from check("outer_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)", True)
    yield from check("seed", lambda v: 0 <= v <= MAX_SEED, f"must be in [0, {MAX_SEED}] (numpy's seed range)")
    yield from check("epochs", lambda v: v >= 1, "must be >= 1")
    yield from check("steps_per_epoch", lambda v: v >= 1, "must be >= 1 (optimizer steps per rank)", True)
    yield from check("batch_size", lambda v: v >= 1, "must be >= 1 (samples per rank per micro-batch)")
    yield from check(
        "augment",
        lambda v: 1 <= v <= MAX_AUGMENT,
        f"must be in [1, {MAX_AUGMENT}] (views per sample per epoch)",
    )
    yield from check(
        "grad_accum", lambda v: v >= 1, "must be >= 1 micro-batches per optimizer step (1: no accumulation)"
    )
    yield from check("precision", lambda v: v in PRECISIONS, f"must be one of {', '.join(PRECISIONS)}")
    yield from check(
        "compile_mode", lambda v: v in COMPILE_MODES, f"must be one of {', '.join(COMPILE_MODES)}"
    )
    yield from check(
        "peak_tflops", lambda v: finite(v) and v > 0, "must be finite and > 0 (one device's TFLOPS)", True
    )
    yield from check("eval_every", lambda v: v >= 0, "must be >= 0 (0 disables eval)")
    yield from check("max_grad_norm", lambda v: finite(v) and v > 0, "must be a finite value > 0", True)
    yield from check("lr_scale_ratio", lambda v: finite(v) and v >= 0, "must be finite and >= 0")
    yield from check("gamma", finite, "must be finite")
    yield from check("easgd_alpha", lambda v: 0 < v <= 1, "must be in (0, 1]", True)
    yield from check("anchor", lambda v: v >= 1, "must be >= 1")
    yield from check("min_anchor", lambda v: v >= 1, "must be >= 1", True)
    yield from check("max_anchor", lambda v: v >= cfg.anchor, f"must be >= anchor ({cfg.anchor})")
    yield from check("overhead_target", lambda v: 0.01 <= v <= 0.5, "must be in [0.01, 0.5]")
    yield from check("max_batch_diff", lambda v: v >= 0, "must be >= 0", True)
    yield from check("max_overshoot", lambda v: v >= 0, "must be >= 0", True)
    yield from check("divergence_threshold", lambda v: finite(v) and v > 0, "must be finite and > 0", True)
    yield from check("vram_max_usage", lambda v: 0.5 <= v <= 0.99, "must be in [0.5, 0.99]")
    yield from check("ram_max_usage", lambda v: 0.0 <= v <= 0.9, "must be in [0, 0.9]")
    yield from check("disk_stage_gb", lambda v: finite(v) and v >= 0, "must be finite and >= 0 (0: off)")
    yield from check("num_workers", lambda v: v >= 0, "must be >= 0 (0: read in the rank's process)")
    yield from check(
        "prefetch_factor", lambda v: v >= 1, "must be >= 1 (batches each worker reads ahead)", True
    )
    yield from check("checkpoint_every", lambda v: v >= 1, "must be >= 1 (epochs)", True)
    yield from check("checkpoint_every_steps", lambda v: v >= 1, "must be >= 1 (global steps)", True)
    yield from check(
        "checkpoint_every_s", lambda v: finite(v) and v > 0, "must be finite and > 0 (seconds)", True
    )
    yield from check("checkpoint_keep", lambda v: v >= 1, "must be >= 1")
    yield from check(
        "stop_grace_s",
        lambda v: 0 <= v <= MAX_STOP_GRACE_S,
        f"must be in [0, {MAX_STOP_GRACE_S:g}] seconds (0: a stop does not save; torch's launcher kills the "
        f"ranks {MAX_STOP_GRACE_S:g} s after it forwards the signal)",
    )
    yield from check(
        "heartbeat_timeout_s",
        lambda v: MIN_HEARTBEAT_S <= v <= MAX_TIMEOUT_S,
        f"must be in [{MIN_HEARTBEAT_S:g}, {MAX_TIMEOUT_S:g}] seconds (ranks beat every 0.2-1 s; a shorter "
        "silence is ordinary scheduling noise)",
        True,
    )
    yield from check("on_nonfinite", lambda v: v in ON_NONFINITE, f"must be one of {', '.join(ON_NONFINITE)}")
    yield from check("launch.max_restarts", lambda v: v >= 0, "must be >= 0")
    yield from check(
        "fault_tolerance", lambda v: v in FAULT_TOLERANCE, f"must be one of {', '.join(FAULT_TOLERANCE)}"
    )
    yield from check(
        "checkpoint_writer",
        lambda v: v in CHECKPOINT_WRITERS,
        f"must be one of {', '.join(CHECKPOINT_WRITERS)}",
    )
    yield from check("min_ranks", lambda v: v >= 1, "must be >= 1")
    yield from check("simulate.nan_at_step", lambda v: v >= 1, "must be >= 1 (a 1-based step)", True)
    yield from check("simulate.hang_at_step", lambda v: v >= 1, "must be >= 1 (a 1-based step)", True)
    yield from check("simulate.kill_at_step", lambda v: v >= 1, "must be >= 1 (a 1-based step)", True)
    yield from check(
        "simulate.kill_in", lambda v: v in ("window", "round", "start"), "must be window, round or start"
    )
    yield from check("launch.nproc_per_node", lambda v: v >= 1, "must be >= 1")
    yield from check("logger.name", lambda v: v in LOGGERS, f"must be one of {', '.join(LOGGERS)}")
    yield from check(
        "logger.mode",
        lambda v: v in WANDB_MODES,
        f"must be one of {', '.join(WANDB_MODES)} or null (W&B decides)",
        True,
    )
    yield from check("logger.log_every", lambda v: v >= 0, "must be >= 0 steps (0: per epoch only)")
    yield from check("launch.start_method", lambda v: v in START_METHODS, f"must be one of {START_METHODS}")
    yield from check(
        "launch.timeout_s",
        lambda v: MIN_LAUNCH_TIMEOUT_S <= v <= MAX_TIMEOUT_S,
        f"must be in [{MIN_LAUNCH_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds (ranks take seconds to start and "
        "meet; a shorter wait fails a sound run)",
    )
    yield from check(
        "simulate.factor",
        lambda v: 1 <= v <= MAX_SLOW_FACTOR,
        f"must be in [1, {MAX_SLOW_FACTOR:g}] (1: off; a slower rank is a hang: use simulate.hang_*)",
    )
    ratios = cfg.partition_ratios
    if ratios is not None and (not ratios or not all(finite(r) and r > 0 for r in ratios)):
        yield _problem("partition_ratios", ratios, "must be a non-empty list of finite values > 0")
    if cfg.min_anchor is not None and cfg.min_anchor > min(cfg.anchor, cfg.max_anchor):
        yield _problem(
            "min_anchor",
            cfg.min_anchor,
            f"must be <= anchor ({cfg.anchor}) and max_anchor ({cfg.max_anchor})",
        )


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
        yield _problem(
            "gamma",
            cfg.gamma,
            f"must be within +-{bound:.4g}: a window of up to {longest} steps (max_anchor + overshoot) would "
            "weigh n^gamma outside float64's normal range, so rounds would overflow or silently drop ranks",
        )


def _cross_field_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    if cfg.easgd_alpha is not None and cfg.policy != "async":
        yield _problem(
            "easgd_alpha",
            cfg.easgd_alpha,
            f"EASGD blending applies to policy=async only (policy={cfg.policy})",
        )
    if cfg.max_overshoot is not None and cfg.policy != "async":
        yield _problem(
            "max_overshoot", cfg.max_overshoot, f"applies to policy=async only (policy={cfg.policy})"
        )
    if cfg.outer != "avg" and cfg.policy == "sync":
        yield _problem(
            "outer", cfg.outer, "an outer optimizer steps averaged parameters: use policy=cadence or async"
        )
    for key in ("outer_lr", "outer_momentum", "outer_reset_inner"):
        if getattr(cfg, key) is not None and cfg.outer == "avg":
            yield _problem(key, getattr(cfg, key), "applies to outer=slowmo or diloco (outer=avg)")
    if cfg.quantized_wire and cfg.bf16_wire:
        yield _problem(
            "quantized_wire",
            cfg.quantized_wire,
            "one wire at a time: set bf16_wire=false (the quantized wire sends fewer bytes)",
        )
    if cfg.outer == "diloco" and cfg.outer_momentum == 0:
        yield _problem("outer_momentum", 0.0, "DiLoCo's Nesterov step needs a momentum > 0")
    if cfg.divergence_guard != "trend" and cfg.divergence_threshold is not None:
        yield _problem(
            "divergence_threshold",
            cfg.divergence_threshold,
            f"applies to divergence_guard=trend (divergence_guard={cfg.divergence_guard}: "
            + ("no guard reads it)" if cfg.divergence_guard == "none" else "the divergence growth rate)"),
        )
    if cfg.policy == "sync":
        defaults = _defaults()
        for key in LOCAL_SGD_KNOBS:
            if getattr(cfg, key) != defaults[key]:
                yield _problem(
                    key,
                    getattr(cfg, key),
                    "applies to local SGD (policy=cadence or async); policy=sync averages gradients "
                    f"every step, so leave it at its default ({defaults[key]!r})",
                )
    if cfg.device == "cuda" and host.gpus == 0:
        yield _problem("device", cfg.device, "no CUDA device is visible on this host")
    uses_gpus = cfg.device != "cpu" and host.gpus > 0
    if cfg.backend == "nccl" and uses_gpus and host.ranks_per_node > host.gpus:
        yield _problem(
            "backend",
            cfg.backend,
            f"NCCL needs one GPU per rank, but this host runs {host.ranks_per_node} ranks on "
            f"{host.gpus} visible GPU(s); set backend=cpu to share the GPUs round-robin (gloo), lower the "
            "ranks per node, or set device=cpu",
        )
    if host.under_torchrun and cfg.launch.nproc_per_node not in (1, host.ranks_per_node):
        yield _problem(
            "launch.nproc_per_node",
            cfg.launch.nproc_per_node,
            f"torchrun already started {host.ranks_per_node} rank(s) on this node; leave it at 1 "
            "and use torchrun's --nproc_per_node",
        )
    if cfg.launch.start_method == "fork" and host.gpus > 0:
        # Even with device=cpu: a forked rank inherits the launcher's CUDA driver state, and torch's
        # optimizers ask CUDA at their first step (seen on 2x H200: "CUDA error: initialization error").
        yield _problem(
            "launch.start_method",
            "fork",
            "CUDA cannot be used in forked ranks, and this host has a GPU; use spawn or forkserver",
        )
    for name in ("slow_rank", "nan_rank", "hang_rank", "kill_rank"):
        rank: int | None = getattr(cfg.simulate, name)
        if rank is not None and not 0 <= rank < host.world_size:
            yield _problem(f"simulate.{name}", rank, f"must be a rank of this job, 0..{host.world_size - 1}")
    if cfg.on_nonfinite == "skip" and cfg.policy == "sync":
        yield _problem(
            "on_nonfinite",
            "skip",
            "policy=sync mixes every step's gradients (DDP), so a bad window cannot "
            "be dropped; use on_nonfinite=error, or policy=cadence/async",
        )
    if cfg.precision == "fp16" and not uses_gpus:
        yield _problem(
            "precision",
            "fp16",
            f"fp16 autocast with a GradScaler needs CUDA (device={cfg.device}, {host.gpus} GPU(s) visible); "
            "use precision=bf16 on CPU",
        )
    chosen_mode = cfg.compile_mode != "auto" and cfg.compile_mode in COMPILE_MODES  # unknown: named above
    if chosen_mode and not cfg.compile:
        yield _problem(
            "compile_mode", cfg.compile_mode, "applies to compile=true; set compile=true or drop it"
        )
    if host.under_torchrun and cfg.launch.max_restarts:
        yield _problem(
            "launch.max_restarts", cfg.launch.max_restarts, "under torchrun use its own --max-restarts"
        )
    if cfg.policy != "sync":
        yield from _gamma_problems(cfg, host.world_size)
    yield from _overlap_problems(cfg)
    yield from _survive_problems(cfg, host)
    yield from _do_nothing_problems(cfg, host)
    yield from _debug_problems(cfg)
    yield from _disk_problems(cfg, host)
    yield from _loader_problems(cfg)


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
        yield _problem("overlap_rounds", True, f"applies to policy=cadence: {why[cfg.policy]}")
    if cfg.backend != "cpu":
        yield _problem(
            "overlap_rounds",
            True,
            f"needs backend=cpu, whose round runs on a thread while the next window trains (on a GPU too: a "
            f"pinned host snapshot, gloo); backend={cfg.backend} reduces in place on the device and is not "
            "overlapped yet",
        )
    if cfg.fault_tolerance == "survive":
        yield _problem(
            "overlap_rounds",
            True,
            "not with fault_tolerance=survive yet: a round cut while the next window trains is not undone; "
            "set overlap_rounds=false",
        )


def _survive_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    """What fault_tolerance=survive cannot do yet, or cannot do under this launcher."""
    if cfg.fault_tolerance != "survive":
        if cfg.min_ranks != 1:
            yield _problem("min_ranks", cfg.min_ranks, "applies to fault_tolerance=survive")
        return
    if cfg.outer != "avg":
        yield _problem(
            "outer",
            cfg.outer,
            "not with fault_tolerance=survive yet: its state is not restored when a round is cut",
        )
    for key in ("bf16_wire", "quantized_wire"):
        if getattr(cfg, key):
            yield _problem(
                key,
                getattr(cfg, key),
                "not with fault_tolerance=survive yet: its reference copy is not restored when a round is "
                "cut",
            )
    if cfg.steps_per_epoch is not None:
        yield _problem(
            "steps_per_epoch",
            cfg.steps_per_epoch,
            "a stream is not read under fault_tolerance=survive yet: each rank's place in its shard lives in "
            "that rank, and a cut rank's would be lost",
        )
    if not 1 <= cfg.min_ranks <= host.world_size:
        yield _problem("min_ranks", cfg.min_ranks, f"must be in [1, {host.world_size}] (the job's ranks)")
    if host.elastic_agent:
        yield _problem(
            "fault_tolerance",
            "survive",
            "not under torchrun: its agent stops every rank of its host when one dies, and a survive run is "
            "hosted apart from its ranks; self-launch with launch.nproc_per_node, or start flodl-coordinator "
            "and then each rank on its own (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)",
        )


def _loader_problems(cfg: FlodlConfig) -> Iterator[str]:
    if cfg.prefetch_factor is not None and cfg.num_workers == 0:
        yield _problem("prefetch_factor", cfg.prefetch_factor, "applies to num_workers > 0 (as in torch)")
    if cfg.num_workers > 0 and cfg.task.cacheable:
        yield _problem(
            "num_workers",
            cfg.num_workers,
            "task.cacheable=true serves samples from this rank's RAM and disk tiers, which worker processes "
            "cannot fill; use num_workers=0 (after the first read every sample comes from the tiers), or "
            "task.cacheable=false to read afresh in workers",
        )


# Keys only the W&B logger reads (logger.group is also the slots launcher's sweep stamp: not listed).
WANDB_ONLY = ("logger.mode", "logger.project", "logger.entity", "logger.tags")


def _do_nothing_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    """Keys set to a value that this config would silently ignore."""
    defaults = FlodlConfig()
    if cfg.launch.max_restarts and not host.under_torchrun and cfg.launch.nproc_per_node == 1:
        yield _problem(
            "launch.max_restarts",
            cfg.launch.max_restarts,
            "restarts apply to ranks flodl starts itself (launch.nproc_per_node > 1); one in-process rank is "
            "never restarted",
        )
    if not checkpoints_on(cfg):
        if cfg.checkpoint_keep != defaults.checkpoint_keep:
            yield _problem(
                "checkpoint_keep", cfg.checkpoint_keep, f"applies to checkpoints: set {CHECKPOINT_KEYS}"
            )
        if cfg.save_path is not None:
            yield _problem("save_path", cfg.save_path, f"is where checkpoints go: set {CHECKPOINT_KEYS}")
    if cfg.checkpoint_writer != defaults.checkpoint_writer and not writes_in_background(cfg):
        why = (
            "fault_tolerance=survive writes parts at the boundary"
            if cfg.fault_tolerance == "survive"
            else "set checkpoint_background=true"
        )
        yield _problem(
            "checkpoint_writer", cfg.checkpoint_writer, f"applies to parts written in the background: {why}"
        )
    if cfg.checkpoint_every_s is not None and cfg.policy == "sync" and cfg.fault_tolerance == "survive":
        yield _problem(
            "checkpoint_every_s",
            cfg.checkpoint_every_s,
            "under policy=sync needs fault_tolerance=none (the members agree on the step through the store, "
            "which a cut member would leave half agreed); with survive use checkpoint_every_steps",
        )
    if cfg.simulate.slow_rank is None and cfg.simulate.factor != defaults.simulate.factor:
        yield _problem("simulate.factor", cfg.simulate.factor, "slows simulate.slow_rank, which is not set")
    if cfg.logger.name != "wandb":
        for key in WANDB_ONLY:
            if _get(cfg, key) != _get(defaults, key):
                yield _problem(key, _get(cfg, key), f"applies to logger=wandb (logger={cfg.logger.name})")
    if cfg.disk_stage_gb > 0 and cfg.disk_stage_dir is not None and not cfg.disk_stage_dir.strip():
        yield _problem(
            "disk_stage_dir", cfg.disk_stage_dir, "is empty: name a directory, or null for the default"
        )


def _debug_problems(cfg: FlodlConfig) -> Iterator[str]:
    # The disk tier lives under the stager: a switched-off stager would silently ignore it.
    for switch in ("debug.data_plane", "debug.stager"):
        if not _get(cfg, switch) and cfg.disk_stage_gb > 0:
            yield _problem(
                "disk_stage_gb",
                cfg.disk_stage_gb,
                f"the disk tier is part of the stager, which {switch}=false turns off; set disk_stage_gb=0 "
                f"or {switch}=true",
            )
            return


def _disk_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    if cfg.disk_stage_gb <= 0:
        if cfg.disk_stage_dir is not None:
            yield _problem(
                "disk_stage_dir", cfg.disk_stage_dir, "applies to the disk tier: set disk_stage_gb > 0"
            )
        return
    stage_dir = stage_dir_of(cfg.disk_stage_dir)
    if host.stage_dir_free_bytes is None:
        yield _problem(
            "disk_stage_dir", stage_dir, "is not an existing directory; create it or point elsewhere"
        )
        return
    needed = cfg.disk_stage_gb * GIB * host.ranks_per_node
    if needed > host.stage_dir_free_bytes:
        yield _problem(
            "disk_stage_gb",
            cfg.disk_stage_gb,
            f"{host.ranks_per_node} rank(s) x {cfg.disk_stage_gb} GiB exceeds the "
            f"{host.stage_dir_free_bytes / GIB:.1f} GiB free in {stage_dir}",
        )


def _not_implemented(cfg: FlodlConfig) -> Iterator[str]:
    for key, featureless, why in NOT_IMPLEMENTED:
        value = _get(cfg, key)
        if value != featureless:
            yield _problem(key, value, why)


def _get(cfg: FlodlConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(FlodlConfig)}

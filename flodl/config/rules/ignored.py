"""Keys set to a value the rest of the config would silently ignore, and keys whose feature has not landed."""

from __future__ import annotations

from collections.abc import Iterator

from flodl.config.host import HostFacts
from flodl.config.policy import CHECKPOINT_KEYS, checkpoints_on, writes_in_background
from flodl.config.rules.problem import problem, value_at
from flodl.config.schema import COMPILE_MODES, FlodlConfig

# Keys only the W&B logger reads (logger.group is also the slots launcher's sweep stamp: not listed).
WANDB_ONLY = ("logger.mode", "logger.project", "logger.entity", "logger.tags")
# Keys that exist in the schema but whose feature has not landed yet: a value that would need the
# feature is refused rather than ignored. (key, the value that needs no feature, why)
NOT_IMPLEMENTED: tuple[tuple[str, object, str], ...] = (
    ("partition_ratios", None, "partition_ratios (static per-rank split) is not implemented yet"),
)


def ignored_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    defaults = FlodlConfig()
    chosen_mode = cfg.compile_mode != "auto" and cfg.compile_mode in COMPILE_MODES  # unknown: named apart
    if chosen_mode and not cfg.compile:
        yield problem(
            "compile_mode", cfg.compile_mode, "applies to compile=true; set compile=true or drop it"
        )
    if cfg.launch.max_restarts and not host.under_torchrun and host.world_size == 1:
        yield problem(
            "launch.max_restarts",
            cfg.launch.max_restarts,
            "restarts apply to ranks flodl starts (launch.nproc_per_node > 1, or ranks started apart under "
            "fault_tolerance=survive); one in-process rank is never restarted",
        )
    yield from _checkpoint_problems(cfg, defaults)
    if cfg.keep_global_batch and cfg.policy != "sync":
        yield problem(
            "keep_global_batch",
            cfg.keep_global_batch,
            f"applies to policy=sync (under {cfg.policy} each rank steps its own batch; a resume on another "
            "world keeps every rank's step)",
        )
    if cfg.simulate.slow_rank is None and cfg.simulate.factor != defaults.simulate.factor:
        yield problem("simulate.factor", cfg.simulate.factor, "slows simulate.slow_rank, which is not set")
    if cfg.logger.name != "wandb":
        for key in WANDB_ONLY:
            if value_at(cfg, key) != value_at(defaults, key):
                yield problem(key, value_at(cfg, key), f"applies to logger=wandb (logger={cfg.logger.name})")
    yield from _disk_tier_problems(cfg)


def _checkpoint_problems(cfg: FlodlConfig, defaults: FlodlConfig) -> Iterator[str]:
    if not checkpoints_on(cfg):
        if cfg.checkpoint_keep != defaults.checkpoint_keep:
            yield problem(
                "checkpoint_keep", cfg.checkpoint_keep, f"applies to checkpoints: set {CHECKPOINT_KEYS}"
            )
        if cfg.save_path is not None:
            yield problem("save_path", cfg.save_path, f"is where checkpoints go: set {CHECKPOINT_KEYS}")
    if cfg.checkpoint_writer != defaults.checkpoint_writer and not writes_in_background(cfg):
        why = (
            "fault_tolerance=survive writes parts at the boundary"
            if cfg.fault_tolerance == "survive"
            else "set checkpoint_background=true"
        )
        yield problem(
            "checkpoint_writer", cfg.checkpoint_writer, f"applies to parts written in the background: {why}"
        )


def _disk_tier_problems(cfg: FlodlConfig) -> Iterator[str]:
    if cfg.disk_stage_gb <= 0:
        if cfg.disk_stage_dir is not None:
            yield problem(
                "disk_stage_dir", cfg.disk_stage_dir, "applies to the disk tier: set disk_stage_gb > 0"
            )
        return
    if cfg.disk_stage_dir is not None and not cfg.disk_stage_dir.strip():
        yield problem(
            "disk_stage_dir", cfg.disk_stage_dir, "is empty: name a directory, or null for the default"
        )
    # The disk tier lives under the stager: a switched-off stager would silently ignore it.
    for switch in ("debug.data_plane", "debug.stager"):
        if not value_at(cfg, switch):
            yield problem(
                "disk_stage_gb",
                cfg.disk_stage_gb,
                f"the disk tier is part of the stager, which {switch}=false turns off; set disk_stage_gb=0 "
                f"or {switch}=true",
            )
            return


def not_implemented(cfg: FlodlConfig) -> Iterator[str]:
    for key, featureless, why in NOT_IMPLEMENTED:
        value = value_at(cfg, key)
        if value != featureless:
            yield problem(key, value, why)

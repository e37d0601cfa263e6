"""The config mapped to the small settings each room defines for itself: the one place (with
flodl/launcher/launch.py for what runs before any rank) that reads the schema for the rooms below; nothing
under it does. The assembly (flodl/job/assembly.py) builds the rank's parts from these settings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flodl.checkpoints.disk import CheckpointDir
from flodl.config.host import GIB, RankEnv, stage_dir_of
from flodl.config.policy import PolicyFacts, compile_mode_for, step_samples
from flodl.config.schema import FlodlConfig
from flodl.coordinator.commit import run_kind
from flodl.data.feeder import DataPlaneSettings
from flodl.job.resume import ResumeSettings
from flodl.metrics.sinks import METRICS_FILE
from flodl.metrics.wandb_sink import WandbSettings
from flodl.rounds.elche import ElCheSettings
from flodl.worker.base import WorkerSettings
from flodl.worker.faults import FaultInjection
from flodl.worker.stepper import StepperSettings
from flodl.worker.task_setup import TaskSettings


def data_plane_settings(
    cfg: FlodlConfig, ranks_on_host: int, rank: int = 0, world_size: int = 1
) -> DataPlaneSettings:
    return DataPlaneSettings(
        batch_size=cfg.batch_size,
        augment=cfg.augment,
        seed=cfg.seed,
        ram_max_usage=cfg.ram_max_usage,
        vram_max_usage=cfg.vram_max_usage,
        sample_cache=cfg.sample_cache,
        vram_pool=cfg.vram_pool,
        disk_stage_bytes=int(cfg.disk_stage_gb * GIB),
        stage_dir=stage_dir_of(cfg.disk_stage_dir),
        stager=cfg.debug.stager,
        data_plane=cfg.debug.data_plane,
        ranks_on_host=ranks_on_host,
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        persistent_workers=cfg.persistent_workers,
        pin_memory=cfg.pin_memory,
        rank=rank,
        world_size=world_size,
        stream_split=cfg.task.stream_split,
    )


def stepper_settings(
    cfg: FlodlConfig, env: RankEnv, device_type: str, first_start: bool = True
) -> StepperSettings:
    """`first_start`: false for a rank that joins a running job (survive's restart) or that torch's elastic
    agent restarted (launch.max_restarts): simulate's faults fire once per run, so a restart runs clean."""
    sim = cfg.simulate

    def at(step: int | None, rank: int) -> int | None:
        return step if rank == env.rank and first_start else None

    return StepperSettings(
        data=data_plane_settings(cfg, env.local_world_size, env.rank, env.world_size),
        max_grad_norm=cfg.max_grad_norm,
        slow_factor=sim.factor if sim.slow_rank == env.rank else 1.0,
        fault=FaultInjection(
            at(sim.nan_at_step, sim.nan_rank),
            at(sim.hang_at_step, sim.hang_rank),
            at(sim.kill_at_step, sim.kill_rank),
            sim.kill_in,
        ),
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        compile_mode=compile_mode_for(cfg, device_type, env.world_size),
        peak_tflops=cfg.peak_tflops,
    )


def worker_settings(cfg: FlodlConfig, evaluated_models: Path | None = None) -> WorkerSettings:
    return WorkerSettings(cfg.logger.log_every, cfg.on_nonfinite, evaluated_models)


def task_settings(cfg: FlodlConfig) -> TaskSettings:
    return TaskSettings(
        targets=dataclasses.asdict(cfg.task),
        seed=cfg.seed,
        lr_scale_ratio=cfg.lr_scale_ratio,
        check_purity=cfg.debug.check_purity,
        num_workers=cfg.num_workers,
        precision=cfg.precision,
    )


def checkpoint_store(cfg: FlodlConfig, run_dir: Path) -> CheckpointDir:
    """The run's checkpoints: under save_path, or the run dir."""
    return CheckpointDir(Path(cfg.save_path) if cfg.save_path else run_dir, cfg.checkpoint_keep)


def resume_settings(cfg: FlodlConfig, run_dir: Path, run: dict[str, Any]) -> ResumeSettings:
    """`run`: this run's identity (flodl/checkpoints/identity.py: from the config, world size and uid)."""
    policy = PolicyFacts.of(cfg)
    kind = run_kind(policy.name, policy.averages_parameters)
    return ResumeSettings(
        cfg.resume,
        checkpoint_store(cfg, run_dir),
        kind,
        run,
        run_dir / METRICS_FILE,
        cfg.batch_size,
        step_samples(cfg),
        cfg.keep_global_batch,
        cfg.shard_group > 1,
    )


def wandb_settings(cfg: FlodlConfig) -> WandbSettings:
    logger = cfg.logger
    return WandbSettings(
        mode=logger.mode,
        project=logger.project,
        entity=logger.entity,
        tags=None if logger.tags is None else tuple(logger.tags),
        group=logger.group,
        run_name=logger.run_name,
        job_type=logger.job_type,
        notes=logger.notes,
        required=logger.required,
    )


def elche_settings(cfg: FlodlConfig, world_size: int, policy: PolicyFacts) -> ElCheSettings:
    return ElCheSettings(
        world_size=world_size,
        anchor=cfg.anchor,
        min_anchor=cfg.min_anchor,
        max_anchor=cfg.max_anchor,
        overhead_target=cfg.overhead_target,
        max_batch_diff=cfg.max_batch_diff,
        max_overshoot=cfg.max_overshoot,
        is_async=policy.crosses_epochs,
        group_size=cfg.shard_group,
    )

"""Which checkpoint a run continues from, agreed by every rank, and putting the run back there."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed import PrefixStore

from flodl.checkpoints.disk import (
    COORDINATOR_FILE,
    Checkpoint,
    CheckpointDir,
    CheckpointError,
    atomic_write_bytes,
    rank_file,
    resolve_resume,
)
from flodl.checkpoints.identity import check_identity
from flodl.checkpoints.sharded import SHARDED_DIR
from flodl.config.layout import Layout
from flodl.config.schema import FlodlConfig
from flodl.counting import shown_epoch
from flodl.job.resize import Resize, grad_accum_for, keep_batch_problem, resumed_layout, stream_problem
from flodl.links.group import publish_json, read_json
from flodl.metrics.sinks import read_history, record_line
from flodl.worker.base import WorkerBase
from flodl.worker.rank_state import restore_stepper, shared_state

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class ResumeSettings:
    """Which checkpoint a run continues from, and what it must match (mapped once, by the assembly)."""

    # auto, never, or the path of a checkpoint dir or run dir.
    resume: str
    # This run's checkpoints (under save_path, or the run dir).
    checkpoints: CheckpointDir
    # The policy facts a checkpoint must share with this run (flodl/coordinator/commit.py's run_kind).
    kind: dict[str, Any]
    # This run's identity (flodl/checkpoints/identity.py): what its checkpoints record, what resume=auto
    # checks.
    run: dict[str, Any]
    # The run's metrics.jsonl, put in line with the checkpoint it resumes (or moved aside on a fresh start).
    metrics: Path
    # Samples per rank micro-batch, and per rank step as configured (batch_size x grad_accum).
    batch_size: int = 1
    step_samples: int = 1
    # Sync on another world: keep the checkpoint's global batch by gradient accumulation (job/resize.py).
    keep_global_batch: bool = False
    # The run shards its model (shard_group > 1): it resumes only a checkpoint of sharded groups, of any
    # layout (flodl/worker/sharded_state.py).
    sharded: bool = False


def choose_checkpoint(settings: ResumeSettings, world_size: int) -> Checkpoint | None:
    """The checkpoint `resume` names, checked against this run's identity and policy, and on another world
    size against what the resize keeps."""
    return _checked_choice(settings, world_size)[0]


def _checked_choice(settings: ResumeSettings, world_size: int) -> tuple[Checkpoint | None, Layout]:
    """The checkpoint, checked, and the layout the run resumed from it on `world_size` ranks is laid out for
    (a fresh run: this world); keep_global_batch is refused where its global batch does not divide."""
    found = resolve_resume(settings.resume, settings.checkpoints)
    kept = settings.keep_global_batch and not settings.kind["local_sgd"]
    fresh = Layout(world_size, settings.step_samples, kept)
    if found is None:
        return None, fresh
    check_identity(found, settings.run, settings.resume)
    saved = coordinator_state(found)
    check_run_kind(found, saved, settings.kind)
    if settings.sharded and not found.sharded:
        raise CheckpointError(
            f"checkpoint {found.path} was written by full replicas (its optimizer state one rank's whole), "
            "and shard_group > 1 resumes only a checkpoint of sharded groups yet: resume it with "
            "shard_group=1, or start fresh with resume=never"
        )
    layout = resumed_layout(fresh, saved, len(found.part_ranks))
    problem = keep_batch_problem(layout, world_size, settings.batch_size) if kept else None
    if problem is not None:
        raise CheckpointError(f"checkpoint {found.path}: {problem}")
    return found, layout


def resize_of(checkpoint: Checkpoint, world_size: int, shares_optimizer: bool) -> Resize:
    return Resize(checkpoint.world_size, checkpoint.part_ranks, world_size, shares_optimizer)


def publish_checkpoint_choice(
    settings: ResumeSettings, world_size: int, exchange: PrefixStore
) -> Checkpoint | None:
    """The run's host chooses (so every rank loads the same checkpoint, even while files change), puts the run
    dir's history in line with it, and publishes its choice as JSON (or why there is none to load)."""
    for swept in settings.checkpoints.sweep_partial():  # before any rank of this run writes a part
        log.info("removed %s: a checkpoint an earlier start left uncommitted", swept)
    try:
        found, layout = _checked_choice(settings, world_size)
        prepare_history(settings.metrics, settings.checkpoints, found)
    except CheckpointError as err:
        publish_json(exchange, "checkpoint", {"error": str(err)})
        raise
    saved = (
        [str(found.path), found.epoch, found.world_size, found.run, found.part_ranks, found.into]
        if found
        else None
    )
    # keep_global_batch: the micro-batches per rank step that make the checkpoint's global batch up here.
    accum = grad_accum_for(layout, world_size, settings.batch_size) if found and layout.kept else None
    choice = {"checkpoint": saved, "grad_accum": accum, "layout": layout.state()}
    publish_json(exchange, "checkpoint", choice)
    return found


def agreed_config(cfg: FlodlConfig, exchange: PrefixStore) -> FlodlConfig:
    """The run's config as the checkpoint the host chose leaves it: under keep_global_batch, the grad_accum
    that keeps its global batch on this world."""
    accum = read_json(exchange, "checkpoint").get("grad_accum")
    if accum is None or accum == cfg.grad_accum:
        return cfg
    log.info(
        "keep_global_batch=true: grad_accum %d (configured %d) keeps the checkpoint's global batch",
        accum,
        cfg.grad_accum,
    )
    return replace(cfg, grad_accum=int(accum))


def agreed_layout(exchange: PrefixStore) -> Layout:
    """The layout the run's host built with its choice of checkpoint (flodl/config/layout.py)."""
    return Layout.from_state(read_json(exchange, "checkpoint")["layout"])


def agreed_checkpoint(rank: int, exchange: PrefixStore) -> Checkpoint | None:
    """The checkpoint the host chose, as every rank loads it; a bad choice fails on every rank with the
    host's reason."""
    choice = read_json(exchange, "checkpoint")
    if "error" in choice:
        raise CheckpointError(choice["error"])
    if choice["checkpoint"] is None:
        return None
    path, epoch, saved_world, saved_run, ranks, into = choice["checkpoint"]
    checkpoint = Checkpoint(Path(path), int(epoch), int(saved_world), saved_run, tuple(ranks), into)
    if not checkpoint.path.is_dir():
        raise CheckpointError(
            f"rank {rank} cannot see checkpoint {path} (the run's host can): put save_path on storage every "
            "host sees"
        )
    return checkpoint


def covers_every_epoch(checkpoint: Checkpoint, epochs: int) -> bool:
    """A run of `epochs` resumed from `checkpoint` has nothing left to train."""
    return checkpoint.point.next_epoch >= epochs


def load_model(checkpoint: Checkpoint, model: nn.Module) -> None:
    """Before the worker is built: DDP and the averagers start every rank from rank 0's parameters. A
    sharded checkpoint's model is read whole (from its shards), before the model is sharded, as the task
    built it whole."""
    model.load_state_dict(checkpoint.model())


def restore_worker(checkpoint: Checkpoint, worker: WorkerBase, world_size: int) -> None:
    """Put the rank back where its part of the checkpoint left it, or where the part flodl/job/resize.py
    names for it leaves a rank that has none (another world size, or no member at the checkpoint round):
    the consensus model (load_model) and what that part holds that another rank may take."""
    resize = resize_of(checkpoint, world_size, worker.shares_optimizer)
    source = resize.source(worker.rank)
    part = checkpoint.load(rank_file(source))
    problem = stream_problem(checkpoint.world_size, world_size)
    if part["stepper"].get("data") is not None and problem is not None:  # readers at the saved world's split
        raise CheckpointError(f"checkpoint {checkpoint.path}: {problem}")
    owns = resize.owns(worker.rank)
    restore_stepper(worker.stepper, part["stepper"] if owns else shared_state(part["stepper"]))
    # Each rank reads its shard of the optimizer's state (and outer momentum): under sync before the worker
    # scales the learning rate to this world (the shards' param groups hold the saved world's); under local
    # SGD after its outer optimizer's state, whose momentum the shards hold.
    sharded = worker.sharded_state if checkpoint.sharded else None
    if sharded is not None and worker.shares_optimizer:
        sharded.load(checkpoint.path / SHARDED_DIR)
    worker.restore(part["worker"] if owns else worker.shared_state(part["worker"]))
    if sharded is not None and not worker.shares_optimizer:
        sharded.load(checkpoint.path / SHARDED_DIR)
    if owns:
        log.info("resumed from %s: training continues %s", checkpoint.path, continues_at(checkpoint))
    else:
        log.info(
            "rank %d has no part in %s: it resumes from the consensus with rank %d's optimizer state; "
            "training continues %s",
            worker.rank,
            checkpoint.path,
            source,
            continues_at(checkpoint),
        )
    worker.stepper.storage.check(f"resuming from {checkpoint.path}")


def continues_at(checkpoint: Checkpoint) -> str:
    """Where a run resumed from `checkpoint` continues, in words."""
    point = checkpoint.point
    if point.into is None:
        return f"at epoch {shown_epoch(point.next_epoch)}"
    return f"inside epoch {shown_epoch(point.epoch)}, {point.into} samples into it"


def coordinator_state(checkpoint: Checkpoint) -> dict[str, Any]:
    return checkpoint.load(COORDINATOR_FILE)


def prepare_history(metrics_path: Path, checkpoints: CheckpointDir, resumed: Checkpoint | None) -> None:
    """Each epoch once in `metrics.jsonl`. A resumed run keeps the records of the epochs its checkpoint
    covers (it writes the rest again); a fresh start moves an earlier start's history (metrics and
    checkpoints) aside as `*.superseded-N`, so neither its records nor its checkpoints mix with this run's."""
    if resumed is not None:
        truncate_history(metrics_path, resumed.point.last_whole_epoch)
        return
    old = [path for path in (metrics_path, checkpoints.root) if path.exists()]
    if not old:
        return
    n = 1
    while any(path.with_name(f"{path.name}.superseded-{n}").exists() for path in old):
        n += 1
    for path in old:
        path.rename(path.with_name(f"{path.name}.superseded-{n}"))
    log.warning(
        "a fresh start: the earlier history here moved aside as %s",
        ", ".join(f"{p}.superseded-{n}" for p in old),
    )


def truncate_history(metrics_path: Path, through_epoch: int) -> None:
    """Keep one record (the latest) of each epoch the checkpoint covers: the resumed run writes the rest
    again. Rewritten atomically: a crash leaves the old file or the new one."""
    if not metrics_path.is_file():
        return
    kept = {r["epoch"]: r for r in read_history(metrics_path) if r["epoch"] <= through_epoch}
    lines = "".join(record_line(kept[e]) for e in sorted(kept))
    atomic_write_bytes(lines.encode(), metrics_path)


def check_run_kind(checkpoint: Checkpoint, saved: dict[str, Any], kind: dict[str, Any]) -> None:
    """The coordinator's state belongs to its policy (sync keeps none, local SGD keeps ElChe's)."""
    theirs = {key: saved.get(key) for key in kind}
    if theirs != kind:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written under policy={theirs['policy']} (local SGD: "
            f"{theirs['local_sgd']}); this run has policy={kind['policy']} (local SGD: {kind['local_sgd']}). "
            "Resume with the policy that wrote it, or start fresh with resume=never."
        )

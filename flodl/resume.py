"""Which checkpoint a run continues from, agreed by every rank, and putting the run back there."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from flodl.checkpoint import (
    COORDINATOR_FILE,
    MODEL_FILE,
    Checkpoint,
    CheckpointDir,
    CheckpointError,
    resolve_resume,
)
from flodl.worker.base import WorkerBase
from flodl.worker.checkpoint_part import restore_rank_part

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class ResumeSettings:
    """Which checkpoint a run continues from, and what it must match (mapped once, by flodl/assembly.py)."""

    # auto, never, or the path of a checkpoint dir or run dir.
    resume: str
    # This run's checkpoints (under save_path, or the run dir).
    checkpoints: CheckpointDir
    # The policy facts a checkpoint must share with this run (flodl/coordinator/commit.py's run_kind).
    kind: dict[str, Any]


def choose_checkpoint(settings: ResumeSettings, world_size: int) -> Checkpoint | None:
    """The checkpoint `resume` names, checked against this run's world size and policy."""
    found = resolve_resume(settings.resume, settings.checkpoints)
    if found is not None:
        check_world_size(found, world_size)
        check_run_kind(found, coordinator_state(found), settings.kind)
    return found


def agree_on_checkpoint(settings: ResumeSettings, rank: int, world_size: int) -> Checkpoint | None:
    """Rank 0 chooses (so every rank loads the same checkpoint, even while files change) and broadcasts its
    choice; a bad choice fails on every rank with rank 0's reason."""
    choice: list[Any] = [None]
    if rank == 0:
        try:
            found = choose_checkpoint(settings, world_size)
            if found is not None:
                choice = [("ok", str(found.path), found.epoch, found.world_size)]
        except CheckpointError as err:
            choice = [("error", str(err))]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if choice[0][0] == "error":
        raise CheckpointError(choice[0][1])
    _, path, epoch, saved_world = choice[0]
    checkpoint = Checkpoint(Path(path), epoch, saved_world)
    if not checkpoint.path.is_dir():
        raise CheckpointError(
            f"rank {rank} cannot see checkpoint {path} (rank 0 can): put save_path on storage every host sees"
        )
    return checkpoint


def load_model(checkpoint: Checkpoint, model: nn.Module) -> None:
    """Before the worker is built: DDP and the averagers start every rank from rank 0's parameters."""
    model.load_state_dict(checkpoint.load(MODEL_FILE))


def restore_worker(checkpoint: Checkpoint, worker: WorkerBase) -> None:
    worker.restore(restore_rank_part(checkpoint, worker.rank, worker.stepper))
    log.info("resumed from %s: training continues at epoch %d", checkpoint.path, checkpoint.epoch + 1)


def coordinator_state(checkpoint: Checkpoint) -> dict[str, Any]:
    return checkpoint.load(COORDINATOR_FILE)


def truncate_history(metrics_path: Path, through_epoch: int) -> None:
    """Keep the metric records of epochs the checkpoint covers: the resumed run writes the rest again."""
    if not metrics_path.is_file():
        return
    kept = [
        line
        for line in metrics_path.read_text().splitlines()
        if line.strip() and json.loads(line).get("epoch", -1) <= through_epoch
    ]
    metrics_path.write_text("".join(f"{line}\n" for line in kept))


def check_run_kind(checkpoint: Checkpoint, saved: dict[str, Any], kind: dict[str, Any]) -> None:
    """The coordinator's state belongs to its policy (sync keeps none, local SGD keeps ElChe's)."""
    theirs = {key: saved.get(key) for key in kind}
    if theirs != kind:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written under policy={theirs['policy']} (local SGD: "
            f"{theirs['local_sgd']}); this run has policy={kind['policy']} (local SGD: {kind['local_sgd']}). "
            "Resume with the policy that wrote it, or start fresh with resume=never."
        )


def check_world_size(checkpoint: Checkpoint, world_size: int) -> None:
    """Each rank's optimizer state and data position belong to its rank: a checkpoint resumes only at the
    world size that wrote it."""
    if checkpoint.world_size != world_size:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written by {checkpoint.world_size} rank(s); this job has "
            f"{world_size}. Resume with {checkpoint.world_size} ranks, or start fresh with resume=never "
            "(its model.pt loads into any world size)."
        )

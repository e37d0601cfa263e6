"""Which run wrote a checkpoint, and whether this run may resume it.

Every checkpoint's manifest records its run: the uid (flodl/launcher/run_dir.py: shared by every rank and
every restart of one launch) and the config that decides what the saved state means. `RESUME_KEYS` are those
keys: change one and the optimizer state, the data order or the averaging math of the checkpoint belong to
another experiment. Everything else (epochs, checkpointing, logging, timeouts, simulate.*) may change
between a run and its resumption (`epochs=4` then `epochs=6` extends a run), and so may the world size: a
checkpoint resumes on any number of ranks (flodl/job/resize.py). Manifests before that recorded the world
size among the keys; it is not compared.

`resume=auto` takes a checkpoint when its run is this one (a restart), or when it was written with the same
resume config (the same run continued in its own dir); anything else is refused with the keys that differ.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flodl.checkpoints.disk import Checkpoint, CheckpointError

RESUME_KEYS = (
    "policy",
    "seed",
    "batch_size",
    "augment",
    "lr_scale_ratio",
    "max_grad_norm",
    "gamma",
    "easgd_alpha",
    "outer",
    "outer_lr",
    "outer_momentum",
    "partition_ratios",
    "task",
)


def run_identity(config: dict[str, Any], uid: str) -> dict[str, Any]:
    """What a checkpoint records about the run that writes it (plain JSON values)."""
    resumes_with = {key: config.get(key) for key in RESUME_KEYS}
    digest = hashlib.sha256(json.dumps(resumes_with, sort_keys=True, default=str).encode()).hexdigest()
    return {"uid": uid, "config_sha256": digest, "config": resumes_with}


def check_identity(checkpoint: Checkpoint, mine: dict[str, Any], resume: str) -> None:
    """Refuse a checkpoint of another experiment (under resume=auto, also one that does not say whose)."""
    theirs = checkpoint.run
    if theirs is None:
        if resume == "auto":
            raise CheckpointError(
                f"checkpoint {checkpoint.path} does not record the run that wrote it (an older flodl), so "
                f"resume=auto cannot tell it is this run's: name it with resume={checkpoint.path} to resume "
                "it anyway, or start over with resume=never"
            )
        return
    their_config = {k: v for k, v in theirs.get("config", {}).items() if k != "world_size"}
    if theirs.get("uid") == mine["uid"] or their_config == mine["config"]:
        return
    differ = sorted(set(mine["config"]) | set(their_config))
    differ = [k for k in differ if mine["config"].get(k) != their_config.get(k)]
    shown = "; ".join(
        f"{k}: {json.dumps(their_config.get(k), default=str)} there, "
        f"{json.dumps(mine['config'].get(k), default=str)} here"
        for k in differ
    )
    why = (
        f"checkpoint {checkpoint.path} belongs to run {theirs.get('uid')}, whose config differs from this "
        f"run's ({shown})"
    )
    if resume == "auto":
        raise CheckpointError(
            f"{why}: resume=auto resumes only its own run; give this run its own hydra.run.dir (or leave it "
            "out), or start over here with resume=never"
        )
    raise CheckpointError(f"{why}: resume it with the config that wrote it")

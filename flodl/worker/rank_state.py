"""What one rank must keep to continue exactly: optimizer, scheduler, GradScaler, float8's maxima seen, RNG
streams, step counters and, reading a stream, where its readers stand."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from flodl.sharding.fsdp import is_sharded
from flodl.worker.float8 import restore_scaling, scaling_state
from flodl.worker.stepper import Stepper


def rng_state(device: torch.device) -> dict[str, Any]:
    _, python_keys, python_gauss = random.getstate()
    numpy_state = np.random.get_state()
    assert isinstance(numpy_state, tuple)  # the global generator is MT19937: its legacy tuple, never a dict
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = numpy_state
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # A tensor, not a list of 625 ints: a checkpoint's state is walked leaf by leaf at every save.
        "python": [torch.tensor(python_keys, dtype=torch.int64), python_gauss],
        # As plain values and tensors: checkpoints load with weights_only=True.
        "numpy": [
            torch.from_numpy(numpy_keys.astype(np.int64)),
            int(numpy_pos),
            int(numpy_has_gauss),
            float(numpy_gauss),
        ],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    python_keys, python_gauss = state["python"]
    if isinstance(python_keys, torch.Tensor):  # a tensor since 2026-12-02, a list in older checkpoints
        python_keys = python_keys.tolist()
    random.setstate((3, tuple(python_keys), python_gauss))
    numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = state["numpy"]
    np.random.set_state(
        ("MT19937", numpy_keys.numpy().astype(np.uint32), numpy_pos, numpy_has_gauss, numpy_gauss)
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def stepper_state(stepper: Stepper) -> dict[str, Any]:
    parts = stepper.parts
    return {
        # A sharded model's: each rank's shard, written beside the part (flodl/sharding/fsdp.py).
        "optimizer": None if is_sharded(parts.model) else parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
        "steps_total": stepper.steps_total,
        "schedule_position": stepper.schedule_position,
        "rng": rng_state(stepper.device),
        # fp16's loss scale and growth tracker (empty otherwise): a resumed run steps with the same scale.
        "scaler": stepper.scaler.state_dict(),
        # fp8's maxima seen the step before, by layer (empty otherwise): the next step's casts.
        "float8": scaling_state(parts.model),
        # A stream's readers after the batches trained (flodl/data/stream.py); None for any other data.
        "data": stepper.feeder.state(),
    }


def shared_state(state: dict[str, Any]) -> dict[str, Any]:
    """Of a `stepper_state`, what another rank may take over under sync (every rank steps the same optimizer
    state): all but the RNG streams and a stream's readers, which stay each rank's own."""
    return {key: value for key, value in state.items() if key not in ("rng", "data")}


def restore_stepper(stepper: Stepper, state: dict[str, Any]) -> None:
    parts = stepper.parts
    if state["optimizer"] is not None and is_sharded(parts.model):
        raise ValueError(
            "the checkpoint's optimizer state was written by full replicas, this run trains sharded groups: "
            "resume it with shard_group=1, or start fresh with resume=never"
        )
    if state["optimizer"] is not None:  # a sharded run's lies in shards of its own (sharded_state.py)
        parts.optimizer.load_state_dict(state["optimizer"])
    if parts.scheduler is not None and state["scheduler"] is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    stepper.steps_total = int(state["steps_total"])
    stepper.schedule_position = int(state["schedule_position"])
    if state.get("scaler"):  # empty under fp32/bf16 (and absent from checkpoints older than precision)
        stepper.scaler.load_state_dict(state["scaler"])
    restore_scaling(parts.model, state.get("float8", {}))  # absent from checkpoints before 2026-12-05
    if "rng" in state:  # absent from a `shared_state`: this rank keeps its own streams (and readers)
        set_rng_state(state["rng"], stepper.device)
        _restore_readers(stepper, state.get("data"))


def _restore_readers(stepper: Stepper, data: dict[str, Any] | None) -> None:
    """A stream's readers continue from the checkpoint's positions (a feeder of other data refuses them)."""
    if data is not None:
        stepper.feeder.restore(data)
    elif stepper.feeder.in_order:
        raise ValueError(
            "the checkpoint was written by a run whose task.train_data was no stream (an IterableDataset), "
            "this run's is one: resume it with the same data, or start fresh with resume=never"
        )

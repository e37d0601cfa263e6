"""The coordinator's side of a checkpoint: commit an epoch once every rank wrote its part.

A checkpoint is taken where every rank holds the same consensus: after a sync epoch, or after the exact
reduce that ends a local-SGD segment. Each rank writes its part (flodl/worker/checkpoint_part.py) and says
so; the coordinator, once every part is on disk and the epoch is emitted, writes its own state and commits
(see flodl/checkpoint.py). With a rank cut, the parts are the members' at the checkpoint round.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl.checkpoint import COORDINATOR_FILE, Checkpoint, CheckpointDir, atomic_save
from flodl.coordinator.ledger import EpochLedger
from flodl.counting import shown_epoch

log = logging.getLogger("flodl")


HANG_MODEL_FILE = "model-at-hang.pt"


def consensus_saver(model: nn.Module, device: torch.device, path: Path) -> Callable[[], None]:
    """Under sync, rank 0's parameters are the consensus: a silent peer holds the next gradient all-reduce
    open, so no optimizer step can change them any more. The copy runs on a CUDA stream of its own, because
    the training stream waits for that all-reduce forever."""

    def save() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            state = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        atomic_save(state, path)
        log.error("rank 0's parameters at the hang (the consensus, policy=sync) saved to %s", path)

    return save


def run_kind(policy: str, local_sgd: bool) -> dict[str, Any]:
    return {"policy": policy, "local_sgd": local_sgd}


@dataclass
class CheckpointCommitter:
    """The coordinator's side: commit an epoch's checkpoint once every rank saved and it is emitted."""

    store: CheckpointDir
    world_size: int
    # Epochs whose checkpoint is still to be committed: the run is not over before they are.
    remaining: set[int]
    # What the driver's state means: the policy, and whether it averages in local-SGD rounds.
    kind: dict[str, Any]
    # Who wrote it, for the manifest (flodl/run_identity.py): resume=auto resumes only its own run.
    run: dict[str, Any]
    saved: dict[int, set[int]] = field(default_factory=dict)
    driver_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    committed: Checkpoint | None = None
    # Per epoch, the ranks whose parts its checkpoint waits for (absent: every rank).
    expected: dict[int, frozenset[int]] = field(default_factory=dict)

    def expect_parts(self, epoch: int, ranks: Collection[int]) -> None:
        """The epoch's checkpoint holds the parts of `ranks`: the members at its checkpoint round."""
        self.expected[epoch] = frozenset(ranks)

    def on_saved(self, epoch: int, rank: int) -> None:
        self.saved.setdefault(epoch, set()).add(rank)

    def on_all_saved(self, epoch: int, driver_state: dict[str, Any]) -> None:
        """Every member saved (local SGD: the checkpoint round is acknowledged); the driver's state then."""
        self.saved[epoch] = set(self._parts(epoch))
        self.driver_state[epoch] = driver_state

    def poll(self, ledger: EpochLedger, driver_state: dict[str, Any]) -> list[Checkpoint]:
        """Commit every epoch whose parts are all saved and that the ledger has emitted; return those."""
        committed = []
        for epoch in sorted(self.saved):
            ranks = self._parts(epoch)
            if not ranks <= self.saved[epoch] or ledger.next_to_emit <= epoch:
                continue
            state = {
                **self.kind,
                "epoch": epoch,
                "comm_bytes_total": ledger.comm_bytes_total,
                "driver": self.driver_state.pop(epoch, driver_state),
            }
            self.store.write_part(epoch, COORDINATOR_FILE, state)
            self.committed = self.store.commit(epoch, self.world_size, self.run, ranks)
            del self.saved[epoch]
            self.expected.pop(epoch, None)
            self.remaining.discard(epoch)
            committed.append(self.committed)
            log.info("checkpoint after epoch %d: %s", shown_epoch(epoch), self.committed.path)
        return committed

    def _parts(self, epoch: int) -> frozenset[int]:
        return self.expected.get(epoch, frozenset(range(self.world_size)))

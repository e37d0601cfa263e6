"""A slice of one epoch a local-SGD rank trains, with its running totals, and the report that ends it (or
ends its trained start, where a round's snapshot falls midway through it)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flodl.links.messages import ChunkReport
from flodl.metrics.scalars import drain_scalars
from flodl.worker.stepper import Stepper


@dataclass
class Chunk:
    epoch: int
    # Where the slice starts in the epoch (the coordinator tracks handed-out slices by it).
    offset: int
    picks: torch.Tensor
    batches: int
    loss_sum: torch.Tensor
    done: int = 0
    busy_s: float = 0.0
    data_s: float = 0.0
    # Unix seconds when the first step began (see ChunkReport.started_at).
    started_at: float = 0.0
    compile_s: float = 0.0

    def report(self, rank: int, stepper: Stepper) -> ChunkReport:
        """The chunk trained: its ChunkReport (with its one read-back from the device, the loss)."""
        return ChunkReport(
            rank=rank,
            epoch=self.epoch,
            batches=self.done,
            samples=self.done * stepper.step_samples,
            loss_sum=float(self.loss_sum),
            wall_ms=self.busy_s * 1000,
            compile_s=self.compile_s,
            data_ms=self.data_s * 1000,
            steps_total=stepper.steps_total,
            lr=stepper.lr,
            scalars=drain_scalars(),
            started_at=self.started_at,
            ended_at=time.time(),
            offset=self.offset,
            **stepper.throughput(),
        )

    def rest(self, step_samples: int) -> Chunk:
        """The slice's untrained rest as a chunk of its own (a round's snapshot split it after `done`)."""
        trained = self.done * step_samples
        zero = torch.zeros_like(self.loss_sum)
        return Chunk(self.epoch, self.offset + trained, self.picks[trained:], self.batches - self.done, zero)

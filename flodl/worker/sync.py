"""The sync worker: runs the epochs the coordinator plans and reports what it did.

Policy `sync`: the model is wrapped in DistributedDataParallel (gradients all-reduced in buckets,
overlapped with backward), so each optimizer step sees the mean gradient of the global batch.
"""

from __future__ import annotations

import time

import torch

from flodl.metrics.scalars import drain_scalars
from flodl.wire.messages import ChunkReport, Message, Saved, StartEpoch
from flodl.worker.base import RankLink, WorkerBase, WorkerSettings
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.stepper import Stepper


class SyncWorker(WorkerBase):
    def __init__(
        self,
        stepper: Stepper,
        link: RankLink,
        settings: WorkerSettings,
        bf16_wire: bool,
        checkpointer: RankCheckpointer | None,
    ) -> None:
        super().__init__(stepper, link, settings, checkpointer)
        # What DDP all-reduces per optimizer step (once, after the last micro-batch): every gradient, as
        # bf16 under bf16_wire.
        self.gradient_bytes = sum(p.numel() * (2 if bf16_wire else p.element_size()) for p in stepper.params)

    def handle(self, message: Message) -> None:
        if not isinstance(message, StartEpoch):
            raise RuntimeError(f"rank {self.rank}: unexpected message under policy=sync: {message!r}")
        self.report(self.train_epoch(message))
        if message.evaluate and self.stepper.parts.eval_data is not None:
            step = self.stepper.steps_total  # each step is one on the global batch
            samples = step * self.stepper.step_samples * self.world_size
            epoch = message.part.epoch
            result = self.stepper.evaluate(self.rank, self.world_size, epoch, step, samples)
            self.report_evals(result, [epoch])
        if message.checkpoint and self.checkpointer is not None:
            self.checkpointer.save(message.part.epoch, self.state())
            self.report(Saved(self.rank, message.part.epoch))

    def train_epoch(self, plan: StartEpoch) -> ChunkReport:
        stepper = self.stepper
        step_samples = stepper.step_samples
        part = plan.part
        picks = stepper.picks(part)
        stepper.advise(part)
        batches = part.size // step_samples  # optimizer steps
        stepper.train_module.train()
        loss_sum = torch.zeros((), device=stepper.device)
        data_s = 0.0
        started_at = time.time()
        start = time.perf_counter()
        for b in range(batches):
            fetched = time.perf_counter()
            micro_batches = stepper.load_step(picks[b * step_samples : (b + 1) * step_samples], part.epoch)
            data_s += time.perf_counter() - fetched
            loss = stepper.step(micro_batches)
            loss_sum += loss
            stepper.schedule_to(stepper.steps_total)
            self.observe(loss, part.epoch)
        self.raise_if_nonfinite()  # before the epoch is reported, and long before it is checkpointed
        compile_s = stepper.take_compile_s()
        return ChunkReport(
            rank=self.rank,
            epoch=part.epoch,
            batches=batches,
            samples=batches * step_samples,
            loss_sum=float(loss_sum),  # the epoch's one read-back from the device
            wall_ms=(time.perf_counter() - start - compile_s) * 1000,
            compile_s=compile_s,
            data_ms=data_s * 1000,
            steps_total=stepper.steps_total,
            comm_bytes=batches * self.gradient_bytes if self.world_size > 1 else 0,
            lr=stepper.lr,
            scalars=drain_scalars(),
            started_at=started_at + compile_s,  # the work's window starts after the compilation
            ended_at=time.time(),
        )

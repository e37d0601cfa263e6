"""The worker: one per rank. Runs the epochs the coordinator plans and reports what it did.

Policy `sync`: the model is wrapped in DistributedDataParallel (gradients all-reduced in buckets,
overlapped with backward), so each optimizer step sees the mean gradient of the global batch.
The step loop never reads a value back from the device: losses accumulate on the device and are
read once per epoch, when the rank reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from flodl.config import FlodlConfig
from flodl.data.partition import epoch_permutation, picks_to_samples
from flodl.runtime.messages import EvalResult, Metrics, Shutdown, StartEpoch
from flodl.runtime.task_setup import TaskParts, lr_scale_factor
from flodl.runtime.transport import COORDINATOR, Mailbox

log = logging.getLogger("flodl")
_WAIT_S = 0.5


class Worker:
    def __init__(
        self,
        cfg: FlodlConfig,
        parts: TaskParts,
        rank: int,
        world_size: int,
        device: torch.device,
        mailbox: Mailbox,
    ) -> None:
        self.cfg = cfg
        self.parts = parts
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.mailbox = mailbox
        self.total_picks = len(parts.train_data) * cfg.augment
        self.steps_total = 0
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.train_module: nn.Module = parts.model
        if world_size > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            self.train_module = DistributedDataParallel(
                parts.model, device_ids=device_ids, gradient_as_bucket_view=True
            )
        if rank == 0:
            factor = lr_scale_factor(world_size, cfg.lr_scale_ratio)
            log.info(
                "policy=%s world=%d device=%s batch=%d/rank (global %d) lr x%.3g (lr_scale_ratio=%g)",
                cfg.policy, world_size, device, cfg.batch_size, cfg.batch_size * world_size,
                factor, cfg.lr_scale_ratio,
            )  # fmt: skip

    def run(self, alive: Callable[[], None]) -> None:
        """Obey the coordinator until Shutdown. `alive` raises if this rank must stop waiting."""
        while True:
            message = self.mailbox.receive(_WAIT_S)
            if message is None:
                alive()
            elif isinstance(message, StartEpoch):
                self.mailbox.send(COORDINATOR, self.train_epoch(message))
                if message.evaluate and self.parts.eval_data is not None:
                    self.mailbox.send(COORDINATOR, self.evaluate(message.epoch))
            elif isinstance(message, Shutdown):
                return
            else:
                raise RuntimeError(f"rank {self.rank}: unexpected message {message!r}")

    def train_epoch(self, plan: StartEpoch) -> Metrics:
        cfg = self.cfg
        picks = epoch_permutation(self.total_picks, cfg.seed, plan.epoch)[
            plan.offset : plan.offset + plan.size
        ]
        batches = plan.size // cfg.batch_size
        self.train_module.train()
        loss_sum = torch.zeros((), device=self.device)
        data_s = 0.0
        start = time.perf_counter()
        for b in range(batches):
            fetched = time.perf_counter()
            batch = self._load(picks[b * cfg.batch_size : (b + 1) * cfg.batch_size])
            data_s += time.perf_counter() - fetched
            loss_sum += self._step(batch)
        loss_total = float(loss_sum)  # the epoch's one read-back from the device
        return Metrics(
            rank=self.rank,
            epoch=plan.epoch,
            batches=batches,
            samples=batches * cfg.batch_size,
            loss_sum=loss_total,
            wall_ms=(time.perf_counter() - start) * 1000,
            data_ms=data_s * 1000,
            steps_total=self.steps_total,
        )

    def _load(self, picks: Tensor) -> list[Tensor]:
        rows = self.parts.train_data.get_batch(picks_to_samples(picks, self.cfg.augment))
        return [t.to(self.device, non_blocking=True) for t in rows]

    def _step(self, batch: list[Tensor]) -> Tensor:
        parts = self.parts
        loss = parts.loss_fn(self.train_module, batch)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        parts.optimizer.step()
        if parts.scheduler is not None:
            parts.scheduler.step()
        self.steps_total += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, epoch: int) -> EvalResult:
        """Evaluate this rank's contiguous share of the eval set; the coordinator sums the shares."""
        data, eval_fn = self.parts.eval_data, self.parts.eval_fn
        assert data is not None
        n = len(data)
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        sums: dict[str, Tensor] = {}
        model = self.parts.model
        model.eval()
        for start in range(lo, hi, self.cfg.batch_size):
            indices = torch.arange(start, min(start + self.cfg.batch_size, hi))
            batch = [t.to(self.device, non_blocking=True) for t in data.get_batch(indices)]
            for name, value in (eval_fn(model, batch) if eval_fn else self._loss_sums(batch)).items():
                sums[name] = sums.get(name, 0) + value.detach().double()
        model.train()
        return EvalResult(
            rank=self.rank, epoch=epoch, sums={k: float(v) for k, v in sums.items()}, count=hi - lo
        )

    def _loss_sums(self, batch: list[Tensor]) -> dict[str, Tensor]:
        """The eval metric of a task without an eval_fn: its own loss."""
        return {"loss": self.parts.loss_fn(self.parts.model, batch) * batch[0].shape[0]}

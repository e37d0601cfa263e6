"""One rank's training step and eval, shared by every policy.

The step never reads a value back from the device: it returns the detached loss, which callers sum
on the device and read once per chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flodl.data.dataset import is_batch_dataset, read_batch
from flodl.data.feeder import BatchFeeder, DataPlaneSettings, staging_tiers
from flodl.data.partition import epoch_permutation
from flodl.data.sample import check_movable, to_device
from flodl.data.sample_feed import SampleFeeder
from flodl.wire.messages import EpochSlice, EvalResult
from flodl.worker.faults import FaultInjection
from flodl.worker.nonfinite import NonFiniteWatch
from flodl.worker.task_setup import TaskParts

_SPIN_S = 0.002


@dataclass(frozen=True)
class StepperSettings:
    """What one rank's stepper reads of the run's config (mapped once, by flodl/assembly.py)."""

    # Batch size, augment views and seed live with the data plane, which reads them too.
    data: DataPlaneSettings
    max_grad_norm: float | None
    # simulate.factor for the slowed rank (1.0 elsewhere): each step takes this many times its real duration.
    slow_factor: float
    # simulate.nan_at_step / hang_at_step, when they name this rank.
    fault: FaultInjection


class Stepper:
    def __init__(
        self, settings: StepperSettings, parts: TaskParts, device: torch.device, train_module: nn.Module
    ) -> None:
        self.settings = settings
        self.batch_size = settings.data.batch_size
        self.parts = parts
        self.device = device
        self.train_module = train_module
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.total_picks = len(parts.train_data) * settings.data.augment
        self.steps_total = 0
        self.schedule_position = 0
        # Each step's loss, kept on the device until a window boundary looks for the first non-finite one.
        self.nonfinite = NonFiniteWatch(device)
        self.fault = settings.fault
        self._permutations: dict[int, Tensor] = {}
        # The data plane: staging tiers, prefetch, device pool (flodl/data/feeder.py), or torch's DataLoader
        # for a map-style Dataset (flodl/data/sample_feed.py).
        self.feeder: BatchFeeder | SampleFeeder
        if is_batch_dataset(parts.train_data):
            self.feeder = BatchFeeder(
                settings.data, parts.train_data, device, parts.transform, parts.cacheable
            )
        else:
            tiers = staging_tiers(settings.data) if parts.cacheable else None
            self.feeder = SampleFeeder(
                settings.data, parts.train_data, device, parts.collate, tiers, parts.transform
            )

    def picks(self, part: EpochSlice) -> Tensor:
        """The slice's picks of its epoch's shared permutation (cached per epoch)."""
        epoch = part.epoch
        if epoch not in self._permutations:
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = epoch_permutation(self.total_picks, self.settings.data.seed, epoch)
        return self._permutations[epoch][part.offset : part.offset + part.size]

    def advise(self, part: EpochSlice) -> None:
        """This rank will train `part` next (after what it was advised before): the plan the stager and
        the prefetcher follow."""
        self.feeder.advise(part.epoch, self.picks(part))

    def load(self, picks: Tensor, epoch: int) -> Any:
        """The batch of `picks` (a piece of `picks(part)` of that epoch) on the device."""
        return self.feeder.load(picks, epoch)

    def step(self, batch: Any) -> Tensor:
        started = time.perf_counter()
        parts = self.parts
        loss = self.fault.applied(parts.loss_fn(self.train_module, batch), self.steps_total + 1)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.settings.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        parts.optimizer.step()
        self.steps_total += 1
        self.nonfinite.observe(loss, self.steps_total)
        if self.settings.slow_factor > 1.0:
            self._slow_down(started)
        return loss.detach()

    @property
    def lr(self) -> float:
        return float(self.parts.optimizer.param_groups[0]["lr"])

    def schedule_to(self, position: int) -> None:
        """Advance the LR scheduler to `position` (steps it as often as needed; it is cheap)."""
        scheduler = self.parts.scheduler
        while scheduler is not None and self.schedule_position < position:
            scheduler.step()
            self.schedule_position += 1

    def _slow_down(self, started: float) -> None:
        # Simulation only: the wait needs the step's true duration, so it synchronizes the device.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        deadline = now + (now - started) * (self.settings.slow_factor - 1.0)
        # Sleep overshoots by ~0.1 ms, which would distort sub-millisecond steps: spin the last stretch.
        if deadline - now > _SPIN_S:
            time.sleep(deadline - now - _SPIN_S)
        while time.perf_counter() < deadline:
            pass

    @torch.no_grad()
    def evaluate(self, rank: int, world_size: int, epoch: int, step: int, samples: int) -> EvalResult:
        """Evaluate this rank's contiguous share of the eval set; the coordinator sums the shares.
        `step` and `samples`: what the model was trained on (the eval row's label)."""
        data, eval_fn = self.parts.eval_data, self.parts.eval_fn
        assert data is not None
        n = len(data)
        lo, hi = n * rank // world_size, n * (rank + 1) // world_size
        sums: dict[str, Tensor] = {}
        model = self.parts.model
        model.eval()
        for start in range(lo, hi, self.batch_size):
            indices = torch.arange(start, min(start + self.batch_size, hi))
            batch = read_batch(data, indices, self.parts.collate)
            if start == lo:
                check_movable(batch, "task.eval_data")
            batch = to_device(batch, self.device, non_blocking=True)
            for name, value in (
                eval_fn(model, batch) if eval_fn else self._loss_sums(batch, len(indices))
            ).items():
                sums[name] = sums.get(name, 0) + value.detach().double()
        model.train()
        totals = {k: float(v) for k, v in sums.items()}
        return EvalResult(rank, epoch, totals, hi - lo, step, samples)

    def _loss_sums(self, batch: Any, count: int) -> dict[str, Tensor]:
        """The eval metric of a task without an eval_fn: its own loss."""
        return {"loss": self.parts.loss_fn(self.parts.model, batch) * count}

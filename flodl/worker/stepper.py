"""One rank's training step and eval, shared by every policy.

A step is one optimizer step over `grad_accum` micro-batches of `batch_size`, each forward under the
configured autocast. The step never reads a value back from the device itself: it returns the detached
loss, which callers sum on the device and read once per chunk. (fp16's GradScaler reads whether the
gradients were finite before it steps the optimizer: torch's own per-step read, fp16 only.)
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flodl.config.policy import GRAPH_MODES
from flodl.data.dataset import read_batch
from flodl.data.feeder import DataPlaneSettings
from flodl.data.feeders import Feeder, feeder_for
from flodl.data.partition import epoch_permutation
from flodl.data.sample import check_movable, to_device
from flodl.links.messages import EpochSlice, EvalResult
from flodl.metrics.flops import peak_flops, train_flops_per_sample
from flodl.metrics.scalars import record_scalar
from flodl.sharding.fsdp import is_sharded
from flodl.worker.faults import FaultInjection
from flodl.worker.graph_storage import CapturedStorage
from flodl.worker.nonfinite import NonFiniteWatch
from flodl.worker.task_setup import TaskParts

_SPIN_S = 0.002
# fp8: the float8 linears (flodl/worker/float8.py) cast their own inputs; everything else runs in bf16.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# Per epoch: the share of optimizer steps fp16's GradScaler skipped (inf/NaN gradients; it then lowers
# its scale). AMP's own recovery, not an on_nonfinite event: the step was already skipped.
SCALER_SKIPPED = "amp/scaler_skipped"


@dataclass(frozen=True)
class StepperSettings:
    """What one rank's stepper reads of the run's config (mapped once, by flodl/job/assembly.py)."""

    # Batch size, augment views and seed live with the data plane, which reads them too.
    data: DataPlaneSettings
    max_grad_norm: float | None
    # simulate.factor for the slowed rank (1.0 elsewhere): each step takes this many times its real duration.
    slow_factor: float
    # simulate.nan_at_step / hang_at_step, when they name this rank.
    fault: FaultInjection
    # Micro-batches of data.batch_size per optimizer step.
    grad_accum: int = 1
    # Autocast of the forward pass (and eval): fp32 (off), bf16, or fp16 with a GradScaler.
    precision: str = "fp32"
    # torch.compile's mode for the training module, compiled on the first step; None: eager.
    compile_mode: str | None = None
    # One device's peak TFLOPS for MFU (None: the table in flodl/metrics/flops.py decides, if it knows it).
    peak_tflops: float | None = None


def eval_share(size: int, rank: int, world_size: int) -> range:
    """The contiguous share of an eval set of `size` samples that `rank` of `world_size` evaluates."""
    return range(size * rank // world_size, size * (rank + 1) // world_size)


class Stepper:
    def __init__(
        self, settings: StepperSettings, parts: TaskParts, device: torch.device, train_module: nn.Module
    ) -> None:
        self.settings = settings
        self.batch_size = settings.data.batch_size
        self.parts = parts
        self.device = device
        self.train_module = train_module
        # compile_mode set: the first step compiles the module (see take_compile_s).
        self._compile_pending = settings.compile_mode is not None
        self._compile_s = 0.0
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        # The model's tensors are final now (the averagers flattened them; a resume loaded them): a graph
        # captured later reads them where they are, and every state write must leave them there.
        self.storage = CapturedStorage(parts.model, settings.compile_mode)
        # A CUDA graph's replay overwrites the outputs of the one before, gradients included: a gradient kept
        # as it came out (.grad set from None) would be overwritten by the next replay. Held in tensors of
        # the parameters' own and zeroed in place, each backward adds its gradients into them at once, and
        # each micro-batch begins a new replay.
        self._graphs = settings.compile_mode in GRAPH_MODES
        if self._graphs:
            for param in self.params:
                param.grad = torch.zeros_like(param)
        # What the reports say of throughput (metrics/flops.py): FLOPs per sample, counted at the first step.
        self._flops_per_sample: float | None = None
        self._peak_flops = peak_flops(device, settings.peak_tflops) or 0.0
        self._tokens_per_sample = int(getattr(parts.train_data, "tokens_per_sample", 0) or 0)
        # Samples per optimizer step: grad_accum micro-batches of batch_size.
        self.step_samples = self.batch_size * settings.grad_accum
        self.autocast: Callable[[], AbstractContextManager] = (
            functools.partial(torch.autocast, device.type, AUTOCAST_DTYPES[settings.precision])
            if settings.precision in AUTOCAST_DTYPES
            else contextlib.nullcontext
        )
        # A no-op unless fp16; its scale is part of the rank's checkpoint.
        self.scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
        # DDP's no_sync (also through a compiled DDP): the first grad_accum - 1 backward passes skip the
        # all-reduce. None: nothing to skip (local SGD trains the plain model).
        self._no_sync: Callable[[], AbstractContextManager] | None = getattr(train_module, "no_sync", None)
        # The losses of the last step's forward passes so far, and its micro-batch count (interrupted_loss).
        self._forward_losses: tuple[Tensor, int] | None = None
        # The data plane, chosen once for the train data (flodl/data/feeders.py).
        self.feeder: Feeder = feeder_for(
            settings.data, parts.train_data, device, parts.collate, parts.transform, parts.cacheable
        )
        # Of a stream, picks are places in its epoch (there is no permutation of samples to draw them from).
        self.total_picks = 0 if self.feeder.in_order else len(parts.train_data) * settings.data.augment
        self.steps_total = 0
        self.schedule_position = 0
        # Each step's loss, kept on the device until a window boundary looks for the first non-finite one.
        self.nonfinite = NonFiniteWatch(device)
        self.fault = settings.fault
        self._permutations: dict[int, Tensor] = {}

    def picks(self, part: EpochSlice) -> Tensor:
        """The slice's picks of its epoch's shared permutation (cached per epoch); of a stream, its places in
        the epoch (the rank trains the next items of its shard whichever they are)."""
        if self.feeder.in_order:
            return torch.arange(part.offset, part.offset + part.size)
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

    def load_step(self, picks: Tensor, epoch: int) -> list[Any]:
        """The micro-batches of one optimizer step's `step_samples` picks of `epoch`, in order."""
        if len(picks) <= self.batch_size:  # one micro-batch (keep_global_batch may give a rank more)
            return [self.load(picks, epoch)]
        return [self.load(micro, epoch) for micro in picks.split(self.batch_size)]

    def step(self, micro_batches: list[Any]) -> Tensor:
        """One optimizer step over `micro_batches`; returns their mean loss (detached, on the device)."""
        compiling = self._compile_pending
        if compiling:
            self.synchronize()
        started = time.perf_counter()
        if compiling:
            # Wrapped here so that its cost (importing the compiler, several seconds) is timed with the step.
            # The wrapper shares the module's parameters: checkpoints, eval and the averagers use the plain
            # model. A compiled DDP keeps its bucketed all-reduce (graphs split at the buckets) and no_sync.
            compiled = torch.compile(self.train_module, mode=self.settings.compile_mode)
            # A module in, an OptimizedModule out (torch's stubs say a callable).
            assert isinstance(compiled, nn.Module)
            self.train_module = compiled
        parts, scaler = self.parts, self.scaler
        if self._flops_per_sample is None:  # once, on the plain model: the arithmetic, not the speed
            self._flops_per_sample = train_flops_per_sample(
                parts.model, parts.loss_fn, micro_batches[0], self.batch_size
            )
        parts.optimizer.zero_grad(set_to_none=not self._graphs)
        accumulated = len(micro_batches)
        loss_sum: Tensor | None = None
        for i, batch in enumerate(micro_batches):
            if self._graphs:  # a new replay: nothing of the last one is read again (gradients were added)
                torch.compiler.cudagraph_mark_step_begin()
            no_sync = self._no_sync if i < accumulated - 1 else None
            with no_sync() if no_sync is not None else contextlib.nullcontext():
                with self.autocast():
                    loss = parts.loss_fn(self.train_module, batch)
                loss = self.fault.applied(loss, self.steps_total + 1)
                # Under CUDA graphs a loss the model computes is the graph's output, which the next replay
                # overwrites: the step keeps a copy (a scalar, on the device).
                kept = loss.detach().clone() if self._graphs else loss.detach()
                loss_sum = kept if loss_sum is None else loss_sum + kept
                self._forward_losses = (loss_sum, accumulated)
                # Each micro-batch's mean loss / k: the gradient of the mean over the step's samples.
                scaler.scale(loss / accumulated if accumulated > 1 else loss).backward()
        assert loss_sum is not None
        step_loss = loss_sum / accumulated if accumulated > 1 else loss_sum
        if self.settings.max_grad_norm is not None:
            scaler.unscale_(parts.optimizer)  # clip the true gradients (a no-op without fp16)
            torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        scaler.step(parts.optimizer)
        if scaler.is_enabled():  # stays on the device, read with the chunk's report
            record_scalar(SCALER_SKIPPED, sum(scaler._found_inf_per_device(parts.optimizer).values()))
        scaler.update()
        self.steps_total += 1
        # The loss before scaling: non-finite is on_nonfinite's business whatever the precision.
        self.nonfinite.observe(step_loss, self.steps_total)
        if compiling:
            self.synchronize()
            self._compile_s += time.perf_counter() - started
            self._compile_pending = False
        elif self.settings.slow_factor > 1.0:  # compiling is no training step to slow down
            self._slow_down(started)
        return step_loss

    def set_train_module(self, train_module: nn.Module) -> None:
        """Train through `train_module` from the next step on (sync under survive: DDP on a new group); a
        compiled run compiles it at its first step."""
        self.train_module = train_module
        self._no_sync = getattr(train_module, "no_sync", None)
        self._compile_pending = self.settings.compile_mode is not None

    def throughput(self) -> dict[str, Any]:
        """A chunk report's throughput fields (see ChunkReport); the device's peak memory starts afresh."""
        memory = 0
        if self.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return {
            "flops_per_sample": self._flops_per_sample or 0.0,
            "peak_flops": self._peak_flops,
            "tokens_per_sample": self._tokens_per_sample,
            "peak_memory": memory,
        }

    def interrupted_loss(self) -> Tensor:
        """The mean loss of the step whose backward pass failed (its forward passes finished)."""
        assert self._forward_losses is not None, "no step was started"
        loss_sum, accumulated = self._forward_losses
        return loss_sum / accumulated

    def take_compile_s(self) -> float:
        """Seconds compiling took (compile=true: the first step, which wraps the module, traces it and
        generates its code; the device synchronized around it), once; 0 otherwise. Workers keep it out of
        their busy time and report it."""
        taken, self._compile_s = self._compile_s, 0.0
        return taken

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        self.synchronize()
        now = time.perf_counter()
        deadline = now + (now - started) * (self.settings.slow_factor - 1.0)
        # Sleep overshoots by ~0.1 ms, which would distort sub-millisecond steps: spin the last stretch.
        if deadline - now > _SPIN_S:
            time.sleep(deadline - now - _SPIN_S)
        while time.perf_counter() < deadline:
            pass

    @torch.no_grad()
    def evaluate(
        self, rank: int, world_size: int, epoch: int, step: int, samples: int, own_steps: int
    ) -> EvalResult:
        """Evaluate this rank's contiguous share of the eval set; the coordinator sums the shares.
        `step` and `samples`: what the model was trained on (the eval row's label); `own_steps`: this rank's
        steps in it."""
        taken_at = time.time()
        data, eval_fn = self.parts.eval_data, self.parts.eval_fn
        assert data is not None
        n = len(data)
        shares = [eval_share(n, r, world_size) for r in range(world_size)]
        lo, hi = shares[rank].start, shares[rank].stop
        batches = [range(s, min(s + self.batch_size, hi)) for s in range(lo, hi, self.batch_size)]
        model, own = self.parts.model, len(batches)
        if is_sharded(model):
            # Each forward gathers a module's parameters inside the group: every member runs as many as the
            # largest share has batches, a shorter share the set's first batch again, unreported.
            most = max(math.ceil(len(share) / self.batch_size) for share in shares)
            batches += [range(min(self.batch_size, n))] * (most - own)
        sums: dict[str, Tensor] = {}
        model.eval()
        for i, picked in enumerate(batches):
            indices = torch.arange(picked.start, picked.stop)
            batch = read_batch(data, indices, self.parts.collate)
            if i == 0:
                check_movable(batch, "task.eval_data")
            batch = to_device(batch, self.device, non_blocking=True)
            with self.autocast():
                measured = eval_fn(model, batch) if eval_fn else self._loss_sums(batch, len(indices))
            if i >= own:
                continue  # a padding batch
            for name, value in measured.items():
                sums[name] = sums.get(name, 0) + value.detach().double()
        model.train()
        totals = {k: float(v) for k, v in sums.items()}
        return EvalResult(rank, epoch, totals, hi - lo, step, samples, own_steps=own_steps, taken_at=taken_at)

    def _loss_sums(self, batch: Any, count: int) -> dict[str, Tensor]:
        """The eval metric of a task without an eval_fn: its own loss."""
        return {"loss": self.parts.loss_fn(self.parts.model, batch) * count}

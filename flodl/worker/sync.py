"""The sync worker: runs the epochs the coordinator plans and reports what it did.

Policy `sync`: the model is wrapped in DistributedDataParallel (gradients all-reduced in buckets,
overlapped with backward), so each optimizer step sees the mean gradient of the global batch.

Under fault_tolerance=survive DDP runs on the averaging group of the members (flodl/links/membership.py),
wrapped again on each new group. A member's death fails the step in flight on every survivor; the rank's
group (flodl/worker/group.py) forms the group the coordinator names, and the worker settles on it: the
members agree where they are (a survivor may have finished the step that another did not: the one furthest
on gives the others its state), and the coordinator plans the rest of the epoch for them. A restarted rank
is admitted where the members reach its Regroup in their inboxes, between epochs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.averaging.flat import state_buffers, state_digest
from flodl.averaging.wire import Wire
from flodl.checkpoints.disk import Point
from flodl.config.layout import Layout
from flodl.counting import shown_epoch
from flodl.links.membership import AveragingGroup
from flodl.links.messages import ChunkReport, FirstStep, Message, Regroup, Regrouped, StartEpoch
from flodl.metrics.scalars import drain_scalars
from flodl.worker.base import RankLink, WorkerBase, WorkerSettings
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.group import RankGroup
from flodl.worker.group_grads import held
from flodl.worker.joiner_state import joiners_state, restore_joiner
from flodl.worker.lr_world import LrWorld
from flodl.worker.stepper import Stepper

log = logging.getLogger("flodl")

# Where a rank is, as (epoch, steps of it trained): one that trained nothing in this process, and a restarted
# rank (below every member, so a member is always the one whose state the others take).
UNTRAINED = (-1, 0)
RESTARTED = (-1, -1)


@dataclass
class _Share:
    """This rank's share of one StartEpoch (under survive, of one membership segment), trained so far."""

    plan: StartEpoch
    steps: int
    loss_sum: torch.Tensor
    started_at: float
    start: float
    data_s: float = 0.0
    done: int = 0
    # Steps already reported (in a chunk before a checkpoint inside the share).
    reported: int = 0


def steps_trained_of_cut(position: Sequence[int], epoch: int, first_step: int, steps: int, done: int) -> int:
    """How much of a cut share (`steps` steps of `epoch` from its step `first_step`, `done` of them on this
    rank) the members trained, where they agreed they stand: `position`, [epoch, steps of it trained]. Members
    that stand in an earlier epoch (the death came in the share's first step) trained none of it."""
    at_epoch, at_step = position
    if at_epoch != epoch:
        return steps if at_epoch > epoch else done  # behind: no member got further, this one neither
    return min(steps, max(at_step - first_step, done))


class SyncWorker(WorkerBase):
    # Every rank steps the same optimizer state: a rank without a checkpoint part takes a member's.
    shares_optimizer = True

    def __init__(
        self,
        stepper: Stepper,
        link: RankLink,
        settings: WorkerSettings,
        wire: Wire,
        checkpointer: RankCheckpointer | None,
        lr_scale_ratio: float = 0.0,
        group: RankGroup | None = None,
        wrap: Callable[[dist.ProcessGroup], nn.Module] | None = None,
        *,
        layout: Layout,
    ) -> None:
        """`lr_scale_ratio`: the learning rate follows the world, x (1 + (n - 1) * ratio) for n ranks (as
        the task was built); it matters when the world changes (survive) or differs from a checkpoint's.
        `wrap`: DDP around the model on a group's process group, wrapped again on each group survive forms
        (every member calls it together: it broadcasts the first member's parameters).
        `layout`: the world the run is laid out for (flodl/config/layout.py), in whose steps the learning
        rate's world counts (keep_global_batch: a checkpoint's global batch kept on another world)."""
        super().__init__(stepper, link, settings, checkpointer, group)
        self.wrap = wrap
        # What DDP all-reduces per optimizer step (once, after the last micro-batch), as `wire` sends it.
        self.gradient_bytes = wire.gradient_bytes(stepper.params)
        # Samples of the global batches trained (every member's, step after step; the eval row's label).
        self.global_samples = 0
        # The world the learning rate is scaled for.
        self.lr = LrWorld(stepper, self.world_size, lr_scale_ratio, layout)
        self.position = RESTARTED if self.group.joining else UNTRAINED
        # survive: the group's first member says when the first step of a new group went through.
        self._first_step_due = False
        # survive: the share a failed step cut, reported once the members agreed where it ended.
        self._cut: _Share | None = None
        # A stop that saves: the global step every member saves after, then trains no more (None: no stop
        # asked); the steps of the checkpoints by time the members agreed on; and when this rank started
        # training, for how far ahead such a step must be.
        self.stop_at: int | None = None
        self.stopping = False
        self.save_at: set[int] = set()
        self._pace_from: tuple[float, int] | None = None
        # The epoch after which this rank last wrote its part.
        self._saved_after: int | None = None

    # --- the epochs -----------------------------------------------------------------------------------

    def handle(self, message: Message) -> None:
        if not isinstance(message, StartEpoch):
            raise RuntimeError(f"rank {self.rank}: unexpected message under policy=sync: {message!r}")
        if message.generation != self.group.generation or self.stopping:
            return  # planned for a group a change overtook (the coordinator plans the rest again), or stopped
        chunk = self.train_epoch(message)
        if chunk is None:  # a step failed, and the group changed (or the run ended)
            return
        if chunk.batches:
            self.report(chunk)
        self._after_epoch(message)

    def _after_epoch(self, plan: StartEpoch) -> None:
        epoch = plan.epoch
        if plan.evaluate and self.stepper.parts.eval_data is not None:
            step = self.stepper.steps_total  # each step is one on the global batch
            group = self.group
            result = self.stepper.evaluate(group.index, group.size, epoch, step, self.global_samples, step)
            self.report_evals(replace(result, generation=group.generation), [epoch])
        # A cut right at an epoch's end asks its checkpoint again of the members; one that wrote its part of
        # it (nothing trained since) does not write it twice: the commit may have taken the first meanwhile.
        if plan.checkpoint and self.checkpointer is not None and self._saved_after != epoch:
            self._saved_after = epoch
            self.save_part(Point(epoch))

    def train_epoch(self, plan: StartEpoch) -> ChunkReport | None:
        """The epoch's share `plan` hands this rank; None when a step of it failed (survive: the group
        changed meanwhile, and the part trained is reported once the members agreed where it ended)."""
        stepper = self.stepper
        if plan.step_samples and plan.step_samples != stepper.step_samples:
            # keep_global_batch: the global step is cut among more or fewer members than before.
            stepper.step_samples = plan.step_samples
            self.lr.scale_to(self.group.size, say=self.group.index == 0)
        step_samples = stepper.step_samples
        pieces = [stepper.picks(part) for part in plan.slices]
        picks = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        for part in plan.slices:
            stepper.advise(part)
        stepper.train_module.train()
        share = _Share(
            plan,
            len(picks) // step_samples,
            torch.zeros((), device=stepper.device),
            time.time(),
            time.perf_counter(),
        )
        members = self.group.size
        inside = {step: into for step, into in plan.checkpoint_steps}
        if self._pace_from is None:
            self._pace_from = (time.perf_counter(), stepper.steps_total)
        for b in range(share.steps):
            fetched = time.perf_counter()
            micro_batches = stepper.load_step(picks[b * step_samples : (b + 1) * step_samples], plan.epoch)
            share.data_s += time.perf_counter() - fetched
            try:
                loss = stepper.step(micro_batches)
            except Exception as err:
                self._cut = share
                self.group.failed(f"epoch {shown_epoch(plan.epoch)} was cut", err, self)
                return None
            share.loss_sum += loss
            share.done += 1
            self.global_samples += step_samples * members
            self.position = (plan.epoch, plan.first_step + share.done)
            if self._first_step_due:
                self._say_first_step()
            stepper.schedule_to(stepper.steps_total)
            self.observe(loss, plan.epoch)
            self.report_written()
            if self._save_after_step(share, inside.get(self.position[1])):
                return None
        self.raise_if_nonfinite()  # before the epoch is reported, and long before it is checkpointed
        self.position = (plan.epoch, plan.first_step + share.steps)
        return self._chunk(share, share.steps - share.reported)

    def _save_after_step(self, share: _Share, into: int | None) -> bool:
        """After a step: the part of a checkpoint due here (`into`: one by steps, at the samples of the epoch
        it holds; or one by time, or the stop's, at the step the members agreed on), written once; True: the
        stop's, and this rank trains no more. Its part alone says it is the stop's (`stop_asked`): every part
        written before it, after the signal too, is committed before it, so the stop loses no step."""
        steps = self.stepper.steps_total
        timed = steps in self.save_at
        self.save_at.discard(steps)
        if self.stop_at == steps:
            self.stop_asked = self.stopping = True
        if into is not None:
            self._save_inside(share, Point(share.plan.epoch, into))
        elif timed or self.stopping:
            self._save_at_agreed_step(share)
        return self.stopping

    def _save_at_agreed_step(self, share: _Share) -> None:
        """A checkpoint no plan asked for, at the step the members agreed on (fault_tolerance=none: every
        member has trained as many steps of the epoch as this one)."""
        epoch, step = self.position
        into = step * self.group.size * self.stepper.step_samples
        self._save_inside(share, Point(epoch, into), step)

    def _save_inside(self, share: _Share, point: Point, unplanned_step: int | None = None) -> None:
        """A checkpoint inside the share: the steps so far reported as a chunk (what the epoch's record
        holds at the checkpoint), then this rank's part, then Saved (`unplanned_step`: the step of the epoch
        of a checkpoint no plan asked for, a stop's)."""
        self.raise_if_nonfinite()
        self.report(self._chunk(share, share.done - share.reported))
        share.reported = share.done
        share.loss_sum = torch.zeros((), device=self.stepper.device)
        share.data_s = 0.0
        share.started_at, share.start = time.time(), time.perf_counter()
        if self.checkpointer is not None:
            self.save_part(point, unplanned_step)

    def _chunk(self, share: _Share, batches: int) -> ChunkReport:
        stepper = self.stepper
        compile_s = stepper.take_compile_s()
        return ChunkReport(
            rank=self.rank,
            epoch=share.plan.epoch,
            batches=batches,
            samples=batches * stepper.step_samples,
            loss_sum=float(share.loss_sum),  # the share's one read-back from the device
            wall_ms=(time.perf_counter() - share.start - compile_s) * 1000,
            compile_s=compile_s,
            data_ms=share.data_s * 1000,
            steps_total=stepper.steps_total,
            comm_bytes=batches * self.gradient_bytes if self.group.size > 1 else 0,
            lr=stepper.lr,
            scalars=drain_scalars(),
            started_at=share.started_at + compile_s,  # the work's window starts after the compilation
            ended_at=time.time(),
            generation=share.plan.generation,
            **stepper.throughput(),
        )

    def on_stop_request(self, agree: Callable[[int], int]) -> bool:
        """A stop that saves: every member saves after the agreed step, then trains no more (the checkpoints
        planned before it are taken on the way and committed too). False: this rank is already past it."""
        self.stop_at = agree(self._step_ahead())
        return self.stepper.steps_total < self.stop_at

    def on_checkpoint_request(self, agree: Callable[[int], int]) -> None:
        """A checkpoint by time: every member saves after the agreed step (a rank already past it says so,
        and that checkpoint is not taken: its other parts are never committed)."""
        step = agree(self._step_ahead())
        if self.stepper.steps_total < step:
            self.save_at.add(step)
        else:
            log.warning(
                "rank %d was past step %d before it learned it: that checkpoint is skipped", self.rank, step
            )

    def _step_ahead(self) -> int:
        """A step far enough ahead that every member learns it before it gets there: the steps of two
        seconds, and two more."""
        steps, pace = self.stepper.steps_total, self._pace_from
        if pace is None:
            return steps + 2
        started, first = pace
        return steps + math.ceil(2.0 * (steps - first) / max(time.perf_counter() - started, 1e-3)) + 2

    def state(self) -> dict[str, Any]:
        return {"global_samples": self.global_samples, **self.lr.state()}

    def restore(self, state: dict[str, Any]) -> None:
        """After the stepper's state: a checkpoint taken with fewer ranks (survive) held a learning rate
        scaled for them."""
        stepper = self.stepper
        self.global_samples = int(
            state.get("global_samples", stepper.steps_total * stepper.step_samples * self.world_size)
        )
        self.lr.restore(state, self.world_size)
        self.lr.scale_to(self.world_size, say=self.rank == 0)

    def release(self) -> None:
        self.stepper.set_train_module(self.stepper.parts.model)  # DDP holds the group's buckets

    # --- a change of the group (survive) ----------------------------------------------------------------

    def let_go(self, change: Regroup) -> None:
        self.release()  # the old group's DDP is done with

    def settle(self, group: AveragingGroup, change: Regroup | None) -> None:
        """On a new group: agree where the members are (the one furthest on shares its state when they
        differ), wrap DDP on it, and scale the learning rate to its size."""
        assert self.wrap is not None, "a group formed for a sync worker without a DDP wrap"
        self.position = self._agree(group)
        self.stepper.set_train_module(self.wrap(group.process_group()))
        # Every member (with sharded groups, more than `group`: those of the rank's shard index).
        members = self.group
        self.lr.scale_to(members.size, say=members.index == 0)
        self._first_step_due = members.index == 0
        if change is not None:
            what = f"admitting {change.joining}" if change.joining else "regrouping"
            self._log_state(f"{what} at epoch {shown_epoch(self.position[0])} step {self.position[1]}")

    def regrouped(self, change: Regroup, formed: Regrouped) -> None:
        """Report the share a failed step cut (up to where the members agreed it ended) and the agreed
        position."""
        if self._cut is not None:
            self._report_cut(self._cut)
            self._cut = None
        self.report(replace(formed, position=list(self.position)))

    def _report_cut(self, cut: _Share) -> None:
        """The share a change cut, trained up to where the members agreed: a step that failed here but went
        through on a member further on was trained (its gradients were in that member's all-reduce)."""
        plan = cut.plan
        trained = steps_trained_of_cut(self.position, plan.epoch, plan.first_step, cut.steps, cut.done)
        if trained > cut.done:
            cut.loss_sum += self.stepper.interrupted_loss()
        if trained > cut.reported:  # a segment finished this way: its eval and checkpoint are asked again
            self.report(self._chunk(cut, trained - cut.reported))

    def on_done(self) -> None:
        self._log_state("the last epoch")

    def _log_state(self, what: str) -> None:
        """This rank's parameters and state buffers, fingerprinted (members hold the same, bit for bit)."""
        model = self.stepper.parts.model

        def state() -> str:
            digest = state_digest(held(model, (buf for *_, buf in state_buffers(model))))
            return f"{what}: {digest}, global steps {self.stepper.steps_total}, {self.optimizer_words()}"

        self.group.say_state(state)

    def _agree(self, group: AveragingGroup) -> tuple[int, int]:
        device = group.wire
        mine = torch.tensor(list(self.position), dtype=torch.int64, device=device)
        every = [(int(p[0]), int(p[1])) for p in group.all_gather(mine)]
        furthest = max(every)
        if any(p != furthest for p in every):
            self._adopt(group, every.index(furthest), device)
        return furthest

    def _adopt(self, group: AveragingGroup, source: int, device: torch.device) -> None:
        """Every member takes the state of the member at index `source`: parameters, buffers, optimizer,
        schedule, step and sample counts, and the world its learning rate is scaled for (sharded groups: the
        group is the members of the rank's shard index, and what travels is that shard)."""
        model, stepper = self.stepper.parts.model, self.stepper
        tensors = held(model, model.buffers())
        moved = [t.to(device) for t in tensors]
        group.broadcast(moved, source)
        with torch.no_grad():
            for tensor, received in zip(tensors, moved, strict=True):
                tensor.copy_(received)
        self.stepper.storage.check("the members agreed on their state")
        mine = None
        if group.index == source:
            mine = {
                "stepper": joiners_state(stepper),
                "global_samples": self.global_samples,
                "lr_world": self.lr.world,
            }
        state = group.broadcast_state(mine, source)
        if group.index == source:
            return
        restore_joiner(stepper, state["stepper"])
        self.global_samples = int(state["global_samples"])
        self.lr.world = int(state["lr_world"])

    def _say_first_step(self) -> None:
        """The first step on a new group went through on every member (its all-reduce finished here)."""
        self._first_step_due = False
        self.stepper.synchronize()
        self.report(FirstStep(self.rank, self.group.generation))

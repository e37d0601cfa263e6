"""A sync stop's parts, in one process (a one-rank SyncWorker on digits, its parts and reports recorded): the
rank trains to the step the members agreed on and no further, writes the part of every checkpoint due on the
way (by steps, by time) once each and in order, and marks the agreed step's part alone as the stop's
(`Saved.after_stop`), the one the coordinator ends the stop at once it is committed, every part before it
committed first (flodl/coordinator/commit.py). The moments are drawn from a seed: where the stop's step, a
checkpoint by time and the checkpoints by steps fall, the same step included."""

from __future__ import annotations

import random

from flodl.averaging.wire import Wire
from flodl.checkpoints.disk import Point
from flodl.links.messages import EpochSlice, Message, Saved, StartEpoch
from flodl.worker.base import RankLink, WorkerSettings
from flodl.worker.sync import SyncWorker
from tests.helpers.digits_stepper import digits_stepper

MOMENTS = 40
# The steps of the share each moment trains (the stop within them), and the samples of each step.
STEPS, SAMPLES = 12, 32


class _Outbox:
    """What the worker reports to the coordinator."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, rank: int, message: Message) -> None:
        self.sent.append(message)


class _Parts:
    """A checkpointer whose parts are on disk at once: each is said Saved at the worker's next look."""

    def __init__(self) -> None:
        self.receipts: list[Saved] = []

    def save(self, point: Point, state: object, receipt: Saved, first_member: bool = True) -> None:
        self.receipts.append(receipt)

    def written(self) -> list[Saved]:
        taken, self.receipts = self.receipts, []
        return taken


def test_a_sync_stop_writes_every_part_due_before_its_step_and_marks_its_own_alone() -> None:
    rng = random.Random(54)
    stepper = digits_stepper()
    assert stepper.step_samples == SAMPLES
    for _ in range(MOMENTS):
        outbox = _Outbox()
        link = RankLink(0, 1, reader=None, outbox=outbox)  # type: ignore[arg-type]
        settings = WorkerSettings(log_every=0, on_nonfinite="error")
        worker = SyncWorker(stepper, link, settings, Wire(), _Parts())  # type: ignore[arg-type]
        before = stepper.steps_total
        stop, timed, every = rng.randint(1, STEPS), rng.randint(1, STEPS), rng.randint(1, STEPS)
        worker.on_checkpoint_request(lambda _proposal, step=before + timed: step)
        assert worker.on_stop_request(lambda _proposal, step=before + stop: step)
        inside = [[step, step * SAMPLES] for step in range(every, STEPS + 1, every)]
        share = [EpochSlice(0, 0, STEPS * SAMPLES)]
        plan = StartEpoch(0, share, checkpoint=True, checkpoint_steps=inside)
        assert worker.train_epoch(plan) is None  # stopped inside the share: no chunk of its end
        assert stepper.steps_total == before + stop and worker.stopping
        due = sorted({stop} | {timed} & set(range(1, stop + 1)) | set(range(every, stop + 1, every)))
        saved, moment = [m for m in outbox.sent if isinstance(m, Saved)], (stop, timed, every)
        assert [(m.epoch, m.into) for m in saved] == [(0, step * SAMPLES) for step in due], moment
        assert [m.after_stop for m in saved] == [step == stop for step in due], moment
        worker.handle(plan)  # a plan after the stop: not trained
        assert stepper.steps_total == before + stop

"""A sync stop's parts, in one process (a one-rank SyncWorker on digits, its parts and reports recorded): the
rank trains to the step the members agreed on and no further, writes the part of every checkpoint due on the
way (by steps, by time) once each and in order, and marks the agreed step's part alone as the stop's
(`Saved.after_stop`); the committer, handed those receipts as the coordinator hands them, commits every part
in order and holds the stop saved only once the stop's own is committed (flodl/coordinator/commit.py), never
at one on the way. The moments are drawn from a seed: where the stop's step, a checkpoint by time and the
checkpoints by steps fall, the same step included."""

from __future__ import annotations

import random
from pathlib import Path

from torch.distributed import HashStore

from flodl.averaging.wire import Wire
from flodl.checkpoints.disk import MODEL_FILE, CheckpointDir, Point, rank_file
from flodl.config.layout import Layout
from flodl.coordinator.commit import CheckpointCommitter, run_kind
from flodl.coordinator.ledger import EpochLedger
from flodl.links.messages import ChunkReport, EpochSlice, Message, Saved, StartEpoch
from flodl.links.transport import InboxReader, Mailbox
from flodl.worker.base import RankLink, WorkerSettings
from flodl.worker.sync import SyncWorker
from tests.helpers.digits_stepper import digits_stepper
from tests.helpers.one_rank_sync import PartsAtOnce, Reports

MOMENTS = 40
# The steps of the share each moment trains (the stop within them), and the samples of each step.
STEPS, SAMPLES = 12, 32


def _commits(root: Path, sent: list[Message]) -> list[tuple[Point, bool]]:
    """The coordinator's side of what the worker `sent`, in order, the stop requested: each Saved part put on
    disk and committed; per checkpoint committed, whether the stop counts as saved then."""
    store = CheckpointDir(root, keep=STEPS + 2)
    ledger = EpochLedger(epochs=1, world_size=1, batches_per_epoch=STEPS)
    committer = CheckpointCommitter(store, 1, set(), run_kind("sync", False), {})
    committer.stop_requested()
    done = []
    for message in sent:
        if isinstance(message, ChunkReport):
            ledger.add_chunk(message)
        elif isinstance(message, Saved):
            point = Point(message.epoch, message.into)
            for name in (rank_file(0), MODEL_FILE):
                store.write_part(point, name, {})
            committer.expect_parts(point, [0], {"rest": None})
            committer.on_saved(point, 0, message.chunks, ledger, message.after_stop)
            done += [(c.point, committer.stop_saved) for c in committer.poll(ledger, wait_sealed=True)]
    committer.close()
    return done


def test_a_sync_stop_writes_every_part_due_before_its_step_and_ends_at_its_own(tmp_path: Path) -> None:
    rng = random.Random(54)
    stepper = digits_stepper()
    assert stepper.step_samples == SAMPLES
    for moment_no in range(MOMENTS):
        outbox = Reports()
        # A reader never started: the worker only wakes it (a part written in the background).
        link = RankLink(0, 1, reader=InboxReader(Mailbox(HashStore(), 0)), outbox=outbox)  # type: ignore[arg-type]
        settings = WorkerSettings(log_every=0, on_nonfinite="error")
        layout = Layout(1, SAMPLES)
        worker = SyncWorker(stepper, link, settings, Wire(), PartsAtOnce(), layout=layout)  # type: ignore[arg-type]
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
        ends = [(Point(0, step * SAMPLES), step == stop) for step in due]
        assert _commits(tmp_path / str(moment_no), outbox.sent) == ends, moment
        worker.handle(plan)  # a plan after the stop: not trained
        assert stepper.steps_total == before + stop

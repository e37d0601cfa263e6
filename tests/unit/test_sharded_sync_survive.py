"""Sync by sharded groups under fault_tolerance=survive: what the rules take and what they refuse, naming the
key, and its checkpoints' commit when a group leaves (tests/runs/test_sharded_survive_sync.py runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed import HashStore

from flodl.averaging.wire import Wire
from flodl.checkpoints.disk import MODEL_FILE, CheckpointDir, Point, rank_file
from flodl.config.layout import Layout
from flodl.coordinator.commit import CheckpointCommitter, run_kind
from flodl.coordinator.ledger import EpochLedger
from flodl.links.messages import ChunkReport, EpochSlice, Saved, StartEpoch
from flodl.links.transport import InboxReader, Mailbox
from flodl.worker.base import RankLink, WorkerSettings
from flodl.worker.sync import SyncWorker
from tests.helpers.config_rules import assert_problem, host, make, problems_of
from tests.helpers.digits_stepper import digits_stepper
from tests.helpers.one_rank_sync import PartsAtOnce, Reports

FOUR = host(world_size=4, ranks_per_node=4)
SYNC_BY_GROUPS = {
    "shard_group": 2,
    "policy": "sync",
    "checkpoint_every": None,
    "fault_tolerance": "survive",
    "launch.nproc_per_node": 4,
}


def test_sync_by_groups_survives_with_restarts_evals_clipping_and_checkpoints() -> None:
    cfg = make(**SYNC_BY_GROUPS, **{"launch.max_restarts": 2}, eval_every=1, max_grad_norm=1.0)
    assert problems_of(cfg, FOUR) == []
    # Each group in writes its own save (tests/runs/test_sharded_survive_sync.py).
    for checkpoints in ({"checkpoint_every": 1}, {"checkpoint_every_steps": 5}):
        assert problems_of(make(**{**SYNC_BY_GROUPS, **checkpoints}), FOUR) == [], checkpoints


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("keep_global_batch", True, "the groups left step their own micro-batches"),
        ("precision", "fp16", "its GradScaler skips a step without the vote"),
        ("launch.max_ranks", 6, "a job does not grow by groups yet"),
    ],
)
def test_what_sync_by_groups_does_not_do_yet_is_refused_naming_the_key(
    key: str, value: object, why: str
) -> None:
    said = assert_problem(
        problems_of(make(**{**SYNC_BY_GROUPS, key: value}), FOUR),
        key,
        value,
        "not with fault_tolerance=survive and shard_group=2 yet (under policy=sync",
    )
    assert why in said
    # Under cadence a job grows by groups.
    if key == "launch.max_ranks":
        cadence = make(**{**SYNC_BY_GROUPS, "policy": "cadence", key: value})
        assert problems_of(cadence, FOUR) == []


def test_a_checkpoint_whose_member_left_before_its_part_commits_with_the_members_left(tmp_path: Path) -> None:
    # Sync under survive: the epoch is trained and emitted, then a member (a sharded group) leaves before its
    # part is on disk. Its epoch is not planned again (already emitted), so the checkpoint holds the parts of
    # the members left; waiting for the cut ones' kept it from ever committing, and the run from ending.
    store = CheckpointDir(tmp_path, keep=4)
    ledger = EpochLedger(epochs=1, world_size=4, batches_per_epoch=4)
    committer = CheckpointCommitter(store, 4, {0}, run_kind("sync", False), {})
    committer.expect_parts(Point(0), range(4), {"rest": None})
    ledger.expect_eval(0, False)
    for rank in range(4):
        ledger.add_chunk(ChunkReport(rank, 0, batches=1, samples=8, loss_sum=1.0, wall_ms=1.0, data_ms=0.0))
    assert [m.epoch for m in ledger.emit_ready()] == [0]
    store.write_part(Point(0), MODEL_FILE, {})  # written by the first member left
    for rank in (2, 3):  # the group left's parts; ranks 0 and 1 died before theirs
        store.write_part(Point(0), rank_file(rank), {})
        committer.on_saved(Point(0), rank, 1, ledger)
    assert committer.poll(ledger, wait_sealed=True) == []
    committer.cut([0, 1])
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.point == Point(0) and committer.remaining == set()
    committer.close()


def test_a_part_asked_again_at_its_epochs_end_is_written_once() -> None:
    # A cut right at an epoch's end asks the members for the epoch's eval and checkpoint again (a member may
    # have died before its part). One that wrote its part already, nothing trained since, does not write it
    # a second time: the commit may take the first meanwhile and move the dir under the second (a sharded
    # group's DCP save failed there with FileNotFoundError, and the member with it).
    outbox, parts = Reports(), PartsAtOnce()
    link = RankLink(0, 1, reader=InboxReader(Mailbox(HashStore(), 0)), outbox=outbox)  # type: ignore[arg-type]
    settings = WorkerSettings(log_every=0, on_nonfinite="error")
    stepper = digits_stepper()
    worker = SyncWorker(stepper, link, settings, Wire(), parts, layout=Layout(1, stepper.step_samples))  # type: ignore[arg-type]
    worker.handle(StartEpoch(0, [EpochSlice(0, 0, 2 * stepper.step_samples)], checkpoint=True))
    worker.handle(StartEpoch(0, [], checkpoint=True))  # asked again, after the cut
    worker.handle(StartEpoch(1, [EpochSlice(1, 0, stepper.step_samples)], checkpoint=True))
    assert [(m.epoch, m.into) for m in outbox.sent if isinstance(m, Saved)] == [(0, None), (1, None)]

"""Checkpoints inside an epoch, the pure parts: where the planners put them (sync's steps of a share, local
SGD's segment ends), what the committer records of the epoch so far, and how such checkpoints are named,
ordered and chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.checkpoints.disk import COORDINATOR_FILE, MODEL_FILE, CheckpointDir, Point, dir_name, rank_file
from flodl.coordinator.commit import CheckpointCommitter, run_kind
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.lockstep import (
    LockstepPlan,
    checkpoint_steps,
    opening_segment,
    rest_of,
    segment_from_state,
    segment_state,
)
from flodl.links.messages import ChunkReport, EpochSlice, EvalResult, RoundAck
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner

# --- names and order ------------------------------------------------------------------------------------


def test_a_point_inside_an_epoch_is_named_and_ordered_before_the_epoch_s_end() -> None:
    inside, end = Point(2, 512), Point(2)
    assert dir_name(inside) == "epoch-000003-sample-000000512" and dir_name(end) == "epoch-000003"
    assert sorted([end, Point(2, 64), Point(1), inside], key=lambda p: p.order) == [
        Point(1),
        Point(2, 64),
        inside,
        end,
    ]
    assert inside.next_epoch == 2 and end.next_epoch == 3
    assert inside.last_whole_epoch == 1 and end.last_whole_epoch == 2
    assert inside.words() == "epoch 3, 512 samples into it" and end.words() == "after epoch 3"


def _commit(store: CheckpointDir, point: Point) -> None:
    for name in (MODEL_FILE, COORDINATOR_FILE, rank_file(0)):
        store.write_part(point, name, {})
    store.commit(point, world_size=1)


def test_the_newest_checkpoint_is_the_latest_point_and_pruning_keeps_the_newest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    for point in (Point(0), Point(1, 64), Point(1, 640), Point(1)):
        _commit(store, point)
        assert store.latest().point == point  # type: ignore[union-attr]
    _commit(store, Point(2, 128))
    latest = store.latest()
    assert latest is not None and latest.point == Point(2, 128) and latest.into == 128
    kept = sorted(p.name for p in store.root.iterdir() if p.is_dir())
    assert kept == ["epoch-000002", "epoch-000002-sample-000000640", "epoch-000003-sample-000000128"]


# --- sync: the steps of a share -------------------------------------------------------------------------


def test_sync_checkpoints_fall_on_multiples_of_the_interval_in_global_steps() -> None:
    # 2 members, 8 samples a step each: an epoch of 1000 picks has 62 steps.
    segment = opening_segment(3, 1000, [0, 1], 8, generation=0)
    # Global step 3 x 62 + k: multiples of 5 at k = 4, 9, ...; the epoch's last step (62) is its end.
    assert checkpoint_steps(segment, 62, 5) == list(range(4, 62, 5))
    assert checkpoint_steps(segment, 62, 62) == []
    rest = rest_of(segment, 10, [0], 8, generation=1)  # a cut after step 10: the rest starts there
    assert checkpoint_steps(rest, 62, 7) == [s for s in range(11, rest.end_step) if (186 + s) % 7 == 0]


def test_the_rest_of_an_epoch_round_trips_as_data_and_each_member_keeps_its_own_picks() -> None:
    plan = LockstepPlan(total_picks=1000, step_samples=8)
    segment = plan.open(0, [0, 1, 2], generation=0)
    rest = rest_of(segment, 7, segment.members, 8, segment.generation)
    for rank in segment.members:  # the same members: each one's rest is its own share from step 7
        (own,) = segment.shares[rank]
        assert rest.shares[rank] == (EpochSlice(0, own.offset + 7 * 8, own.size - 7 * 8),)
    again = segment_from_state(segment_state(rest), generation=0)
    assert again == rest
    resumed = LockstepPlan(1000, 8)
    assert resumed.resume(again, [0, 1, 2], before=21, before_samples=21 * 8) == rest
    assert resumed.expected_batches(0) == 21 + 3 * rest.steps == 3 * segment.steps
    # Resumed by other members (a rank without a part): every pick left, shared by them.
    fewer = LockstepPlan(1000, 8).resume(again, [0, 2], before=21, before_samples=21 * 8)
    assert fewer.members == (0, 2) and fewer.steps == (3 * rest.steps) // 2


# --- local SGD: segment ends ------------------------------------------------------------------------------


def _run_planner(planner: LocalSgdPlanner, counts: list[int]) -> list[tuple[Average, list[Dispatch]]]:
    """Every rank trains its whole window and reports; the rounds in order with the windows before them."""
    rounds = []
    while not planner.finished:
        window = planner.open_window(counts, overshoot=0)
        for dispatch in window:
            for piece in dispatch.slices:
                assert planner.on_chunk(dispatch.rank, piece)
        averages: list = []
        for dispatch in window:
            averages += planner.on_reached(WindowReport(dispatch.rank, dispatch.target, 1.0))
        (average,) = averages
        for epoch in range(planner.first_epoch, planner.whole_epochs_end):
            planner.on_epoch_complete(epoch)
        for dispatch in window:
            planner.on_ack(RoundAck(dispatch.rank, 0, dispatch.target, False, 0.0, 0.0, queued=0))
        rounds.append((average, window))
        if planner.segment_done and not planner.finished:
            planner.next_segment()
    return rounds


def _handed(rounds: list[tuple[Average, list[Dispatch]]], batch_size: int) -> list[tuple[int, int]]:
    return [
        (piece.epoch, offset // batch_size)
        for _, window in rounds
        for dispatch in window
        for piece in dispatch.slices
        for offset in range(piece.offset, piece.offset + piece.size, batch_size)
    ]


@pytest.mark.parametrize("is_async", [False, True])
def test_local_sgd_ends_a_segment_exactly_at_each_step_threshold(is_async: bool) -> None:
    # 2 ranks, 10 batches an epoch, 3 epochs; a checkpoint every 6 batches handed out and after the last.
    planner = LocalSgdPlanner(
        2, 10, 4, 3, is_async, frozenset({0, 1, 2}), barrier_epochs=frozenset({2}), checkpoint_every_batches=6
    )
    rounds = _run_planner(planner, counts=[2, 2])
    points = [average.checkpoint_at for average, _ in rounds if average.checkpoint_at is not None]
    # Thresholds at 6, 12, 18, 24 batches from the start: (0, 6), (1, 2), (1, 8), (2, 4); then the end.
    assert points == [(0, 6), (1, 2), (1, 8), (2, 4), (2, None)]
    assert all(average.final for average, _ in rounds if average.checkpoint_at is not None)
    assert _handed(rounds, 4) == [(e, b) for e in range(3) for b in range(10)]  # each batch once, in order


def test_a_cut_segment_ends_with_the_next_window_and_a_checkpoint_there() -> None:
    planner = LocalSgdPlanner(2, 10, 1, 2, False, frozenset({1}))
    planner.open_window([2, 2], 0)
    for rank in (0, 1):
        planner.on_reached(WindowReport(rank, 2, 1.0))
    for rank in (0, 1):
        planner.on_ack(RoundAck(rank, 0, 2, False, 0.0, 0.0, queued=0))
    planner.cut_segment()  # a checkpoint by time (or a stop that saves) is due
    window = planner.open_window([3, 3], 0)
    assert [d.slices for d in window] == [(EpochSlice(0, 4, 3),), (EpochSlice(0, 7, 3),)]
    planner.on_reached(WindowReport(0, 3, 1.0))
    (average,) = planner.on_reached(WindowReport(1, 3, 1.0))
    assert average.final and average.checkpoint_at == (0, None)  # the window reached epoch 0's end
    for rank in (0, 1):
        planner.on_ack(RoundAck(rank, 0, 3, False, 0.0, 0.0, queued=0))
    planner.next_segment()
    planner.cut_segment()
    window = planner.open_window([3, 3], 0)
    planner.on_reached(WindowReport(0, 3, 1.0))
    (average,) = planner.on_reached(WindowReport(1, 3, 1.0))
    assert average.final and average.checkpoint_at == (1, 6)


@settings(max_examples=150, deadline=None)
@given(
    is_async=st.booleans(),
    every=st.integers(1, 40),
    counts=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    stop_at=st.integers(0, 59),
)
def test_a_run_resumed_at_any_checkpoint_inside_an_epoch_hands_out_the_rest_exactly_once(
    is_async: bool, every: int, counts: list[int], stop_at: int
) -> None:
    def planner(first: tuple[int, int] = (0, 0)) -> LocalSgdPlanner:
        return LocalSgdPlanner(
            len(counts),
            20,
            2,
            3,
            is_async,
            frozenset({2}),
            barrier_epochs=frozenset({2}),
            first_epoch=first[0],
            first_batch=first[1],
            checkpoint_every_batches=every,
        )

    whole = _run_planner(planner(), counts)
    points = [a.checkpoint_at for a, _ in whole if a.checkpoint_at is not None and a.checkpoint_at[1]]
    handed = _handed(whole, 2)
    assert handed == [(e, b) for e in range(3) for b in range(20)]
    if not points:
        return
    epoch, batch = points[stop_at % len(points)]
    assert batch is not None
    resumed = _handed(_run_planner(planner((epoch, batch)), counts), 2)
    assert resumed == handed[handed.index((epoch, batch)) :]


# --- the committer ------------------------------------------------------------------------------------------


def _chunk(rank: int, epoch: int, batches: int, loss: float) -> ChunkReport:
    return ChunkReport(rank, epoch, batches, batches * 4, loss, 10.0, 1.0)


def test_a_checkpoint_inside_an_epoch_keeps_each_rank_s_chunks_reported_before_its_part(
    tmp_path: Path,
) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    ledger = EpochLedger(epochs=2, world_size=2, batches_per_epoch=8)
    committer = CheckpointCommitter(store, 2, {1}, run_kind("sync", False), {"uid": "u"})
    point = Point(0, 16)
    committer.expect_parts(point, [0, 1], {"rest": "of epoch 1"})
    for rank in (0, 1):
        store.write_part(point, rank_file(rank), {})
    store.write_part(point, MODEL_FILE, {})
    ledger.add_chunk(_chunk(0, 0, 2, 1.5))
    ledger.add_chunk(_chunk(0, 0, 2, 0.5))  # rank 0 went on past the checkpoint before its part was written
    ledger.add_chunk(_chunk(1, 0, 2, 1.25))
    committer.on_saved(point, 0, 1, ledger)  # one chunk of the epoch before its part
    committer.on_saved(point, 1, 1, ledger)
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.point == point and checkpoint.into == 16
    state = checkpoint.load(COORDINATOR_FILE)
    assert state["driver"] == {"rest": "of epoch 1"} and (state["epoch"], state["into"]) == (0, 16)
    assert [(c["rank"], c["loss_sum"]) for c in state["ledger"]["chunks"]] == [(0, 1.5), (1, 1.25)]
    # A run resumed there starts the epoch's record from those chunks.
    resumed = EpochLedger(epochs=2, world_size=2, batches_per_epoch=8)
    resumed.resume_partial(0, state["ledger"])
    assert resumed.reported_batches(0) == 4


def test_a_checkpoint_inside_an_epoch_waits_until_the_epochs_before_it_are_emitted(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    ledger = EpochLedger(epochs=3, world_size=1, batches_per_epoch=2)
    committer = CheckpointCommitter(store, 1, set(), run_kind("sync", False), {"uid": "u"})
    point = Point(1, 4)
    committer.expect_parts(point, [0], {"rest": None})
    store.write_part(point, rank_file(0), {})
    store.write_part(point, MODEL_FILE, {})
    ledger.add_chunk(_chunk(0, 0, 2, 1.0))
    ledger.expect_eval(0, True)  # epoch 0's eval is still to come
    committer.on_saved(point, 0, 0, ledger)
    assert committer.poll(ledger, wait_sealed=True) == []
    ledger.add_eval(EvalResult(0, 0, {"accuracy": 1.0}, 4))
    assert [m.epoch for m in ledger.emit_ready()] == [0]
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.point == point


def test_a_point_whose_epoch_record_is_gone_before_its_parts_are_on_disk_is_let_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A part written in the background can land after the epoch after its own was emitted (tiny epochs):
    the epoch's record is gone, so the checkpoint is not taken (a later one is)."""
    ledger = EpochLedger(epochs=3, world_size=1, batches_per_epoch=2)
    committer = CheckpointCommitter(CheckpointDir(tmp_path, keep=3), 1, set(), run_kind("sync", False), {})
    point = Point(0, 4)
    committer.expect_parts(point, [0], {"rest": None})
    for epoch in (0, 1):
        ledger.add_chunk(_chunk(0, epoch, 2, 1.0))
        ledger.expect_eval(epoch, False)
    assert [m.epoch for m in ledger.emit_ready()] == [0, 1] and not ledger.holds(0)
    with caplog.at_level("WARNING", logger="flodl"):
        committer.on_saved(point, 0, 1, ledger)
    assert committer.poll(ledger, wait_sealed=True) == [] and point not in committer.expected
    assert "the checkpoint at epoch 1, 4 samples into it is not taken" in caplog.text


def test_a_checkpoint_committed_late_records_the_bytes_on_the_wire_through_its_own_epoch(
    tmp_path: Path,
) -> None:
    """Parts written in the background can commit a checkpoint after a later epoch was emitted: a resumed run
    must not count that epoch's bytes twice."""
    store = CheckpointDir(tmp_path, keep=3)
    ledger = EpochLedger(epochs=3, world_size=1, batches_per_epoch=2)
    committer = CheckpointCommitter(store, 1, {0}, run_kind("sync", False), {})
    committer.expect_parts(Point(0), [0], {})
    for epoch, sent in ((0, 100), (1, 30)):
        ledger.add_chunk(ChunkReport(0, epoch, 2, 8, 1.0, 10.0, 1.0, comm_bytes=sent))
        ledger.expect_eval(epoch, False)
    assert [m.comm_bytes_total for m in ledger.emit_ready()] == [100, 130]
    store.write_part(Point(0), MODEL_FILE, {})
    store.write_part(Point(0), rank_file(0), {})
    committer.on_saved(Point(0), 0, 1, ledger)  # epoch 0's parts land once epoch 1 is emitted too
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.load(COORDINATOR_FILE)["comm_bytes_total"] == 100


def test_a_checkpoint_inside_an_epoch_a_sharded_group_left_resumes_the_epoch_s_record_whole(
    tmp_path: Path,
) -> None:
    """Local SGD under survive by groups: the group that left inside the epoch reported chunks of it, and one
    batch its members trained in step went unreported (lost with the group, never handed out again). A
    checkpoint at a later round of the epoch, the parts the members' left, keeps both: the run resumed there,
    on any world, completes the epoch once the rest is reported (without them it waits forever)."""
    store = CheckpointDir(tmp_path, keep=3)
    ledger = EpochLedger(epochs=2, world_size=4, batches_per_epoch=16, local_sgd=True)
    committer = CheckpointCommitter(store, 4, set(), run_kind("cadence", True), {"uid": "u"})
    for rank in range(4):
        ledger.add_chunk(_chunk(rank, 0, 2, 1.0))
    ledger.lose_batches(0, 1)  # ranks 2 and 3 left
    for rank in (0, 1):
        ledger.add_chunk(_chunk(rank, 0, 2, 1.0))
    point = Point(0, 13 * 4)
    committer.expect_parts(point, [0, 1])
    committer.on_checkpoint_round(point, {"planner": "at its round"}, ledger)
    store.write_part(point, MODEL_FILE, {})
    for rank in (0, 1):
        store.write_part(point, rank_file(rank), {})
        committer.on_saved(point, rank, 2, ledger)
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    resumed = EpochLedger(epochs=2, world_size=3, batches_per_epoch=16, local_sgd=True)
    resumed.resume_partial(0, checkpoint.load(COORDINATOR_FILE)["ledger"])
    assert resumed.reported_batches(0) == 12
    assert not resumed.add_chunk(_chunk(0, 0, 2, 1.0))
    assert resumed.add_chunk(_chunk(2, 0, 1, 1.0))  # the last of 16 less the one lost

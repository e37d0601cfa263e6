"""The epoch ledger: emission order, evals, and averaging rounds that outlive the last batch."""

from __future__ import annotations

import pytest

from flodl.coordinator.ledger import EpochLedger, LedgerError
from flodl.links.messages import ChunkReport, EvalResult
from flodl.metrics.aggregate import RoundCost


def chunk(rank: int, epoch: int, batches: int) -> ChunkReport:
    return ChunkReport(rank, epoch, batches, batches * 4, float(batches), 10.0, 1.0, steps_total=batches)


def test_async_rounds_after_the_last_batch_belong_to_the_last_epoch() -> None:
    ledger = EpochLedger(epochs=2, world_size=2, batches_per_epoch=4, local_sgd=True)
    for epoch in (0, 1):
        ledger.add_chunk(chunk(0, epoch, 3))
        assert ledger.add_chunk(chunk(1, epoch, 1))
        ledger.expect_eval(epoch, False)
    assert [m.epoch for m in ledger.emit_ready()] == [0]  # the last epoch waits for the run's last round
    ledger.open_round(7)  # a drain round after every batch was trained
    ledger.close_round(7, {0: RoundCost(100, 1.0, 0), 1: RoundCost(100, 2.0, 0)})
    assert ledger.emit_ready() == []
    ledger.release()
    (last,) = ledger.emit_ready()
    assert (last.epoch, last.comm_bytes, last.rounds) == (1, 200, 1)
    assert ledger.all_emitted


def test_an_epoch_waits_for_its_eval_from_every_rank() -> None:
    ledger = EpochLedger(epochs=1, world_size=2, batches_per_epoch=2)
    ledger.add_chunk(chunk(0, 0, 1))
    ledger.add_chunk(chunk(1, 0, 1))
    ledger.expect_eval(0, True)
    ledger.add_eval(EvalResult(0, 0, {"accuracy": 3.0}, 4))
    assert ledger.emit_ready() == []
    ledger.add_eval(EvalResult(1, 0, {"accuracy": 1.0}, 4))
    (metrics,) = ledger.emit_ready()
    assert metrics.eval == {"accuracy": 0.5}
    assert metrics.rounds == 1  # no rounds: under DDP each step averages, one per batch per rank


def test_an_epoch_that_completes_before_the_one_ahead_of_it_never_gets_a_negative_time() -> None:
    """Async epochs overlap: epoch 1 can be complete while epoch 0 still waits for its slow rank."""
    ledger = EpochLedger(epochs=2, world_size=2, batches_per_epoch=2)
    ledger.started_at = 0.0
    ledger.add_chunk(chunk(0, 0, 1))
    ledger.add_chunk(chunk(0, 1, 1))
    ledger.add_chunk(chunk(1, 1, 1))  # epoch 1 complete first
    ledger.add_chunk(chunk(1, 0, 1))  # then epoch 0
    for epoch in (0, 1):
        ledger.expect_eval(epoch, False)
    first, second = ledger.emit_ready()
    assert first.epoch_s > 0 and second.epoch_s == 0.0
    assert second.samples_per_s == 0.0


def test_a_local_sgd_epoch_without_a_round_reports_no_averaging() -> None:
    ledger = EpochLedger(epochs=2, world_size=2, batches_per_epoch=2, local_sgd=True)
    for epoch in (0, 1):
        ledger.add_chunk(chunk(0, epoch, 1))
        ledger.add_chunk(chunk(1, epoch, 1))
        ledger.expect_eval(epoch, False)
    (first,) = ledger.emit_ready()  # epoch 1 is held for the run's last round
    assert (first.rounds, first.comm_bytes) == (0, 0)  # not DDP's one average per step


def test_an_eval_waits_for_the_members_that_evaluated_it_and_a_redo_starts_it_afresh() -> None:
    ledger = EpochLedger(epochs=1, world_size=3, batches_per_epoch=3, local_sgd=True)
    for rank in range(3):
        ledger.add_chunk(chunk(rank, 0, 1))
    ledger.expect_eval(0, True, ranks=3)
    ledger.add_eval(EvalResult(0, 0, {"accuracy": 1.0}, 3))  # a third of the eval set, then rank 2 dies
    ledger.membership_event("rank_cut", 2)
    ledger.expect_eval(0, True, ranks=2)  # the round is redone by 2 members: halves, not thirds
    ledger.release()
    ledger.add_eval(EvalResult(0, 0, {"accuracy": 2.0}, 5))
    assert ledger.emit_ready() == []
    ledger.add_eval(EvalResult(1, 0, {"accuracy": 3.0}, 5))
    (metrics,) = ledger.emit_ready()
    assert metrics.eval == {"accuracy": 0.5}
    assert metrics.world == 2


def test_membership_changes_land_in_the_record_of_the_epoch_open() -> None:
    ledger = EpochLedger(epochs=3, world_size=3, batches_per_epoch=2, local_sgd=True)
    ledger.add_chunk(chunk(0, 0, 1))
    ledger.add_chunk(chunk(2, 0, 1))  # rank 2 trained half of epoch 0, then died
    ledger.membership_event("rank_cut", 2, {"silent_s": 2.1})
    ledger.expect_eval(0, False)
    (first,) = ledger.emit_ready()
    ledger.add_chunk(chunk(1, 1, 2))
    ledger.membership_event("rank_admitted", 2, {"startup_s": 2.3, "waited_s": 0.4})
    ledger.expect_eval(1, False)
    (second,) = ledger.emit_ready()
    (cut,) = first.membership
    assert (cut["event"], cut["rank"], cut["timings"]) == ("rank_cut", 2, {"silent_s": 2.1})
    assert cut["at_s"] >= 0
    assert first.world == 2  # the members when it was emitted, after its cut
    assert [p.batches for p in first.per_rank] == [1, 0, 1]  # who trained what, the cut rank too
    record = second.as_record()
    assert [e["event"] for e in record["membership"]] == ["rank_admitted"]
    assert record["world"] == 3
    assert record["per_rank"][2]["batches"] == 0  # back, but it trained nothing of epoch 1
    ledger.add_chunk(chunk(0, 2, 2))
    ledger.expect_eval(2, False)
    ledger.release()
    (last,) = ledger.emit_ready()
    ledger.membership_event("rank_cut", 1)  # lost as the run shuts down: no record is left to carry it
    assert ledger.members == {0, 2} and last.membership == []
    with pytest.raises(LedgerError, match="rank_admitted for rank 2"):
        ledger.membership_event("rank_admitted", 2)
    with pytest.raises(ValueError, match="membership event"):
        ledger.membership_event("rank_lost", 1)


def test_a_run_without_membership_changes_records_the_world_size() -> None:
    ledger = EpochLedger(epochs=1, world_size=2, batches_per_epoch=2)
    ledger.add_chunk(chunk(0, 0, 1))
    ledger.add_chunk(chunk(1, 0, 1))
    ledger.expect_eval(0, False)
    (metrics,) = ledger.emit_ready()
    assert (metrics.as_record()["world"], metrics.as_record()["membership"]) == (2, [])


def test_a_sync_epoch_planned_again_waits_for_what_its_members_report() -> None:
    """Sync under survive: rank 1 was cut after 3 of the epoch's 6 steps; ranks 0 and 2 report those 3 steps
    and the rest re-planned for them (4 steps each). The epoch's steps are a survivor's, not batches over the
    world."""
    ledger = EpochLedger(epochs=2, world_size=3, batches_per_epoch=18)
    ledger.expect_eval(0, False)
    ledger.add_chunk(chunk(0, 0, 3))
    ledger.add_chunk(chunk(2, 0, 3))
    ledger.expect_batches(0, 2 * 3 + 2 * 4)
    assert not ledger.add_chunk(chunk(0, 0, 4))
    assert ledger.add_chunk(chunk(2, 0, 4))
    (metrics,) = ledger.emit_ready()
    assert metrics.rounds == 7
    # Planned again below what was reported: complete at once; and never more than planned.
    ledger.expect_eval(1, False)
    ledger.add_chunk(chunk(0, 1, 2))
    ledger.add_chunk(chunk(2, 1, 2))
    ledger.expect_batches(1, 4)
    with pytest.raises(LedgerError, match="epoch 2: 5 batches reported, 4 planned"):  # lines count from 1
        ledger.add_chunk(chunk(0, 1, 1))
    assert [m.epoch for m in ledger.emit_ready()] == [1]


def test_step_never_goes_back_when_the_busiest_rank_is_cut() -> None:
    """`step` counts the busiest rank's steps so far: a rank cut after it was the busiest still took them."""
    ledger = EpochLedger(epochs=2, world_size=3, batches_per_epoch=6, local_sgd=True)
    for rank, steps in ((0, 298), (1, 328), (2, 290)):
        ledger.add_chunk(ChunkReport(rank, 0, 2, 8, 2.0, 10.0, 1.0, steps_total=steps))
    ledger.expect_eval(0, False)
    (first,) = ledger.emit_ready()
    assert first.step == 328
    ledger.membership_event("rank_cut", 1)
    for rank, steps in ((0, 301), (2, 293)):  # the survivors train on the cut rank's share
        ledger.add_chunk(ChunkReport(rank, 1, 3, 12, 3.0, 10.0, 1.0, steps_total=steps))
    ledger.expect_eval(1, False)
    ledger.release()
    (second,) = ledger.emit_ready()
    assert second.step == 328

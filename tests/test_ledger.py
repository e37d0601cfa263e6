"""The epoch ledger: emission order, evals, and averaging rounds that outlive the last batch."""

from __future__ import annotations

from flodl.coordinator.ledger import EpochLedger
from flodl.metrics.aggregate import RoundCost
from flodl.wire.messages import ChunkReport, EvalResult


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

"""An epoch's record from its chunk reports and evals; the scalars a task records."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import ChunkReport, EvalResult
from flodl.metrics.aggregate import WorkSpan, aggregate_epoch, aggregate_eval, common_window_rate


def chunk(rank: int, batches: int, loss_sum: float, wall_ms: float, steps: int, data_ms: float = 1.0):
    return ChunkReport(
        rank=rank,
        epoch=0,
        batches=batches,
        samples=batches * 32,
        loss_sum=loss_sum,
        wall_ms=wall_ms,
        data_ms=data_ms,
        steps_total=steps,
    )


def test_aggregate_epoch_across_ranks_with_different_batch_counts():
    chunks = [
        chunk(1, batches=1, loss_sum=2.0, wall_ms=2000.0, steps=6, data_ms=4.0),
        chunk(0, batches=3, loss_sum=3.0, wall_ms=1000.0, steps=3, data_ms=1.0),
        chunk(0, batches=2, loss_sum=1.0, wall_ms=500.0, steps=5, data_ms=2.0),
    ]
    evals = [EvalResult(0, 0, {"correct": 30.0}, 40), EvalResult(1, 0, {"correct": 50.0}, 60)]
    out = aggregate_epoch(0, chunks, evals, wall_s=2.0)
    assert out.epoch == 0
    assert out.step == 6
    # Batch-weighted: (2 + 3 + 1) / 6 batches (not a mean of chunk or rank means).
    assert out.loss == pytest.approx(1.0)
    assert out.samples == 192
    # Rank 0 ran 1.5 s in total, rank 1 ran 2 s: the slowest rank sets the epoch time.
    assert out.epoch_s == pytest.approx(2.0)
    assert out.samples_per_s == pytest.approx(96.0)
    assert out.eval == {"correct": pytest.approx(0.8)}
    assert [s.rank for s in out.per_rank] == [0, 1]
    r0, r1 = out.per_rank
    assert (r0.batches, r0.samples, r1.batches, r1.samples) == (5, 160, 1, 32)
    assert r0.batch_share == pytest.approx(5 / 6)
    assert r1.batch_share == pytest.approx(1 / 6)
    assert sum(s.batch_share for s in out.per_rank) == pytest.approx(1.0)
    assert r0.samples_per_s == pytest.approx(160 / 1.5)
    assert r1.samples_per_s == pytest.approx(16.0)
    assert (r0.data_ms, r1.data_ms) == (3.0, 4.0)


def test_aggregate_epoch_record_flattens_eval():
    evals = [EvalResult(0, 2, {"acc": 9.0}, 10, step=40, samples=1280)]
    out = aggregate_epoch(2, [chunk(0, 2, 1.0, 100.0, 2)], evals, wall_s=0.1)
    record = out.as_record()
    assert "eval" not in record
    assert record["eval/acc"] == pytest.approx(0.9)
    # Labelled with what the evaluated model was trained on, not the epoch's own step.
    assert (record["eval_step"], record["eval_samples"]) == (40, 1280)
    assert aggregate_epoch(2, [chunk(0, 2, 1.0, 100.0, 2)], [], wall_s=0.1).as_record()["eval_step"] is None
    assert record["epoch"] == 2
    assert record["per_rank"][0]["rank"] == 0


def test_an_eval_stands_where_the_busiest_member_took_its_model_up():
    """Each member evaluates its shard of one consensus: the eval stands at the busiest member's own steps
    in it (the scale of `step`) and at the time the last member took it up."""
    evals = [
        EvalResult(0, 1, {"acc": 3.0}, 5, step=70, samples=2240, own_steps=30, taken_at=50.0),
        EvalResult(1, 1, {"acc": 4.0}, 5, step=70, samples=2240, own_steps=40, taken_at=50.5),
    ]
    out = aggregate_epoch(1, [chunk(0, 1, 1.0, 100.0, 2)], evals, wall_s=0.1)
    assert (out.eval_at_step, out.eval_taken_at, out.eval_step) == (40, 50.5, 70)
    none = aggregate_epoch(1, [chunk(0, 1, 1.0, 100.0, 2)], [], wall_s=0.1)
    assert (none.eval_at_step, none.eval_taken_at) == (None, None)


def test_async_epoch_rate_is_over_its_common_window_not_rank_0s_epoch_clock():
    # Rank 1 trained 4 batches in [100, 104] s, rank 0 its 2 in [101, 105] s; the epoch completed 0.5 s
    # after the one before it on rank 0's clock.
    chunks = [
        dataclasses.replace(chunk(1, 4, 1.0, 4000.0, 4), started_at=100.0, ended_at=104.0),
        dataclasses.replace(chunk(0, 2, 1.0, 3000.0, 2), started_at=101.0, ended_at=105.0),
    ]
    out = aggregate_epoch(0, chunks, [], wall_s=0.5, world_size=2, overlapping=True)
    assert out.samples_per_s == pytest.approx(6 * 32 / 5.0)
    assert (out.window_start, out.window_end) == (100.0, 105.0)
    assert out.samples_per_s <= sum(s.samples_per_s for s in out.per_rank)
    # With a barrier (sync, cadence) the epoch's clock is its window.
    assert aggregate_epoch(0, chunks, [], wall_s=0.5, world_size=2).samples_per_s == pytest.approx(384.0)


@st.composite
def rank_chunks(draw, rank: int) -> list[ChunkReport]:
    """One rank's chunks of an epoch, one after another on its own (possibly skewed) clock."""
    clock = draw(st.floats(-5.0, 5.0))
    out = []
    for _ in range(draw(st.integers(0, 4))):
        clock += draw(st.floats(0.0, 3.0))  # waits between chunks (rounds, other epochs' work)
        busy = draw(st.floats(1e-3, 3.0))
        span = busy + draw(st.floats(0.0, 1.0))  # the chunk's wall time: its steps and what ran between
        batches = draw(st.integers(1, 20))
        out.append(
            ChunkReport(
                rank, 0, batches, batches * 8, 1.0, busy * 1000, 0.0, started_at=clock, ended_at=clock + span
            )
        )
        clock += span
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), world=st.integers(1, 4), wall_s=st.floats(1e-3, 10.0))
def test_an_async_epoch_never_beats_the_ranks_own_speeds(data, world, wall_s):
    chunks = [c for r in range(world) for c in data.draw(rank_chunks(r))]
    if not chunks:
        return
    out = aggregate_epoch(0, chunks, [], wall_s=wall_s, world_size=world, overlapping=True)
    assert out.samples_per_s <= sum(s.samples_per_s for s in out.per_rank) * (1 + 1e-9)
    spans = [WorkSpan(c.rank, c.started_at, c.ended_at, c.samples, c.wall_ms / 1000) for c in chunks]
    # The window is never shorter than the work's own span: the rate is at most samples over it.
    window = max(c.ended_at for c in chunks) - min(c.started_at for c in chunks)
    assert common_window_rate(spans) <= out.samples / window * (1 + 1e-9)


def test_aggregate_epoch_without_reports_fails():
    with pytest.raises(ValueError, match="epoch 4"):
        aggregate_epoch(4, [], [], wall_s=1.0)


def test_aggregate_epoch_with_zero_batches_is_nan_loss():
    out = aggregate_epoch(0, [chunk(0, 0, 0.0, 0.0, 0)], [], wall_s=0.0)
    assert math.isnan(out.loss)
    assert out.samples_per_s == 0.0
    assert out.per_rank[0].batch_share == 0.0


def test_aggregate_eval_divides_summed_metrics_by_total_count():
    evals = [
        EvalResult(rank=0, epoch=1, sums={"correct": 30.0, "loss": 12.0}, count=40),
        EvalResult(rank=1, epoch=1, sums={"correct": 50.0, "loss": 8.0}, count=60),
    ]
    assert aggregate_eval(evals) == {"correct": pytest.approx(0.8), "loss": pytest.approx(0.2)}


def test_aggregate_eval_empty():
    assert aggregate_eval([]) == {}
    assert aggregate_eval([EvalResult(0, 0, {"correct": 0.0}, 0)]) == {}


def test_record_scalar_accumulates_tensors_and_floats_until_drained():
    from flodl import record_scalar
    from flodl.metrics.scalars import drain_scalars, mean_scalars

    drain_scalars()
    record_scalar("grad_norm", torch.tensor(2.0))
    record_scalar("grad_norm", 4.0)
    record_scalar("acc", torch.tensor(0.5))
    first = drain_scalars()
    assert first == {"grad_norm": [6.0, 2.0], "acc": [0.5, 1.0]}
    assert drain_scalars() == {}
    assert mean_scalars([first, {"grad_norm": [3.0, 1.0]}]) == {"grad_norm": 3.0, "acc": 0.5}


def test_epoch_scalars_are_means_over_every_ranks_records():
    chunks = [chunk(0, 2, 1.0, 10.0, 2), chunk(1, 2, 1.0, 10.0, 2)]
    chunks[0].scalars = {"x": [3.0, 3.0]}
    chunks[1].scalars = {"x": [9.0, 1.0]}
    assert aggregate_epoch(0, chunks, [], wall_s=1.0).scalars == {"x": 3.0}


def test_epoch_reports_its_averaging_rounds():
    assert aggregate_epoch(0, [chunk(0, 2, 1.0, 10.0, 2)], [], wall_s=1.0, rounds=4).rounds == 4


def test_every_rank_has_a_share_even_without_batches_this_epoch():
    out = aggregate_epoch(3, [chunk(0, 4, 2.0, 10.0, 9)], [], wall_s=1.0, world_size=2)
    assert [(s.rank, s.batches, s.batch_share) for s in out.per_rank] == [(0, 4, 1.0), (1, 0, 0.0)]


def test_the_longest_compilation_is_reported_apart_from_the_throughput():
    compiled = [chunk(0, 4, 4.0, 500.0, 4), chunk(1, 4, 4.0, 500.0, 4)]
    compiled[0].compile_s, compiled[1].compile_s = 3.0, 2.5
    out = aggregate_epoch(0, compiled, [], wall_s=4.0)
    assert out.compile_s == 3.0 and out.epoch_s == 4.0
    assert out.samples_per_s == pytest.approx(256 / 1.0)
    assert aggregate_epoch(0, [chunk(0, 4, 4.0, 500.0, 4)], [], wall_s=4.0).compile_s == 0.0


def test_an_epoch_says_its_tokens_mfu_data_wait_and_peak_memory():
    def measured(rank: int, peak: float, memory: int) -> ChunkReport:
        return dataclasses.replace(
            chunk(rank, 10, 5.0, wall_ms=1000.0, steps=10, data_ms=100.0),
            flops_per_sample=3e9,
            peak_flops=peak,
            tokens_per_sample=1024,
            peak_memory=memory,
        )

    metrics = aggregate_epoch(0, [measured(0, 1e12, 5), measured(1, 2e12, 7)], [], wall_s=2.0, world_size=2)
    rate = metrics.samples_per_s  # 2 ranks x 10 batches x 32 samples over 2 s
    assert rate == 320
    assert metrics.tokens_per_s == 320 * 1024
    # Model FLOPs per second over the peaks of the devices that trained: 320 x 3e9 / 3e12.
    assert metrics.mfu == pytest.approx(0.32)
    assert metrics.data_wait == pytest.approx(0.1) and metrics.peak_memory == 7
    record = metrics.as_record()
    assert record["mfu"] == metrics.mfu and record["tokens_per_s"] == metrics.tokens_per_s

    unknown = aggregate_epoch(0, [measured(0, 1e12, 0), measured(1, 0.0, 0)], [], wall_s=2.0, world_size=2)
    assert unknown.mfu is None  # one device's peak is not known
    plain = aggregate_epoch(0, [chunk(0, 10, 5.0, 1000.0, 10)], [], wall_s=1.0, world_size=1)
    assert plain.tokens_per_s is None and plain.mfu is None and plain.peak_memory == 0

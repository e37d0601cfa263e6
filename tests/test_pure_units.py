"""Pure units: partition plans, messages, aggregation, eval schedule, LR scaling, datasets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from flodl.coordinator.coordinator import EpochSchedule
from flodl.data.dataset import BatchDataSet, MapDataSet, TensorDataSet, as_batch_dataset
from flodl.data.partition import Slice, epoch_permutation, equal_slices, picks_to_samples
from flodl.metrics.aggregate import aggregate_epoch, aggregate_eval
from flodl.wire import messages
from flodl.wire.group import _differences
from flodl.wire.messages import (
    EvalResult,
    Exiting,
    ExtendPartition,
    Heartbeat,
    MessageError,
    Metrics,
    Progress,
    Reached,
    Saved,
    Shutdown,
    StartEpoch,
    SyncAck,
    SyncNow,
    decode,
    encode,
)
from flodl.worker.task_setup import lr_scale_factor

# --- partition ---------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [1, 2, 17, 100])
def test_epoch_permutation_is_a_permutation(total):
    perm = epoch_permutation(total, seed=42, epoch=3)
    assert perm.dtype == torch.int64
    assert torch.equal(torch.sort(perm).values, torch.arange(total))


def test_epoch_permutation_is_deterministic_for_seed_and_epoch():
    assert torch.equal(epoch_permutation(200, 7, 2), epoch_permutation(200, 7, 2))


def test_epoch_permutation_differs_across_epochs_and_seeds():
    base = epoch_permutation(200, 7, 0)
    assert not torch.equal(base, epoch_permutation(200, 7, 1))
    assert not torch.equal(base, epoch_permutation(200, 8, 5))
    assert len({tuple(epoch_permutation(50, 1, e).tolist()) for e in range(5)}) == 5


def test_epoch_permutation_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    epoch_permutation(100, 5, 1)
    assert torch.equal(torch.rand(3), expected)


@settings(max_examples=200, deadline=None)
@given(picks=st.integers(0, 5000), world=st.integers(1, 16), batch=st.integers(1, 64))
def test_equal_slices_are_disjoint_consecutive_equal_whole_batches(picks, world, batch):
    slices = equal_slices(picks, world, batch)
    assert len(slices) == world
    size = (picks // (world * batch)) * batch
    for rank, piece in enumerate(slices):
        assert piece == Slice(offset=rank * size, size=size)
        assert piece.size % batch == 0
    covered = [p for s in slices for p in range(s.offset, s.offset + s.size)]
    assert len(covered) == len(set(covered)) == (picks // (world * batch)) * world * batch
    assert covered == list(range(len(covered)))
    assert 0 <= picks - len(covered) < world * batch


def test_equal_slices_example():
    assert equal_slices(100, 3, 8) == [Slice(0, 32), Slice(32, 32), Slice(64, 32)]
    assert equal_slices(10, 4, 4) == [Slice(0, 0)] * 4


def test_picks_to_samples():
    picks = torch.tensor([0, 1, 2, 3, 4, 5, 8])
    assert picks_to_samples(picks, 3).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert picks_to_samples(picks, 1).tolist() == picks.tolist()


@given(samples=st.integers(1, 60), augment=st.integers(1, 5))
def test_augmented_epoch_reads_every_sample_augment_times(samples, augment):
    picks = epoch_permutation(samples * augment, seed=0, epoch=1)
    counts = torch.bincount(picks_to_samples(picks, augment), minlength=samples)
    assert counts.tolist() == [augment] * samples


# --- messages ----------------------------------------------------------------------------------

MESSAGES = [
    StartEpoch(epoch=3, offset=64, size=32, evaluate=True),
    StartEpoch(epoch=0, offset=0, size=8),
    StartEpoch(epoch=5, offset=0, size=8, checkpoint=True),
    Saved(rank=1, epoch=5),
    Heartbeat(rank=0, step=123),
    Exiting(rank=1, reason="NonFiniteError: rank 1: the training loss became non-finite at step 7"),
    Shutdown(),
    Shutdown(reason="rank 1 failed"),
    Metrics(
        rank=1,
        epoch=2,
        batches=5,
        samples=160,
        loss_sum=3.25,
        wall_ms=812.5,
        data_ms=12.0,
        steps_total=40,
        scalars={"lr": [0.001, 0.002]},
    ),
    Metrics(rank=0, epoch=0, batches=0, samples=0, loss_sum=0.0, wall_ms=0.0, data_ms=0.0),
    EvalResult(rank=0, epoch=4, sums={"correct": 30.0, "loss": 11.5}, count=40),
    Exiting(rank=2),
    ExtendPartition(slices=[[0, 64, 96], [1, 0, 32]], target=3),
    SyncNow(round=7, evaluate_epoch=2, final=True),
    SyncNow(round=9, final=True, checkpoint_epoch=3),
    SyncNow(round=1),
    Progress(rank=1, epoch=0, step=50, loss=0.75, samples_per_s=1200.0, lr=0.001),
    Reached(rank=1, steps=12, busy_ms=40.5),
    SyncAck(
        rank=0,
        round=3,
        steps=9,
        skipped=False,
        divergence=0.01,
        pre_norm=3.5,
        post_norm=3.4,
        sync_ms=1.5,
        queued=2,
        idle_ms=4.0,
    ),
]


def test_message_examples_cover_every_type():
    assert {type(m) for m in MESSAGES} == set(messages._TYPES.values())


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(message):
    raw = encode(message)
    assert isinstance(raw, bytes)
    back = decode(raw)
    assert type(back) is type(message)
    assert back == message


def test_encoding_is_json_not_pickle():
    assert encode(Saved(rank=3, epoch=1)) == b'{"type": "Saved", "body": {"rank": 3, "epoch": 1}}'


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"null",
        b"[1, 2]",
        b'"Shutdown"',
        b"{}",
        b'{"type": "Nope", "body": {}}',
        b'{"type": "Shutdown"}',
        b'{"type": "Shutdown", "body": {"bogus": 1}}',
        b'{"type": "Metrics", "body": {"rank": 0}}',
        b'{"type": "Exiting", "body": [1]}',
        b'{"type": ["Exiting"], "body": {"rank": 0}}',
    ],
)
def test_decode_garbage_raises_message_error(raw):
    with pytest.raises(MessageError, match="undecodable flodl message"):
        decode(raw)


# --- aggregation -------------------------------------------------------------------------------


def chunk(rank: int, batches: int, loss_sum: float, wall_ms: float, steps: int, data_ms: float = 1.0):
    return Metrics(
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
    out = aggregate_epoch(2, [chunk(0, 2, 1.0, 100.0, 2)], [EvalResult(0, 2, {"acc": 9.0}, 10)], wall_s=0.1)
    record = out.as_record()
    assert "eval" not in record
    assert record["eval/acc"] == pytest.approx(0.9)
    assert record["epoch"] == 2
    assert record["per_rank"][0]["rank"] == 0


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


# --- eval schedule -----------------------------------------------------------------------------


def schedule(eval_every: int, epochs: int = 10, has_eval: bool = True) -> EpochSchedule:
    return EpochSchedule(
        epochs=epochs, world_size=2, total_picks=100, batch_size=8, eval_every=eval_every, has_eval=has_eval
    )


@pytest.mark.parametrize(
    ("eval_every", "expected"),
    [(0, []), (1, list(range(10))), (3, [2, 5, 8, 9]), (5, [4, 9]), (20, [9])],
)
def test_evaluates_after(eval_every, expected):
    sched = schedule(eval_every)
    assert [e for e in range(10) if sched.evaluates_after(e)] == expected


def test_no_eval_data_never_evaluates():
    sched = schedule(1, has_eval=False)
    assert not any(sched.evaluates_after(e) for e in range(10))


# --- lr scaling --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "ratio", "factor"),
    [(1, 1.0, 1.0), (1, 0.5, 1.0), (4, 1.0, 4.0), (4, 0.5, 2.5), (8, 0.0, 1.0), (3, 0.25, 1.5)],
)
def test_lr_scale_factor(world, ratio, factor):
    assert lr_scale_factor(world, ratio) == pytest.approx(factor)


# --- config agreement --------------------------------------------------------------------------


def test_differences_of_equal_configs_is_empty():
    cfg = {"a": 1, "n": {"b": [1, 2], "c": {"d": "x"}}}
    assert _differences(cfg, {"a": 1, "n": {"b": [1, 2], "c": {"d": "x"}}}) == []


def test_differences_names_nested_keys():
    a = {"seed": 1, "task": {"model": {"hidden": 128}, "name": "digits"}, "gamma": 1.0}
    b = {"seed": 1, "task": {"model": {"hidden": 64}, "name": "digits", "extra": 3}, "gamma": 0.5}
    assert _differences(a, b) == [
        "gamma (rank 0: 1.0, other: 0.5)",
        "task.extra (rank 0: '<absent>', other: 3)",
        "task.model.hidden (rank 0: 128, other: 64)",
    ]


def test_differences_dict_against_scalar():
    assert _differences({"launch": {"n": 1}}, {"launch": 5}) == ["launch (rank 0: {'n': 1}, other: 5)"]


# --- datasets ----------------------------------------------------------------------------------


def test_tensor_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="disagree on length"):
        TensorDataSet(torch.zeros(3, 2), torch.zeros(4))


def test_tensor_dataset_needs_a_field():
    with pytest.raises(ValueError, match="at least one tensor"):
        TensorDataSet()


def test_tensor_dataset_get_batch_gathers_rows():
    x = torch.arange(10).view(5, 2)
    y = torch.arange(5) * 10
    data = TensorDataSet(x, y)
    assert len(data) == 5
    bx, by = data.get_batch(torch.tensor([4, 0, 4]))
    assert bx.tolist() == [[8, 9], [0, 1], [8, 9]]
    assert by.tolist() == [40, 0, 40]


def test_as_batch_dataset_keeps_a_batch_dataset():
    data = TensorDataSet(torch.zeros(2))
    assert isinstance(data, BatchDataSet)
    assert as_batch_dataset(data, "task.train_data") is data


def test_as_batch_dataset_adapts_a_torch_dataset():
    x = torch.arange(12, dtype=torch.float32).view(6, 2)
    y = torch.arange(6)
    data = as_batch_dataset(TensorDataset(x, y), "task.train_data")
    assert isinstance(data, MapDataSet)
    assert len(data) == 6
    idx = torch.tensor([5, 1, 1])
    bx, by = data.get_batch(idx)
    assert torch.equal(bx, x[idx])
    assert torch.equal(by, y[idx])


def test_as_batch_dataset_adapts_single_field_items():
    data = as_batch_dataset([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], "task.eval_data")
    (batch,) = data.get_batch(torch.tensor([1, 0]))
    assert batch.tolist() == [[3.0, 4.0], [1.0, 2.0]]


def test_as_batch_dataset_rejects_an_empty_dataset():
    with pytest.raises(ValueError, match=r"task\.train_data: the dataset is empty"):
        as_batch_dataset(TensorDataset(torch.empty(0, 2)), "task.train_data")
    with pytest.raises(ValueError, match=r"task\.eval_data: the dataset is empty"):
        as_batch_dataset(TensorDataSet(torch.empty(0)), "task.eval_data")


@pytest.mark.parametrize("data", [42, object(), None])
def test_as_batch_dataset_rejects_a_non_dataset(data):
    with pytest.raises(TypeError) as info:
        as_batch_dataset(data, "task.eval_data")
    message = str(info.value)
    assert message.startswith("task.eval_data: ")
    assert type(data).__name__ in message


def test_slice_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Slice(0, 1).size = 2  # type: ignore[misc]


def test_differences_tells_an_absent_key_from_a_null_one():
    assert _differences({"a": None}, {}) == ["a (rank 0: None, other: '<absent>')"]


# --- record_scalar -------------------------------------------------------------------------------


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
    assert aggregate_epoch(0, [chunk(0, 2, 1.0, 10.0, 2)], [], wall_s=1.0, syncs=4).syncs == 4


def test_every_rank_has_a_share_even_without_batches_this_epoch():
    out = aggregate_epoch(3, [chunk(0, 4, 2.0, 10.0, 9)], [], wall_s=1.0, world_size=2)
    assert [(s.rank, s.batches, s.batch_share) for s in out.per_rank] == [(0, 4, 1.0), (1, 0, 0.0)]

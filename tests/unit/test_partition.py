"""The data partition: epoch permutations, equal slices, picks of augmented samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.data.partition import epoch_permutation, equal_slices, picks_to_samples
from flodl.links.messages import EpochSlice


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
        assert piece == EpochSlice(epoch=0, offset=rank * size, size=size)
        assert piece.size % batch == 0
    covered = [p for s in slices for p in range(s.offset, s.offset + s.size)]
    assert len(covered) == len(set(covered)) == (picks // (world * batch)) * world * batch
    assert covered == list(range(len(covered)))
    assert 0 <= picks - len(covered) < world * batch


def test_equal_slices_example():
    assert equal_slices(100, 3, 8) == [EpochSlice(0, 0, 32), EpochSlice(0, 32, 32), EpochSlice(0, 64, 32)]
    assert equal_slices(100, 3, 8, epoch=4)[2] == EpochSlice(4, 64, 32)
    assert equal_slices(10, 4, 4) == [EpochSlice(0, 0, 0)] * 4


def test_picks_to_samples():
    picks = torch.tensor([0, 1, 2, 3, 4, 5, 8])
    assert picks_to_samples(picks, 3).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert picks_to_samples(picks, 1).tolist() == picks.tolist()


@given(samples=st.integers(1, 60), augment=st.integers(1, 5))
def test_augmented_epoch_reads_every_sample_augment_times(samples, augment):
    picks = epoch_permutation(samples * augment, seed=0, epoch=1)
    counts = torch.bincount(picks_to_samples(picks, augment), minlength=samples)
    assert counts.tolist() == [augment] * samples


def test_slice_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EpochSlice(0, 0, 1).size = 2  # type: ignore[misc]

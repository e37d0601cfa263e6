"""The folded round: its totals travel in front of the parameters in the one all-reduce (one gloo rank
here; tests/test_consensus_collective.py runs it over 2 ranks, and over NCCL as a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from flodl.averaging.folded import folded_head
from flodl.averaging.reducer import Reducer
from tests.test_chunk_spans import Recorder, logged_wire


def test_a_round_in_one_piece_carries_its_totals_in_front(solo_group):
    reducer = Reducer(gamma=1.0, bf16_wire=False)
    storage = torch.cat([torch.full((3,), -1.0), torch.arange(12, dtype=torch.float32)])
    flat = storage[3:]
    stages = Recorder()
    logged_wire(reducer, stages)
    result = reducer.reduce([flat], None, None, steps=2, stages=stages, carrier=storage)
    assert stages.calls == [("before", 0), ("wire", 0, 15), ("during", 0), ("after", 0)]
    assert torch.equal(flat, torch.arange(12, dtype=torch.float32))  # 2θ / 2
    assert (result.skipped, result.total_steps, result.payload_bytes) == (False, 2, 48)
    assert storage[:3].tolist() == [2.0, 1.0, 2.0]  # Σ m, Σ mover, Σ n: the one rank's own


def test_a_carrier_without_room_for_the_totals_is_refused(solo_group):
    storage = torch.zeros(6)
    with pytest.raises(ValueError, match="3 spare elements"):
        Reducer(gamma=1.0, bf16_wire=False).reduce([storage[2:]], None, None, steps=1, carrier=storage)


def test_a_folded_round_nobody_moved_in_leaves_the_state_alone(solo_group):
    # Every rank scaled by 0: the idle rank kept its state before and puts it back.
    reducer = Reducer(gamma=1.0, bf16_wire=False)
    storage = torch.cat([torch.zeros(3), torch.arange(1.0, 7.0)])
    buffers = torch.tensor([0.5, 1.5])
    result = reducer.reduce([storage[3:]], None, buffers, steps=0, carrier=storage)
    assert (result.skipped, result.total_steps, result.payload_bytes) == (True, 0, 0)
    assert torch.equal(storage[3:], torch.arange(1.0, 7.0)) and torch.equal(buffers, torch.tensor([0.5, 1.5]))


@pytest.mark.parametrize("steps", [1, 3, 7, 1000])
@pytest.mark.parametrize("gamma", [-4.0, -1.0, 0.0, 0.5, 1.0, 4.0])
def test_a_folded_head_scaled_by_the_mass_is_the_ranks_totals(steps, gamma):
    mass = steps**gamma
    scaled = torch.tensor(folded_head(steps, gamma), dtype=torch.float32) * torch.tensor(mass).float()
    assert scaled.tolist() == pytest.approx([mass, 1.0, steps], rel=1e-6)
    assert folded_head(0, gamma) == [0.0, 0.0, 0.0]  # an idle rank adds nothing, whatever its scale


def test_which_rounds_fold_their_totals(solo_group):
    # Only what every rank agrees on decides: the model's dtypes, the config and the order.
    f32, bf16 = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    plain = Reducer(gamma=1.0, bf16_wire=False)
    assert plain.folds([f32], exact=False)
    assert not plain.folds([f32], exact=True)  # an all-idle exact round needs Σ kept: totals first
    assert not plain.folds([f32, bf16], exact=False)
    assert not plain.folds([bf16], exact=False)
    plain.gamma = -4.5
    assert not plain.folds([f32], exact=False)
    plain.gamma, plain.bf16_wire = 1.0, True
    assert not plain.folds([f32], exact=False)
    plain.bf16_wire, plain.min_chunk_bytes = False, 8
    assert not plain.folds([f32], exact=False)  # in chunks: the division would be a pass per chunk

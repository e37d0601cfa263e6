"""The round weighted on the device (one gloo rank here; tests/runs/test_consensus_collective.py runs it
over 2 ranks, and over NCCL replayed from a CUDA graph)."""

from __future__ import annotations

import torch

from flodl.averaging.reducer import Reducer
from flodl.averaging.wire import BF16
from tests.helpers.stage_log import Recorder, logged_wire


def test_a_round_in_one_piece_runs_its_stages_around_the_one_payload_collective(solo_group):
    reducer = Reducer(gamma=1.0)
    flat = torch.arange(12, dtype=torch.float32)
    buffers = torch.tensor([0.5, 1.5])
    stages = Recorder()
    logged_wire(reducer, stages)
    result = reducer.reduce([flat], None, buffers, steps=3, stages=stages)
    # The totals' all-reduce is not the payload's: it is not logged.
    assert stages.calls == [("before", 0), ("wire", 0, 12), ("after", 0), ("wire", 0, 2)]
    assert torch.equal(flat, torch.arange(12, dtype=torch.float32))  # one rank: its own weight is 1
    assert torch.equal(buffers, torch.tensor([0.5, 1.5]))
    assert (result.skipped, result.total_steps, result.payload_bytes) == (False, 3, 56)


def test_a_round_nobody_moved_in_leaves_the_state_alone(solo_group):
    # 0 / 0: the weights are NaN on every rank; the idle rank kept its state before and puts it back.
    reducer = Reducer(gamma=1.0)
    flat, buffers = torch.arange(1.0, 7.0), torch.tensor([0.5, 1.5])
    result = reducer.reduce([flat], None, buffers, steps=0)
    assert (result.skipped, result.total_steps, result.payload_bytes) == (True, 0, 0)
    assert torch.equal(flat, torch.arange(1.0, 7.0)) and torch.equal(buffers, torch.tensor([0.5, 1.5]))


def test_which_rounds_get_their_weights_on_the_device(solo_group):
    # Only what every rank agrees on decides: the model's dtypes, the config and the order.
    f32, bf16 = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    reducer = Reducer(gamma=1.0)
    assert reducer.weighs_on_device([f32], exact=False)
    assert not reducer.weighs_on_device([f32], exact=True)  # an all-idle exact round needs Σ kept
    assert not reducer.weighs_on_device([f32, bf16], exact=False)
    assert not reducer.weighs_on_device([bf16], exact=False)
    reducer.min_chunk_bytes = 8
    assert not reducer.weighs_on_device([f32], exact=False)  # in chunks
    reducer.min_chunk_bytes, reducer.wire = 1 << 20, BF16
    assert not reducer.weighs_on_device([f32], exact=False)

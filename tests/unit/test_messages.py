"""The messages between ranks: every type round-trips as JSON; garbage is refused."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from flodl.links import messages
from flodl.links.messages import (
    AverageNow,
    ChunkReport,
    EpochSlice,
    EvalResult,
    Exiting,
    ExtendPartition,
    FirstStep,
    Heartbeat,
    Joined,
    MessageError,
    ModelSaved,
    Progress,
    Reached,
    Regroup,
    Regrouped,
    RoundAck,
    Saved,
    SaveModel,
    Shutdown,
    StartEpoch,
    StopRequested,
    decode,
    encode,
)
from flodl.links.state_bytes import state_from_bytes, state_to_bytes

MESSAGES = [
    StartEpoch(3, [EpochSlice(epoch=3, offset=64, size=32)], evaluate=True),
    StartEpoch(0, [EpochSlice(epoch=0, offset=0, size=8)]),
    StartEpoch(5, [EpochSlice(epoch=5, offset=0, size=8)], checkpoint=True),
    StartEpoch(2, [EpochSlice(2, 96, 32), EpochSlice(2, 320, 64)], generation=3, first_step=7),
    StartEpoch(4, [], evaluate=True, checkpoint=True, generation=1, first_step=12),
    Saved(rank=1, epoch=5),
    Saved(rank=0, epoch=2, into=640, step=10),
    StopRequested(rank=1, signum=15),
    Shutdown("stopped by SIGTERM", signum=15),
    Heartbeat(rank=0, step=123),
    Exiting(rank=1, reason="NonFiniteError: rank 1: the training loss became non-finite at step 7"),
    Shutdown(),
    Shutdown(reason="rank 1 failed"),
    SaveModel(path="/runs/a/model.pt"),
    ModelSaved(rank=2),
    ChunkReport(
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
    ChunkReport(rank=0, epoch=0, batches=0, samples=0, loss_sum=0.0, wall_ms=0.0, data_ms=0.0),
    EvalResult(rank=0, epoch=4, sums={"correct": 30.0, "loss": 11.5}, count=40, step=96, samples=3072),
    Exiting(rank=2),
    Regroup(generation=2, members=[0, 2], cut_round=7),
    Regroup(generation=3, members=[0, 1, 2], joining=[1], shares_state=True),
    Regrouped(rank=2, generation=3, release_ms=0.4, form_ms=12.5),
    Regrouped(rank=0, generation=4, release_ms=1.5, form_ms=3.0, position=[2, 17]),
    Regroup(generation=5, members=[0, 1, 2], joining=[2], shares_state=True, in_order=True),
    FirstStep(rank=0, generation=4),
    Joined(rank=1, incarnation=1, startup_s=2.5),
    ExtendPartition(slices=[EpochSlice(0, 64, 96), EpochSlice(1, 0, 32)], target=3),
    ExtendPartition(slices=[], target=0),
    AverageNow(round=7, evaluate_epochs=[1, 2], final=True),
    AverageNow(round=9, final=True, checkpoint_epoch=3),
    AverageNow(round=1),
    Progress(rank=1, epoch=0, step=50, loss=0.75, samples_per_s=1200.0, lr=0.001),
    Reached(rank=1, steps=12, busy_ms=40.5),
    RoundAck(
        rank=0,
        round=3,
        steps=9,
        skipped=False,
        divergence=0.01,
        round_ms=1.5,
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
    encoded = (
        b'{"type": "Saved", "body": {"rank": 3, "epoch": 1, "into": null, "step": null, "chunks": 0, '
        b'"after_stop": false}}'
    )
    assert encode(Saved(rank=3, epoch=1)) == encoded


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
        b'{"type": "ChunkReport", "body": {"rank": 0}}',
        b'{"type": "StartEpoch", "body": {"epoch": 0, "slices": [[0, 0]]}}',
        b'{"type": "ExtendPartition", "body": {"slices": [{"epoch": 0}], "target": 1}}',
        b'{"type": "Exiting", "body": [1]}',
        b'{"type": ["Exiting"], "body": {"rank": 0}}',
    ],
)
def test_decode_garbage_raises_message_error(raw):
    with pytest.raises(MessageError, match="undecodable flodl message"):
        decode(raw)


class _RunsCode:
    """Pickles as a call: unpickling it makes the directory `path` (what a hostile peer's bytes could do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def test_a_rank_state_round_trips_as_bytes() -> None:
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    state = {"stepper": {"optimizer": optimizer.state_dict(), "steps_total": 7}, "lr_world": 2}
    back = state_from_bytes(state_to_bytes(state))
    assert back["stepper"]["steps_total"] == 7 and back["lr_world"] == 2
    saved = back["stepper"]["optimizer"]["state"][0]
    assert torch.equal(saved["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_joiner_s_optimizer_from_a_peer_s_bytes_is_placed_as_one_from_a_checkpoint() -> None:
    # A restarted rank takes a member's optimizer state this way. Its Adam `step` counts stayed on the GPU
    # (map_location was the rank's device, and load_state_dict leaves `step` where it comes): every step then
    # read each back to the host, and a restarted rank on an H100 trained ~40% slower for the rest of the run.
    def adam() -> torch.optim.Adam:
        return torch.optim.Adam([torch.nn.Parameter(torch.ones(3, device="cuda"))], foreach=True)

    member = adam()
    member.param_groups[0]["params"][0].grad = torch.ones(3, device="cuda")
    member.step()
    joiner = adam()
    joiner.load_state_dict(state_from_bytes(state_to_bytes(member.state_dict())))
    (param,) = joiner.param_groups[0]["params"]
    state, theirs = joiner.state[param], member.state[member.param_groups[0]["params"][0]]
    assert {k: v.device.type for k, v in state.items()} == {k: v.device.type for k, v in theirs.items()}
    assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "cuda"


def test_a_peer_s_bytes_are_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a torch release whose torch.load still defaults to weights_only=False (before 2.6).
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    made = tmp_path / "made-by-a-peer"
    payload = state_to_bytes({"stepper": _RunsCode(str(made))})
    with pytest.raises(pickle.UnpicklingError):
        state_from_bytes(payload)
    assert not made.exists()

"""Rank side of tests/runs/test_consensus_collective.py: averaging rounds over 2 real ranks.

`worker` is the entry point of each spawned rank. It joins a process group (gloo on the CPU, or nccl
with one GPU per rank) through the parent's TCPStore, runs every scenario in sequence on a fresh model
(all ranks run the same list in the same order, so the collectives line up) and saves plain CPU tensors
and numbers per scenario with torch.save. The parent does every hand computation; nothing here asserts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.averaging.consensus import DeviceAverager, HostAverager, RoundOutcome
from flodl.averaging.outer import OuterSettings
from flodl.averaging.wire import BF16, FP32, INT4, INT8, Wire
from tests.helpers.spawned import join_group, leave

WORLD = 2
CPU = torch.device("cpu")
# The rank's device: the CPU over gloo, cuda:<rank> over nccl (set once by `worker`).
DEVICE = CPU
# make_model's 47 parameters (188 bytes) reduce as 3 chunks of at least this size.
CHUNK_BYTES = 48
# What rank r adds to its parameters, times r + 1, while a host round is in flight (async and overlapped
# rounds keep training).
TRAIN_DURING_ROUND = 0.25


@dataclass(frozen=True)
class Spec:
    # "device" (DeviceAverager), "chunked" (DeviceAverager reducing in CHUNKED_PIECES pipelined chunks)
    # or "host" (HostAverager on its own gloo group)
    backend: str
    gamma: float
    steps: tuple[int, int]
    alpha: float | None = None
    wire: Wire = FP32
    outer: str = "avg"
    rounds: int = 1
    train_during_round: bool = False
    keeps_own: bool = True  # device only: keep the pre-reduce copy (divergence, EASGD)
    exact: bool = False  # the last round of a run: every rank must end with the same state
    kept: tuple[bool, bool] = (True, True)  # False: the rank dropped its window (non-finite loss)
    step_growth: tuple[int, int] = (0, 0)  # steps added per round after the first
    keep_progress: bool = False  # host only: an overlapped round keeps what was trained since begin

    def steps_in(self, rank: int, round_: int) -> int:
        return self.steps[rank] + self.step_growth[rank] * round_


def _scenarios() -> dict[str, Spec]:
    specs: dict[str, Spec] = {}
    for backend in ("device", "chunked", "host"):
        base = {
            "work_weighted": Spec(backend, 1.0, (3, 1)),
            "plain_mean": Spec(backend, 0.0, (5, 2)),
            "inverse_work": Spec(backend, -1.0, (4, 1)),
            # A steep gamma: one rank's weight dwarfs the other's.
            "steep_gamma": Spec(backend, 4.5, (2, 3)),
            "idle_rank1_gamma1": Spec(backend, 1.0, (3, 0)),
            "idle_rank1_gamma0": Spec(backend, 0.0, (3, 0)),
            "idle_rank1_gamma-1": Spec(backend, -1.0, (3, 0)),
            "idle_rank0_gamma0": Spec(backend, 0.0, (0, 2)),
            "all_idle_gamma1": Spec(backend, 1.0, (0, 0)),
            "all_idle_gamma0": Spec(backend, 0.0, (0, 0)),
            "all_idle_exact": Spec(backend, 1.0, (0, 0), exact=True),
            "all_idle_exact_one_dropped": Spec(backend, 1.0, (0, 0), exact=True, kept=(True, False)),
            "easgd": Spec(backend, 1.0, (3, 1), alpha=0.3),
            "bf16_wire": Spec(backend, 1.0, (3, 1), wire=BF16),
            # Two rounds: the second sends the first one's rounding along (error feedback).
            "int8_wire": Spec(backend, 1.0, (3, 1), wire=INT8, rounds=2),
            "int4_wire": Spec(backend, 1.0, (3, 1), wire=INT4, rounds=2),
            "slowmo": Spec(backend, 1.0, (3, 1), outer="slowmo", rounds=2),
            "diloco": Spec(backend, 0.0, (3, 1), outer="diloco", rounds=2),
        }
        specs.update({f"{backend}/{name}": spec for name, spec in base.items()})
    specs["host/train_during_round"] = Spec("host", 1.0, (3, 1), train_during_round=True)
    specs["host/easgd_train_during_round"] = Spec("host", 1.0, (3, 1), alpha=0.3, train_during_round=True)
    specs["host/overlapped"] = Spec("host", 1.0, (3, 1), train_during_round=True, keep_progress=True)
    specs["host/overlapped_diloco"] = Spec(
        "host", 0.0, (3, 1), outer="diloco", rounds=2, train_during_round=True, keep_progress=True
    )
    specs["device/without_own_copy"] = Spec("device", 1.0, (3, 1), keeps_own=False)
    # Past CAPTURE_AFTER rounds a round weighted on the device is replayed from a CUDA graph (over nccl):
    # each round's weights must still be that round's.
    specs["device/replayed"] = Spec("device", 1.0, (3, 1), rounds=5, step_growth=(0, 2))
    specs["device/replayed_lean"] = Spec("device", 0.5, (3, 1), rounds=5, step_growth=(0, 2), keeps_own=False)
    specs["device/replayed_all_idle"] = Spec("device", 1.0, (0, 0), rounds=4)
    return specs


SCENARIOS = _scenarios()
VIEW_STEPS = (2, 1)


def make_model(rank: int, salt: int) -> nn.Sequential:
    """Distinct per rank from the start (params and BN statistics), so the initial broadcast shows."""
    torch.manual_seed(100 + rank + 1000 * salt)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    bn = model[1]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 1.5)
    bn.num_batches_tracked.fill_(3 + rank)
    return model.to(DEVICE)


@torch.no_grad()
def make_distinct(model: nn.Module, rank: int, salt: int, round_: int) -> None:
    """Give this rank its own params and BN statistics, written in place (through the flat views)."""
    gen = torch.Generator().manual_seed(100 + rank + 1000 * salt + 100_000 * round_)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen))
    bn = model[1]
    bn.running_mean.copy_(torch.randn(4, generator=gen))
    bn.running_var.copy_(torch.rand(4, generator=gen) + 0.5)
    bn.num_batches_tracked.fill_(7 + 10 * rank + round_)


def snapshot(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()},
    }


def outcome_record(outcome: RoundOutcome) -> dict[str, Any]:
    return {
        "steps": outcome.steps,
        "total_steps": outcome.total_steps,
        "skipped": outcome.skipped,
        "divergence": outcome.divergence,
        "payload_bytes": outcome.payload_bytes,
    }


def make_averager(spec: Spec, model: nn.Module, group: dist.ProcessGroup) -> DeviceAverager | HostAverager:
    outer = OuterSettings.resolve(spec.outer, None, None)
    if spec.backend == "host":
        return HostAverager(model, spec.gamma, DEVICE, group, spec.wire, outer)
    averager = DeviceAverager(model, spec.gamma, DEVICE, spec.wire, outer, keeps_own=spec.keeps_own)
    if spec.backend == "chunked":
        averager.reducer.min_chunk_bytes = CHUNK_BYTES
    return averager


def round_scenario(rank: int, salt: int, spec: Spec, group: dist.ProcessGroup) -> dict[str, Any]:
    model = make_model(rank, salt)
    record: dict[str, Any] = {"initial": snapshot(model)}
    averager = make_averager(spec, model, group)
    record["constructed"] = snapshot(model)
    rounds = []
    for round_ in range(spec.rounds):
        make_distinct(model, rank, salt, round_)
        this: dict[str, Any] = {"before": snapshot(model), "evaluated": []}
        averager.begin(spec.steps_in(rank, round_), exact=spec.exact, kept=spec.kept[rank])
        this["after_begin"] = snapshot(model)
        if spec.train_during_round:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(TRAIN_DURING_ROUND * (rank + 1))
        this["current"] = snapshot(model)
        this["outcome"] = outcome_record(averager.finish())
        this["after_finish"] = snapshot(model)
        averager.adopt(
            spec.alpha, lambda this=this: this["evaluated"].append(snapshot(model)), spec.keep_progress
        )
        this["adopted"] = snapshot(model)
        rounds.append(this)
    record["rounds"] = rounds
    averager.release()  # as the worker does before its process group goes
    return record


def views_scenario(rank: int, salt: int) -> dict[str, Any]:
    """Parameters and float32 buffers stay views into the averager's flat buffers through training."""
    model = make_model(rank, salt)
    # Built before the averager: it must keep reaching the (re-pointed) parameters.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = [id(p) for p in model.parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    averager = DeviceAverager(model, 1.0, DEVICE)
    flat = averager.params[0].buffer
    buffers = averager.buffers.buffer if averager.buffers is not None else torch.empty(0)
    flat_before, buf_before = flat.cpu().clone(), buffers.cpu().clone()

    model.train()
    gen = torch.Generator().manual_seed(7 + rank)  # each rank its own batch: the replicas drift apart
    loss = model(torch.randn(8, 5, generator=gen).to(DEVICE)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    params = list(model.parameters())
    f32_buffers = [b for b in model.buffers() if b.dtype == torch.float32]
    record: dict[str, Any] = {
        "n_param_groups": len(averager.params),
        "ids_kept": [id(p) for p in params] == ids,
        "same_objects_as_optimizer": [id(p) for p in optimizer.param_groups[0]["params"]] == ids,
        "shapes_before": shapes,
        "shapes_after": [tuple(p.shape) for p in params],
        "flat_before": flat_before,
        "flat_after_step": flat.cpu().clone(),
        "params_after_step": torch.cat([p.detach().reshape(-1) for p in params]).cpu(),
        "shares_param_storage": [
            p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params
        ],
        "buf_before": buf_before,
        "buf_after_step": buffers.cpu().clone(),
        "buffers_after_step": torch.cat([b.reshape(-1) for b in f32_buffers]).cpu(),
        "shares_buffer_storage": [
            b.untyped_storage().data_ptr() == buffers.untyped_storage().data_ptr() for b in f32_buffers
        ],
        "pre_round": snapshot(model),
    }
    averager.begin(VIEW_STEPS[rank])
    record["outcome"] = outcome_record(averager.finish())
    averager.adopt(None, None)
    record["adopted"] = snapshot(model)
    record["ids_kept_after_round"] = [id(p) for p in model.parameters()] == ids
    return record


def run_all(rank: int) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")  # the host backend's own group, as assembly builds it
    results: dict[str, Any] = {}
    for salt, (name, spec) in enumerate(SCENARIOS.items()):
        results[name] = round_scenario(rank, salt, spec, group)
    results["views"] = views_scenario(rank, salt=999)
    return results


def worker(rank: int, port: int, out_dir: str, backend: str = "gloo") -> None:
    """One spawned rank (torch.multiprocessing.start_processes passes the index first)."""
    global DEVICE
    if backend == "nccl":
        DEVICE = torch.device("cuda", rank)
    join_group(rank, port, WORLD, out_dir, backend)
    leave(run_all(rank), rank, out_dir)

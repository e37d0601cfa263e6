"""A delta wire per shard (docs/sharded-groups.md): 4 gloo ranks as 2 groups of 2, each rank's round sends
its shard's change over the bf16, int8 or int4 wire to the same shard of the other group. What is exact:
each shard index's rounds equal the full model's wire applied to that shard's elements, shard by shard
(each shard quantized in blocks of its own, with its own error feedback and reference), bit for bit; and a
run sends each rank's shard a round, in the wire's bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from flodl.averaging.wire import WIRES, Deltas, Wire
from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_wire_ranks import GAMMA, ROUNDS, STEPS, WORLD, K, change, make_model, worker
from tests.helpers.spawned import run_ranks

pytestmark = pytest.mark.multiproc

GROUPS = WORLD // K


def rows(tensor: Tensor, index: int, pieces: int) -> Tensor:
    """Shard `index` of `pieces` of a tensor as FSDP2 cuts it: ceil(rows / pieces) rows each."""
    per = math.ceil(tensor.shape[0] / pieces)
    return tensor[index * per : (index + 1) * per]


class FullModelWire:
    """The full model's delta wire (the same encoder a replica's round uses) applied to pieces of the models:
    each piece index its own reference (the last consensus), each group's piece its own encoder (its error
    feedback); `pieces` K: the shards, 1: the whole model in one."""

    def __init__(self, wire: Wire, start: list[Tensor], pieces: int) -> None:
        self.pieces = pieces
        self.refs = [self.vector(start, s) for s in range(pieces)]
        self.encoders: list[list[Deltas]] = [[wire.deltas() for _ in range(pieces)] for _ in range(GROUPS)]

    def vector(self, params: list[Tensor], index: int) -> Tensor:
        """Piece `index` of the parameters as one flat vector, in the parameters' order."""
        return torch.cat([rows(p, index, self.pieces).reshape(-1) for p in params])

    def round(self, models: list[list[Tensor]], steps: list[int]) -> None:
        """One round: every group's models take the consensus (weights n^gamma / sum, gamma 1 here)."""
        assert GAMMA == 1.0
        weights = [n / sum(steps) for n in steps]
        for s in range(self.pieces):
            ref = self.refs[s]
            payloads = [
                self.encoders[g][s].encode(self.vector(models[g], s) - ref, weights[g]) for g in range(GROUPS)
            ]
            summed = self.encoders[0][s].sum_gathered(torch.stack(payloads), ref.numel())
            consensus = torch.add(ref, summed)
            self.refs[s] = consensus
            for model in models:
                offset = 0
                for p in model:
                    piece = rows(p, s, self.pieces)
                    piece.copy_(consensus[offset : offset + piece.numel()].view_as(piece))
                    offset += piece.numel()


def full_model_rounds(wire: Wire, pieces: int) -> list[list[list[Tensor]]]:
    """Each round's models of every group, the wire applied to `pieces` of them."""
    start = [p.detach().clone() for p in make_model().parameters()]
    models = [[p.clone() for p in start] for _ in range(GROUPS)]
    applied = FullModelWire(wire, start, pieces)
    rounds = []
    for round_ in range(ROUNDS):
        for g, model in enumerate(models):
            for i, p in enumerate(model):
                p += change(g, round_, i, p.shape)
        applied.round(models, [STEPS[g] + round_ for g in range(GROUPS)])
        rounds.append([[p.clone() for p in model] for model in models])
    return rounds


WIRE_NAMES = ("int8", "int4", "bf16")


@pytest.fixture(scope="module")
def wire_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank's rounds over each wire, from one spawn of the 4 ranks."""
    out = tmp_path_factory.mktemp("wires")
    run_ranks(worker, WORLD, out, WIRE_NAMES)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("wire", WIRE_NAMES)
def test_each_shard_crosses_the_wire_as_the_full_models_wire_applied_shard_by_shard(
    wire_ranks: list[dict], wire: str
) -> None:
    ranks = [saved[wire] for saved in wire_ranks]
    by_shard = full_model_rounds(WIRES[wire], K)
    whole = full_model_rounds(WIRES[wire], 1)
    for round_ in range(ROUNDS):
        for rank in range(WORLD):
            want = by_shard[round_][rank // K]
            got = ranks[rank]["rounds"][round_]
            for p, q in zip(got, want, strict=True):
                assert torch.equal(p, q), (wire, round_, rank)
        # The statement has teeth: the quantized wire over the whole model's blocks is another round (bf16
        # rounds each element alone: the same).
        if wire != "bf16":
            apart = max(
                (p - q).abs().max().item() for p, q in zip(by_shard[round_][0], whole[round_][0], strict=True)
            )
            assert apart > 0
    if wire != "bf16":  # each rank keeps its own shard's error feedback, its shard's size
        for rank in range(WORLD):
            (feedback,) = ranks[rank]["feedback"].values()
            assert feedback.numel() == (6302, 6001)[rank % K] and feedback.abs().max() > 0
            # A checkpoint's feedback resumed: its own shard's as saved, another shard's (other groups) not.
            kept = ranks[rank]["reloaded"]
            assert torch.equal(kept["own"][0], feedback) and kept["other"] == {}


@pytest.mark.parametrize(("policy", "wire"), [("cadence", "quantized_wire=int8"), ("async", "bf16_wire=1")])
def test_a_run_of_groups_sends_each_shard_over_the_wire(tmp_path: Path, policy: str, wire: str) -> None:
    train(
        f"launch.nproc_per_node={WORLD}",
        FAST_START,
        "device=cpu",
        f"policy={policy}",
        f"shard_group={K}",
        wire,
        "batch_size=8",
        "epochs=2",
        "checkpoint_every=null",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=300,
    ).check()
    shard = 13_061  # each rank's half of the digits MLP's 26,122 parameter elements
    sent = WIRES["int8" if "int8" in wire else "bf16"].payload_bytes(shard)
    for record in epochs_of(tmp_path / "run"):
        assert sum(p["batches"] for p in record["per_rank"]) == 1438 // 8 // K * K  # every batch once
        assert record["comm_bytes"] == record["rounds"] * WORLD * sent

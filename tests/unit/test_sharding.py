"""Sharded groups: the key's rules (before any rank) and who forms each group and holds each shard (pure)."""

from __future__ import annotations

import pytest

from flodl.config.policy import PolicyFacts
from flodl.sharding.footprint import TensorBytes, rank_bytes
from flodl.sharding.fsdp import units_of
from flodl.sharding.groups import ShardGroups, shard_numel
from flodl.tasks.digits import DigitsMLP
from flodl.tasks.gpt import GPT
from flodl.worker.rank_state import restore_stepper, stepper_state
from tests.helpers.config_rules import assert_problem, host, make, problems_of
from tests.helpers.digits_stepper import digits_stepper


def test_four_ranks_as_two_groups_of_two() -> None:
    groups = ShardGroups(4, 2)
    assert groups.sharded and groups.count == 2 and groups.mesh_shape == (2, 2)
    assert [groups.members(g) for g in range(2)] == [[0, 1], [2, 3]]
    assert [groups.group_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [groups.shard_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert [groups.sharers(i) for i in range(2)] == [[0, 2], [1, 3]]
    assert groups.words() == "2 group(s) of 2 rank(s): [0, 1] [2, 3]"


@pytest.mark.parametrize(("world", "size"), [(1, 1), (4, 1), (4, 4), (6, 3), (12, 2), (8, 8)])
def test_every_rank_in_one_group_and_one_sharer_set(world: int, size: int) -> None:
    groups = ShardGroups(world, size)
    members = [groups.members(g) for g in range(groups.count)]
    sharers = [groups.sharers(i) for i in range(size)]
    for rows in (members, sharers):
        assert sorted(r for row in rows for r in row) == list(range(world))
    for rank in range(world):
        # The mesh's row and column of a rank are its group and its shard index.
        assert members[groups.group_of(rank)][groups.shard_index(rank)] == rank
        assert sharers[groups.shard_index(rank)][groups.group_of(rank)] == rank
    assert groups.sharded == (size > 1)


def test_many_groups_are_said_in_one_short_line() -> None:
    assert ShardGroups(16, 2).words() == "8 group(s) of 2 rank(s): [0, 1] [2, 3] [4, 5] [6, 7] ... [14..15]"


@pytest.mark.parametrize(("world", "size"), [(4, 3), (4, 0), (2, 4)])
def test_groups_that_do_not_divide_the_world_are_not_formed(world: int, size: int) -> None:
    with pytest.raises(ValueError, match="do not divide"):
        ShardGroups(world, size)


def test_a_shard_holds_the_first_dimension_cut_in_ceil_rows() -> None:
    assert shard_numel((10, 4), 2) == 20
    assert shard_numel((3, 16), 2) == 32  # 2 rows each, the last rank's second padded
    assert shard_numel((7,), 4) == 2
    assert shard_numel((), 4) == 1
    assert shard_numel((5, 3), 1) == 15


def test_the_default_holds_full_replicas_and_passes() -> None:
    assert make().shard_group == 1
    assert problems_of(make(), host(world_size=3, ranks_per_node=3)) == []


def test_sync_shards_on_groups_of_the_world_with_checkpoints_and_a_resume_path() -> None:
    four = host(world_size=4, ranks_per_node=4)
    assert problems_of(make(shard_group=2, checkpoint_every_steps=5, resume="/some/run"), four) == []


def test_groups_must_divide_the_world_and_each_host() -> None:
    four = host(world_size=4, ranks_per_node=4)
    assert_problem(problems_of(make(shard_group=3), four), "shard_group", 3, "must divide the job's 4")
    assert_problem(problems_of(make(shard_group=0), four), "shard_group", 0, "must be >= 1")
    # 2 hosts of 3 ranks: groups of 2 would straddle them.
    straddle = problems_of(make(shard_group=2), host(world_size=6, ranks_per_node=3))
    assert_problem(straddle, "shard_group", 2, "each host's 3 ranks must form whole groups")


def test_async_across_groups_checkpoints_and_resumes() -> None:
    four = host(world_size=4, ranks_per_node=4)
    for checkpoints in ({"checkpoint_every": 1}, {"checkpoint_every_steps": 5}, {"checkpoint_every_s": 60.0}):
        cfg = make(shard_group=2, policy="async", resume="/some/run", **checkpoints)
        assert problems_of(cfg, four) == [], checkpoints


def test_survive_by_groups_runs_under_local_sgd_and_the_rest_is_refused_naming_the_key() -> None:
    four = host(world_size=4, ranks_per_node=4)
    surviving = {
        "shard_group": 2,
        "policy": "cadence",
        "checkpoint_every": None,
        "fault_tolerance": "survive",
    }
    restarts = {"launch.nproc_per_node": 4, "launch.max_restarts": 2, "launch.max_ranks": 6}
    # A group comes back, one more joins; each epoch evaluated (a group's members agree on its round first).
    assert problems_of(make(**surviving, **restarts, eval_every=1), four) == []
    assert problems_of(make(**{**surviving, "policy": "async"}, **restarts, eval_every=1), four) == []
    for key, value, rule in [
        ("launch.max_ranks", 5, "a job grows by whole groups: make it a multiple of shard_group=2"),
    ]:
        problems = problems_of(make(**{**surviving, key: value}), four)
        said = assert_problem(
            problems, key, value, "not with fault_tolerance=survive and shard_group=2 yet ("
        )
        assert rule in said


def test_cadence_across_groups_runs_exact_rounds_on_the_device_with_checkpoints() -> None:
    four = host(world_size=4, ranks_per_node=4)
    assert problems_of(make(shard_group=2, policy="cadence", checkpoint_every=None), four) == []
    diloco = make(shard_group=2, policy="cadence", checkpoint_every=None, outer="diloco")
    assert problems_of(diloco, four) == []  # each rank's outer step on its shard
    # Each group's optimizer state written in shards, and resumed (tests/runs/test_sharded_checkpoints.py).
    saved = make(shard_group=2, policy="cadence", checkpoint_every=1, checkpoint_every_steps=5, resume="/x")
    assert problems_of(saved, four) == []
    # Under survive each group in writes its own (tests/runs/test_sharded_survive_checkpoints.py).
    for policy in ("cadence", "async"):
        surviving = make(shard_group=2, policy=policy, checkpoint_every=1, fault_tolerance="survive")
        assert problems_of(surviving, four) == []


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_local_sgd_across_groups_rounds_on_the_host_thread_on_the_cpu_backend(policy: str) -> None:
    # backend=cpu: 4 ranks sharing one GPU round-robin over gloo (NCCL takes one GPU a rank). A sharded
    # group's rounds per shard index run on the host averager's thread, as full replicas' do, so an async
    # rank trains on while its round is in flight; under survive they run inline on the training thread.
    one_gpu = host(world_size=4, ranks_per_node=4, gpus=1)
    sharded = make(shard_group=2, policy=policy, backend="cpu", checkpoint_every=None)
    assert problems_of(sharded, one_gpu) == []
    facts = PolicyFacts.of(sharded)
    assert (facts.rounds_on_host, facts.trains_during_round) == (True, policy == "async")
    replicas = PolicyFacts.of(make(policy=policy, backend="cpu"))
    assert (replicas.rounds_on_host, replicas.trains_during_round) == (True, policy == "async")
    surviving = PolicyFacts.of(make(shard_group=2, policy=policy, backend="cpu", fault_tolerance="survive"))
    assert (surviving.rounds_on_host, surviving.trains_during_round) == (False, False)
    assert not PolicyFacts.of(make(shard_group=2, backend="cpu")).rounds_on_host  # sync: no rounds


def test_overlapped_rounds_take_groups_on_the_cpu_backend() -> None:
    # Refused before ("a round per shard index runs inline"); backend=nccl's in-place rounds still are.
    overlapped = {"policy": "cadence", "backend": "cpu", "overlap_rounds": True, "checkpoint_every": None}
    two = host(world_size=2, ranks_per_node=2)
    assert problems_of(make(shard_group=2, **overlapped), two) == []
    on_device = problems_of(make(shard_group=2, **{**overlapped, "backend": "nccl"}), two)
    assert_problem(on_device, "overlap_rounds", True, "needs backend=cpu")


@pytest.mark.parametrize("policy", ["cadence", "async"])
@pytest.mark.parametrize(
    ("key", "value"), [("quantized_wire", "int8"), ("quantized_wire", "int4"), ("bf16_wire", True)]
)
def test_local_sgd_across_groups_sends_each_shard_over_any_wire(policy: str, key: str, value: object) -> None:
    cfg = make(shard_group=2, policy=policy, checkpoint_every=None, **{key: value})
    assert problems_of(cfg, host(world_size=4, ranks_per_node=4)) == []


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("bf16_wire", True, "HSDP's gradients travel as float32"),
        ("compile_mode", "reduce-overhead", "CUDA graphs around FSDP2's gathers are not measured"),
        ("compile_mode", "max-autotune", "CUDA graphs around FSDP2's gathers are not measured"),
    ],
)
def test_what_ddp_gives_a_replica_is_refused_with_groups(key: str, value: object, why: str) -> None:
    cfg = make(shard_group=2, compile=True, **{key: value})
    assert why in assert_problem(problems_of(cfg, host(world_size=2, ranks_per_node=2)), key, value, "yet (")
    assert not any("shard_group" in p for p in problems_of(make(compile=True, **{key: value})))


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_groups_take_every_precision(precision: str) -> None:
    # fp16's GradScaler agrees across a group (tests/runs/test_sharded_precision.py), fp8's linears multiply
    # FSDP2's gathered weights (tests/runs/test_gpu_sharded.py).
    cfg = make(shard_group=2, precision=precision)
    assert not any("shard_group" in p for p in problems_of(cfg, host(world_size=2, ranks_per_node=2)))


@pytest.mark.parametrize("mode", ["auto", "default", "max-autotune-no-cudagraphs"])
def test_a_sharded_model_compiles_without_cuda_graphs(mode: str) -> None:
    cfg = make(shard_group=2, compile=True, compile_mode=mode, precision="bf16")
    assert problems_of(cfg, host(world_size=2, ranks_per_node=2)) == []


def test_a_sharded_models_eval_runs_as_many_forwards_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # 359 eval samples among 7 ranks: five shares of 51 and two of 52, in batches of 3: 17 and 18 forwards.
    # A sharded model gathers its parameters inside the group in each forward: every rank must run 18.
    stepper = digits_stepper("batch_size=3")
    forwards: list[int] = []
    stepper.parts.model.register_forward_hook(lambda *_: forwards.append(1))
    plain = [stepper.evaluate(rank, 7, 0, 0, 0, 0) for rank in range(7)]
    assert len(forwards) == 5 * 17 + 2 * 18  # unsharded: each share its own batches only
    monkeypatch.setattr("flodl.worker.stepper.is_sharded", lambda model: True)
    for rank in range(7):
        forwards.clear()
        result = stepper.evaluate(rank, 7, 0, 0, 0, 0)
        assert len(forwards) == 18
        # The padding's forwards are not counted: the share's sums and size as unsharded.
        assert (result.sums, result.count) == (plain[rank].sums, plain[rank].count)
    assert sum(r.count for r in plain) == 359


def test_a_rank_holds_its_shard_of_parameters_gradients_and_optimizer_state() -> None:
    # float32 with Adam's two moments: 16 bytes an element; a bf16 parameter with SGD's float32 momentum: 8.
    adam = TensorBytes((1024, 512), 4, 8)
    momentum = TensorBytes((7, 3), 2, 4)
    assert rank_bytes([adam, momentum], 1) == 1024 * 512 * 16 + 21 * 8
    assert rank_bytes([adam], 2) == rank_bytes([adam], 1) // 2
    assert rank_bytes([adam], 4) == rank_bytes([adam], 1) // 4
    assert rank_bytes([momentum], 2) == 4 * 3 * 8  # ceil(7 / 2) = 4 rows of 3
    assert rank_bytes([TensorBytes((5,), 4, 0)], 8) == 8  # one row each (the last 3 ranks' padding)


def test_a_transformers_blocks_are_units_and_a_tied_weight_stays_with_the_root() -> None:
    model = GPT(layers=3, dim=16, heads=2, context=8, vocab=32)
    assert units_of(model) == [model.blocks[2], model.blocks[1], model.blocks[0]]
    # A block whose weight is tied to a module outside it is gathered with the root, not alone.
    model.blocks[1].attn.proj.weight = model.blocks[0].attn.proj.weight
    assert units_of(model) == [model.blocks[2]]
    # Without a ModuleList the root holds everything.
    assert units_of(DigitsMLP()) == []


def test_a_replicas_checkpoint_is_refused_onto_sharded_groups_naming_shard_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stepper = digits_stepper()
    state = stepper_state(stepper)  # a full replica's: the optimizer's whole state in the part
    monkeypatch.setattr("flodl.worker.rank_state.is_sharded", lambda model: True)
    refusal = "written by full replicas, this run trains sharded groups: resume it with shard_group=1"
    with pytest.raises(ValueError, match=refusal):
        restore_stepper(stepper, state)
    # A sharded run's part holds none (each rank's shard lies in the checkpoint's own files): nothing to
    # load here, into a sharded run or into full replicas.
    restore_stepper(stepper, {**state, "optimizer": None})

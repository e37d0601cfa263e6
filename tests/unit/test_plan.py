"""`plan=true` prints what the run will do: its figures come from the functions the run asks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import COORDINATOR_FILE, MODEL_FILE, CheckpointDir, Point, rank_file
from flodl.config.host import GIB, HostFacts
from flodl.config.policy import collective_backend
from flodl.config.schema import to_config
from flodl.data.feeder import staging_budgets
from flodl.job.settings import data_plane_settings
from flodl.preflight.plan import checkpoints_line, describe, human_bytes, resume_lines, state_fit_problems

DIGITS = {
    "name": "digits",
    "model": {"_target_": "flodl.tasks.digits.DigitsMLP", "hidden": 128},
    "train_data": {"_target_": "flodl.tasks.digits.digits_dataset", "split": "train"},
    "loss": {"_target_": "flodl.tasks.classification.cross_entropy_loss", "_partial_": True},
    "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True},
}
HOST = HostFacts(
    gpus=0,
    ranks_per_node=4,
    world_size=4,
    under_torchrun=True,
    stage_dir_free_bytes=50 * GIB,
    available_ram=64 * GIB,
)


def plan_of(host: HostFacts = HOST, **keys: object) -> str:
    """What plan=true prints for these keys on this host, with the data plane settings launch maps for it."""
    cfg = to_config({"task": DIGITS, **keys})
    return describe(cfg, host, data_plane_settings(cfg, host.ranks_per_node))


def test_plan_ram_budget_is_the_runs_for_the_same_host_facts():
    cfg = to_config({"task": DIGITS, "ram_max_usage": 0.5})
    run = staging_budgets(data_plane_settings(cfg, HOST.ranks_per_node), HOST.available_ram).ram
    assert run == 8 * GIB  # 50% of 64 GiB, shared by the host's 4 ranks
    assert "RAM tier        8.0 GiB per rank = 50% of 64.0 GiB available / 4 rank(s)" in plan_of(
        ram_max_usage=0.5
    )
    # The run caps the fraction at 90%, and so does the plan.
    capped = plan_of(dataclasses.replace(HOST, ranks_per_node=1), ram_max_usage=0.9, sample_cache=True)
    assert "RAM tier        57.6 GiB per rank = 90% of 64.0 GiB" in capped


def test_plan_says_what_the_stager_and_disk_tier_will_do():
    text = plan_of(disk_stage_gb=2.0)
    assert "disk tier       2.0 GiB per rank x 4 rank(s)" in text and "(50.0 GiB free)" in text
    assert "disk tier       off (disk_stage_gb=0)" in plan_of()
    assert "RAM tier        off (sample_cache=false)" in plan_of(sample_cache=False)
    assert "staging         off (debug.stager=false)" in plan_of(debug={"stager": False})
    assert "data plane      off (debug.data_plane=false)" in plan_of(debug={"data_plane": False})
    assert "not in this version" not in text


def test_plan_asks_the_runs_backend_and_averaging():
    assert collective_backend("nccl", "cuda") == "nccl"
    assert collective_backend("nccl", "cpu") == collective_backend("cpu", "cuda") == "gloo"
    assert "collectives: gloo" in plan_of()  # no GPU: gloo, whatever backend says
    assert "per rank per step (DDP gradients)" in plan_of()
    assert "per rank per averaging round" in plan_of(policy="cadence")
    # 26,122 float32 parameters: 52 blocks of 512 int8 values and a float32 scale each; under sync only bf16.
    # int4: 52 blocks of 256 bytes and a scale each.
    int8 = (
        "51.0 KiB with bf16_wire (off), 26.2 KiB with quantized_wire=int8 (on), "
        "13.2 KiB with quantized_wire=int4 (off)"
    )
    assert int8 in plan_of(policy="cadence", quantized_wire="int8")
    assert plan_of().count("_wire") == 1


def test_plan_says_what_a_dead_rank_does_to_the_run():
    assert "faults          a dead rank ends the job; a rank silent for 60 s counts as dead" in plan_of()
    restarts = plan_of(launch={"max_restarts": 2})
    assert "self-launched: every rank restarts, up to 2 time(s)" in restarts
    survive = plan_of(policy="async", fault_tolerance="survive", min_ranks=2, heartbeat_timeout_s=5)
    assert "survive: the others train on without a dead rank (min_ranks=2)" in survive
    assert "is cut the moment it exits; a rank silent for 5 s counts as dead" in survive
    # Unset, the timeout is 10 s under survive (exits are seen at once; it is for a frozen rank), else 60 s.
    assert "silent for 10 s" in plan_of(policy="async", fault_tolerance="survive")
    grows = plan_of(fault_tolerance="survive", launch={"max_ranks": 4})
    assert "up to 4 ranks, more joining with flodl-join RUN_DIR" in grows
    assert "flodl-join" not in survive


def test_plan_says_when_checkpoints_are_taken_and_what_a_stop_does():
    assert "checkpoints     off: a stop or a dead rank ends the run where it is" in plan_of(
        checkpoint_every=None
    )
    assert "checkpoints     every 1 epoch(s), after the last epoch; " in plan_of()  # the default
    steps = plan_of(checkpoint_every=2, checkpoint_every_steps=500)
    assert (
        "checkpoints     every 2 epoch(s), every 500 global steps, inside epochs too, after the last epoch; "
        "written in the background (on a thread of each rank's own); a stop "
        "signal saves at the next step within 20 s, then stops"
    ) in steps
    # The writer the run gets: auto is a thread on this host's CPU ranks, a process on a GPU or when asked.
    gpu_line = checkpoints_line(to_config({"task": DIGITS, "checkpoint_every": 2}), 4, "cuda")
    assert "(by a process of each rank's own)" in gpu_line
    assert "(by a process of each rank's own)" in plan_of(checkpoint_every=2, checkpoint_writer="process")
    timed = plan_of(policy="cadence", checkpoint_every_s=600.0, checkpoint_background=False, stop_grace_s=0.0)
    assert "600 s after the last, at the next round, after the last epoch; written at the boundary" in timed
    assert "600 s after the last, at a step the ranks agree on" in plan_of(checkpoint_every_s=600.0)
    assert "a stop signal stops at once, naming the last checkpoint" in timed
    survive = plan_of(policy="async", fault_tolerance="survive", checkpoint_every_steps=10)
    assert "written at the boundary; a stop signal saves at the next round within 20 s, then stops" in survive
    # 4 ranks with anchor 10: a window is 40 global steps or more; a shorter interval cuts it.
    assert "every 10 global steps, inside epochs too (shorter than ElChe's first window, 40+" in survive
    assert "shorter than" not in plan_of(policy="async", checkpoint_every_steps=40)
    assert "shorter than" not in plan_of(checkpoint_every_steps=10)  # sync: a step is the boundary


def test_plan_warns_when_the_ranks_outnumber_the_cores_they_run_on():
    crowded = plan_of(dataclasses.replace(HOST, cpu_cores=2))
    assert "warning         4 ranks on this host share its 2 CPU core(s)" in crowded
    assert "warning" not in plan_of(dataclasses.replace(HOST, cpu_cores=4))


def test_plan_says_where_a_resume_continues_and_what_a_resize_does(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    for name in (MODEL_FILE, COORDINATOR_FILE, rank_file(0), rank_file(1)):
        store.write_part(Point(2, 96), name, {})
    store.commit(Point(2, 96), world_size=2)
    cfg = to_config({"task": DIGITS, "policy": "cadence"})
    (line,) = resume_lines(cfg, 4, tmp_path)
    assert "training continues inside epoch 3, 96 samples into it" in line
    assert line.endswith(
        "resumed 2 ranks' checkpoint on 4; ranks 2, 3 start with saved rank (r mod 2)'s optimizer state"
    )
    assert resume_lines(cfg, 2, tmp_path)[0].endswith("on the 2 ranks that wrote it")
    assert resume_lines(to_config({"task": DIGITS, "resume": "never"}), 4, tmp_path) == []
    assert resume_lines(cfg, 4, tmp_path / "elsewhere") == []  # a fresh start


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoint's save, in one process
def test_plan_says_which_saved_groups_state_each_group_of_a_regrouped_cadence_run_takes(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    store = CheckpointDir(tmp_path, keep=2)  # 2 groups' own optimizer states, in shards
    dcp.save(
        {"optimizer_groups": torch.tensor(2)}, checkpoint_id=store.partial(Point(1)) / "sharded", no_dist=True
    )
    for name in (COORDINATOR_FILE, *(rank_file(r) for r in range(4))):
        store.write_part(Point(1), name, {})
    store.commit(Point(1), world_size=4)

    def line(world: int, shard_group: int) -> str:
        cfg = to_config({"task": DIGITS, "policy": "cadence", "shard_group": shard_group})
        return resume_lines(cfg, world, tmp_path)[0]

    rule = "a checkpoint of 2 groups resumed as {}: group g takes saved group g mod 2's optimizer state"
    assert line(3, 1).endswith(f"; {rule.format(3)} (each group's is its own)")
    assert line(2, 2).endswith(f"; {rule.format(1)} (each group's is its own); saved group 1's is left")
    assert line(4, 2).endswith("on the 4 ranks that wrote it")  # its own groups


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plan_says_a_group_out_at_a_survive_checkpoint_takes_a_group_ins_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # Under survive each group in saves its own (sharded/group-G/): here group 1 was out, ranks 0 and 1 in.
    store = CheckpointDir(tmp_path, keep=2)
    sharded = store.partial(Point(1)) / "sharded" / "group-0"
    dcp.save({"optimizer_groups": torch.tensor(2)}, checkpoint_id=sharded, no_dist=True)
    for name in (COORDINATOR_FILE, rank_file(0), rank_file(1)):
        store.write_part(Point(1), name, {})
    store.commit(Point(1), world_size=4, ranks=[0, 1])
    cfg = to_config({"task": DIGITS, "policy": "cadence", "shard_group": 2, "fault_tolerance": "survive"})
    assert resume_lines(cfg, 4, tmp_path)[0].endswith(
        "; a checkpoint of groups [0]'s optimizer states (those in) resumed as 2: group 0 takes saved group "
        "0's, group 1 takes saved group 0's"
    )


# DigitsMLP(hidden=128) with Adam: 26,122 float32 parameters, each with its gradient and two moments.
WHOLE = 26_122 * 16
# Sharded over 2 ranks, by rows: 64 of each 128-row tensor, 5 of the output layer's 10.
HALF = (64 * 64 + 64 + 64 * 128 + 64 + 5 * 128 + 5) * 16


def test_plan_says_the_groups_and_the_state_each_rank_holds():
    assert (
        f"rank state      {human_bytes(WHOLE)} of parameters, gradients and optimizer state per rank"
        in plan_of()
    )
    sharded = plan_of(shard_group=2, checkpoint_every=None)
    groups = "sharded groups  2 group(s) of 2 rank(s): [0, 1] [2, 3]; FSDP2 in each"
    assert f"{groups}, gradients all-reduced across (HSDP); per rank {human_bytes(HALF)} (of " in sharded
    cadence = plan_of(shard_group=2, checkpoint_every=None, policy="cadence")
    assert (
        f"{groups}, each shard averaged across in a round per shard index; per rank {human_bytes(HALF)}"
        in cadence
    )
    # SGD without momentum keeps no state: parameters and gradients alone.
    sgd = {**DIGITS, "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}}
    plain = describe(to_config({"task": sgd}), HOST, data_plane_settings(to_config({"task": sgd}), 4))
    assert f"rank state      {human_bytes(26_122 * 8)} of" in plain


def test_a_rank_state_past_its_device_is_refused_naming_the_group_that_fits():
    # 4 ranks on a host whose available RAM gives each one less than a full replica's state, but a half.
    room = HOST.available_ram // 4
    tight = dataclasses.replace(HOST, available_ram=4 * (HALF + WHOLE) // 2)
    cfg = to_config({"task": DIGITS})
    (line,) = state_fit_problems(cfg, tight)
    share = human_bytes(tight.available_ram // 4)
    assert line == (
        f"shard_group=1: each rank would hold {human_bytes(WHOLE)} of parameters, gradients and optimizer "
        f"state, more than its {share} share of this host's available RAM: shard_group=2 fits"
    )
    assert (
        state_fit_problems(to_config({"task": DIGITS, "shard_group": 2, "checkpoint_every": None}), tight)
        == []
    )
    assert state_fit_problems(cfg, HOST) == [] and room > WHOLE
    # No group of this host's ranks makes it fit.
    (none,) = state_fit_problems(cfg, dataclasses.replace(HOST, available_ram=4 * HALF // 8))
    assert none.endswith("no group of this host's ranks makes it fit")


def test_ranks_sharing_a_gpu_each_fit_their_share_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # backend=cpu: 4 ranks round-robin on 1 GPU (2 on each of 2 GPUs alike) hold a quarter of its memory each.
    total = 2 * (HALF + WHOLE)  # a full replica's state fits the whole GPU, not a quarter; a half does
    card = type("Props", (), {"total_memory": total, "name": "Tiny GPU"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    one_gpu = dataclasses.replace(HOST, gpus=1, world_size=4, ranks_per_node=4)
    cfg = to_config({"task": DIGITS, "device": "cuda", "backend": "cpu"})
    (line,) = state_fit_problems(cfg, one_gpu)
    quarter, whole = human_bytes(total // 4), human_bytes(total)
    assert line.endswith(f"its {quarter} share of a Tiny GPU ({whole}, 4 ranks on it): shard_group=2 fits")
    for gpus in (2, 4):  # 2 ranks on a GPU hold half of it each (a full replica fits); 1, all of it
        assert state_fit_problems(cfg, dataclasses.replace(one_gpu, gpus=gpus)) == []

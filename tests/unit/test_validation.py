"""flodl.config.rules: every rule, on typed configs and synthetic host facts."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flodl.config.host import GIB
from flodl.config.policy import compile_mode_for, writes_in_a_process
from flodl.config.rules import LOCAL_SGD_KNOBS, NOT_IMPLEMENTED, ConfigError, validate
from flodl.config.schema import FlodlConfig
from flodl.config.targets import list_target_problems
from flodl.links.group import pick_device
from tests.helpers.config_rules import HOST, assert_problem, host, make, problems_of

INF = float("inf")
NAN = float("nan")
BASE = make()


def test_default_config_passes():
    validate(BASE, HOST)


def test_loader_keys_that_make_no_sense_are_refused():
    problems = problems_of(make(num_workers=2, **{"task.cacheable": True}))
    assert_problem(problems, "num_workers", 2, "task.cacheable=true serves samples from this rank's RAM")
    assert_problem(problems_of(make(prefetch_factor=4)), "prefetch_factor", 4, "applies to num_workers > 0")
    assert problems_of(make(num_workers=2, prefetch_factor=4)) == []
    assert problems_of(BASE) == []


# (key, bad value, fragment of the rule's text)
RANGE_CASES = [
    ("policy", "bogus", "must be one of sync, cadence, async"),
    ("backend", "gloo", "must be one of nccl, cpu"),
    ("device", "gpu", "must be one of auto, cpu, cuda"),
    ("seed", -1, "must be in [0, 4294967295]"),
    ("seed", 2**64 - 1, "must be in [0, 4294967295]"),
    ("epochs", 0, "must be >= 1"),
    ("batch_size", 0, "must be >= 1"),
    ("augment", 0, "must be in [1, 4096]"),
    ("augment", 10**9, "must be in [1, 4096]"),
    ("grad_accum", 0, "must be >= 1 micro-batches per optimizer step"),
    ("precision", "int8", "must be one of fp32, bf16, fp16, fp8"),
    ("precision", "fp8", "float8 training runs on the GPU; use precision=bf16"),
    ("compile_mode", "fastest", "must be one of auto, default, lite, reduce-overhead"),
    ("eval_every", -1, "must be >= 0"),
    ("max_grad_norm", 0.0, "must be a finite value > 0"),
    ("max_grad_norm", -1.0, "must be a finite value > 0"),
    ("max_grad_norm", INF, "must be a finite value > 0"),
    ("lr_scale_ratio", -0.5, "must be finite and >= 0"),
    ("lr_scale_ratio", INF, "must be finite and >= 0"),
    ("gamma", INF, "must be finite"),
    ("gamma", -INF, "must be finite"),
    ("easgd_alpha", 0.0, "must be in (0, 1]"),
    ("easgd_alpha", 1.5, "must be in (0, 1]"),
    ("anchor", 0, "must be >= 1"),
    ("min_anchor", 0, "must be >= 1"),
    ("min_anchor", 2000, "must be <= anchor (10) and max_anchor (1000)"),
    ("max_anchor", 5, "must be >= anchor (10)"),
    ("overhead_target", 0.005, "must be in [0.01, 0.5]"),
    ("overhead_target", 0.6, "must be in [0.01, 0.5]"),
    ("max_batch_diff", -1, "must be >= 0"),
    ("max_overshoot", -1, "must be >= 0"),
    ("divergence_threshold", 0.0, "must be finite and > 0"),
    ("divergence_threshold", INF, "must be finite and > 0"),
    ("vram_max_usage", 1.5, "must be in [0.5, 0.99]"),
    ("vram_max_usage", 0.4, "must be in [0.5, 0.99]"),
    ("ram_max_usage", -0.1, "must be in [0, 0.9]"),
    ("ram_max_usage", 0.95, "must be in [0, 0.9]"),
    ("disk_stage_gb", -1.0, "must be finite and >= 0"),
    ("num_workers", -1, "must be >= 0"),
    ("prefetch_factor", 0, "must be >= 1"),
    ("checkpoint_every", 0, "must be >= 1"),
    ("checkpoint_every_steps", 0, "must be >= 1 (global steps)"),
    ("checkpoint_every_s", 0.0, "must be finite and > 0 (seconds)"),
    ("checkpoint_every_s", INF, "must be finite and > 0 (seconds)"),
    ("stop_grace_s", -1.0, "must be in [0, 30] seconds"),
    ("stop_grace_s", 31.0, "must be in [0, 30] seconds"),
    ("stop_grace_s", INF, "must be in [0, 30] seconds"),
    ("checkpoint_keep", 0, "must be >= 1"),
    ("heartbeat_timeout_s", 0.0, "must be in [1, 604800] seconds"),
    ("heartbeat_timeout_s", 0.001, "must be in [1, 604800] seconds"),
    ("heartbeat_timeout_s", INF, "must be in [1, 604800] seconds"),
    ("on_nonfinite", "ignore", "must be one of error, skip"),
    ("launch.max_restarts", -1, "must be >= 0"),
    ("simulate.nan_at_step", 0, "must be >= 1 (a 1-based step)"),
    ("simulate.hang_at_step", 0, "must be >= 1 (a 1-based step)"),
    ("simulate.nan_rank", 3, "must be a rank of this job, 0..0"),
    ("simulate.hang_rank", -1, "must be a rank of this job, 0..0"),
    ("launch.nproc_per_node", 0, "must be >= 1"),
    ("launch.start_method", "thread", "must be one of spawn, fork, forkserver"),
    ("launch.timeout_s", 0.0, "must be in [10, 604800] seconds"),
    ("launch.timeout_s", 0.000001, "must be in [10, 604800] seconds"),
    ("launch.timeout_s", INF, "must be in [10, 604800] seconds"),
    ("launch.timeout_s", -5.0, "must be in [10, 604800] seconds"),
    ("partition_ratios", [], "must be a non-empty list of finite values > 0"),
    ("partition_ratios", [1.0, -1.0], "must be a non-empty list of finite values > 0"),
    ("partition_ratios", [1.0, 0.0], "must be a non-empty list of finite values > 0"),
    ("partition_ratios", [1.0, INF], "must be a non-empty list of finite values > 0"),
]


@pytest.mark.parametrize(("key", "value", "rule"), RANGE_CASES, ids=[f"{k}={v!r}" for k, v, _ in RANGE_CASES])
def test_range_rule(key, value, rule):
    with pytest.raises(ConfigError) as info:
        validate(make(**{key: value}), HOST)
    assert_problem(info.value.problems, key, value, rule)


def test_range_problem_text_is_key_value_rule():
    problems = problems_of(make(vram_max_usage=1.5))
    assert "vram_max_usage=1.5: must be in [0.5, 0.99]" in problems


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("vram_max_usage", 0.5),
        ("vram_max_usage", 0.99),
        ("ram_max_usage", 0.0),
        ("ram_max_usage", 0.9),
        ("overhead_target", 0.01),
        ("overhead_target", 0.5),
        ("easgd_alpha", 1.0),
        ("max_anchor", 10),
        ("min_anchor", 10),
        ("seed", 0),
        ("eval_every", 0),
        ("epochs", 1),
        ("batch_size", 1),
        ("lr_scale_ratio", 0.0),
        ("max_batch_diff", 0),
        ("max_overshoot", 0),
        ("disk_stage_gb", 0.0),
        ("launch.timeout_s", 10.0),
    ],
)
def test_boundary_values_pass_the_range_rules(key, value):
    # Under policy=async no cross-field rule objects to local SGD knobs; the not-implemented rules
    # may still fire (policy, vram_max_usage, ...), so only the range rules are checked here.
    problems = problems_of(make(policy="async", **{key: value}))
    assert not [p for p in problems if "must be" in p], problems


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_easgd_alpha_needs_async(policy):
    problems = problems_of(make(policy=policy, easgd_alpha=0.5))
    assert_problem(problems, "easgd_alpha", 0.5, f"applies to policy=async only (policy={policy})")


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_max_overshoot_needs_async(policy):
    problems = problems_of(make(policy=policy, max_overshoot=3))
    assert_problem(problems, "max_overshoot", 3, f"applies to policy=async only (policy={policy})")


def test_checkpoints_by_time_under_sync_need_the_fixed_world_and_keep_needs_some_checkpoint_key():
    problems = problems_of(make(policy="sync", fault_tolerance="survive", checkpoint_every_s=600.0))
    assert_problem(problems, "checkpoint_every_s", 600.0, "under policy=sync needs fault_tolerance=none")
    assert "with survive use checkpoint_every_steps" in " ".join(problems)
    for policy in ("sync", "cadence"):
        assert not [
            p for p in problems_of(make(policy=policy, checkpoint_every_s=600.0)) if "checkpoint" in p
        ]
    for key in ("checkpoint_every", "checkpoint_every_steps", "checkpoint_every_s"):
        assert not [
            p for p in problems_of(make(policy="async", checkpoint_keep=5, **{key: 100})) if "keep" in p
        ]
    problem = assert_problem(
        problems_of(make(checkpoint_keep=5, checkpoint_every=None)),
        "checkpoint_keep",
        5,
        "applies to checkpoints",
    )
    assert "checkpoint_every, checkpoint_every_steps or checkpoint_every_s" in problem


def test_a_gpu_rank_writes_its_parts_by_a_process_unless_told_and_a_cpu_rank_on_a_thread():
    assert writes_in_a_process(make(), "cuda") and not writes_in_a_process(make(), "cpu")
    assert not writes_in_a_process(make(checkpoint_writer="thread"), "cuda")
    assert writes_in_a_process(make(checkpoint_writer="process"), "cpu")


def test_checkpoint_writer_is_one_of_its_choices_and_applies_to_parts_written_in_the_background():
    assert_problem(problems_of(make(checkpoint_writer="disk")), "checkpoint_writer", "disk", "must be one of")
    for writer in ("auto", "thread", "process"):
        assert not [p for p in problems_of(make(checkpoint_writer=writer)) if "checkpoint_writer" in p]
    assert_problem(
        problems_of(make(checkpoint_writer="process", checkpoint_background=False)),
        "checkpoint_writer",
        "process",
        "applies to parts written in the background: set checkpoint_background=true",
    )
    assert_problem(
        problems_of(make(policy="cadence", fault_tolerance="survive", checkpoint_writer="thread")),
        "checkpoint_writer",
        "thread",
        "fault_tolerance=survive writes parts at the boundary",
    )


def test_async_takes_easgd_alpha_and_max_overshoot():
    problems = problems_of(make(policy="async", easgd_alpha=0.5, max_overshoot=3))
    assert not [p for p in problems if p.startswith(("easgd_alpha=", "max_overshoot="))], problems


# A non-default value for every local SGD knob.
KNOB_VALUES = {
    "gamma": 0.5,
    "anchor": 20,
    "min_anchor": 2,
    "max_anchor": 500,
    "overhead_target": 0.1,
    "max_batch_diff": 3,
    "max_overshoot": 2,
    "divergence_threshold": 0.5,
    "divergence_guard": "msf",
    "quantized_wire": "int8",
}


def test_knob_table_covers_every_local_sgd_knob():
    assert set(KNOB_VALUES) == set(LOCAL_SGD_KNOBS)
    defaults = {f.name: f.default for f in dataclasses.fields(FlodlConfig)}
    assert all(KNOB_VALUES[k] != defaults[k] for k in KNOB_VALUES)


@pytest.mark.parametrize("knob", LOCAL_SGD_KNOBS)
def test_local_sgd_knob_refused_under_sync(knob):
    value = KNOB_VALUES[knob]
    problems = problems_of(make(policy="sync", **{knob: value}))
    default = getattr(BASE, knob)
    problem = assert_problem(problems, knob, value, "applies to local SGD (policy=cadence or async)")
    assert f"leave it at its default ({default!r})" in problem


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_local_sgd_knobs_accepted_under_local_sgd(policy):
    knobs = dict(KNOB_VALUES)
    if policy == "cadence":
        knobs.pop("max_overshoot")
    knobs.pop("divergence_threshold")  # a trend-guard knob: with the msf guard it is refused (below)
    assert problems_of(make(policy=policy, **knobs)) == []


def test_cuda_without_gpus():
    problems = problems_of(make(device="cuda"), host(gpus=0))
    assert_problem(problems, "device", "cuda", "no CUDA device is visible")


def test_cuda_with_a_gpu_is_fine():
    assert problems_of(make(device="cuda"), host(gpus=1)) == []


def test_nccl_needs_a_gpu_per_rank_and_the_cpu_backend_shares_them():
    problems = problems_of(BASE, host(gpus=1, ranks_per_node=2))
    problem = assert_problem(problems, "backend", "nccl", "NCCL needs one GPU per rank")
    assert "2 ranks on 1 visible GPU(s); set backend=cpu to share the GPUs round-robin" in problem
    assert problems_of(make(backend="cpu"), host(gpus=1, ranks_per_node=4)) == []


def test_ranks_take_the_gpus_round_robin(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert [pick_device("auto", r).index for r in range(5)] == [0, 1, 0, 1, 0]
    assert pick_device("cpu", 3) == torch.device("cpu")


@pytest.mark.parametrize(
    ("overrides", "facts"),
    [
        ({}, {"gpus": 2, "ranks_per_node": 2}),
        ({"device": "cpu"}, {"gpus": 1, "ranks_per_node": 2}),
        # No GPU: NCCL falls back to gloo, any number of ranks.
        ({}, {"gpus": 0, "ranks_per_node": 4}),
    ],
)
def test_nccl_cases_that_pass(overrides, facts):
    assert problems_of(make(**overrides), host(**facts)) == []


def test_nccl_without_gpus_falls_back_to_gloo():
    validate(make(backend="nccl", device="auto"), host(gpus=0, ranks_per_node=8))


def test_nproc_per_node_mismatch_under_torchrun():
    facts = host(under_torchrun=True, ranks_per_node=2)
    problems = problems_of(make(**{"launch.nproc_per_node": 3}), facts)
    problem = assert_problem(problems, "launch.nproc_per_node", 3, "torchrun already started 2 rank(s)")
    assert "--nproc_per_node" in problem


@pytest.mark.parametrize("nproc", [1, 2])
def test_nproc_per_node_matching_torchrun_passes(nproc):
    facts = host(under_torchrun=True, ranks_per_node=2)
    assert problems_of(make(**{"launch.nproc_per_node": nproc}), facts) == []


@pytest.mark.parametrize("nproc", [0, -1])
def test_a_job_of_no_ranks_is_one_problem_not_one_per_simulated_rank(nproc):
    facts = host(ranks_per_node=nproc, world_size=nproc)  # what the host probe makes of it
    problems = problems_of(make(**{"launch.nproc_per_node": nproc}), facts)
    assert problems == [assert_problem(problems, "launch.nproc_per_node", nproc, "must be >= 1")]


def test_nproc_per_node_outside_torchrun_passes():
    assert problems_of(make(**{"launch.nproc_per_node": 3}), host(ranks_per_node=3)) == []


def test_disk_stage_larger_than_free_space():
    problems = problems_of(make(disk_stage_gb=200.0, disk_stage_dir="/stage"))
    problem = assert_problem(problems, "disk_stage_gb", 200.0, "exceeds the 100.0 GiB free in /stage")
    assert "1 rank(s) x 200.0 GiB" in problem


def test_disk_stage_need_scales_with_ranks_per_node():
    cfg = make(disk_stage_gb=60.0, disk_stage_dir="/stage")
    alone = problems_of(cfg, host(ranks_per_node=1))
    assert not [p for p in alone if "exceeds" in p], alone
    problem = assert_problem(problems_of(cfg, host(ranks_per_node=2)), "disk_stage_gb", 60.0, "exceeds")
    assert "2 rank(s) x 60.0 GiB" in problem
    assert "100.0 GiB free" in problem


def test_disk_stage_free_space_reported_in_gib():
    facts = host(stage_dir_free_bytes=int(2.5 * GIB))
    problems = problems_of(make(disk_stage_gb=3.0, disk_stage_dir="/stage"), facts)
    assert_problem(problems, "disk_stage_gb", 3.0, "exceeds the 2.5 GiB free in /stage")


def test_missing_disk_stage_dir():
    facts = host(stage_dir_free_bytes=None)
    problems = problems_of(make(disk_stage_gb=1.0, disk_stage_dir="/no/such/dir"), facts)
    assert_problem(problems, "disk_stage_dir", "/no/such/dir", "is not an existing directory")
    assert not [p for p in problems if "exceeds" in p]


def test_disk_rules_skip_a_disabled_tier():
    assert problems_of(BASE, host(stage_dir_free_bytes=None)) == []
    assert problems_of(BASE, host(stage_dir_free_bytes=0)) == []


def test_disk_stage_dir_without_a_disk_tier_is_refused():
    problems = problems_of(make(disk_stage_dir="/stage"))
    assert_problem(problems, "disk_stage_dir", "/stage", "set disk_stage_gb > 0")


@pytest.mark.parametrize("switch", ["debug.stager", "debug.data_plane"])
def test_disk_tier_beside_a_switched_off_stager_is_refused(switch):
    problems = problems_of(make(disk_stage_gb=1.0, **{switch: False}))
    assert_problem(
        problems, "disk_stage_gb", 1.0, f"the disk tier is part of the stager, which {switch}=false"
    )
    assert problems_of(make(**{switch: False})) == []


def test_data_plane_values_in_range_pass():
    cfg = make(vram_pool=False, vram_max_usage=0.8, ram_max_usage=0.0, sample_cache=False)
    assert problems_of(cfg) == []
    assert problems_of(make(disk_stage_gb=1.0, disk_stage_dir="/stage")) == []


# A value for every not-implemented key that would need the missing feature.
NEEDS_FEATURE = {
    "partition_ratios": [1.0, 2.0],
}


def test_not_implemented_table_covered():
    assert set(NEEDS_FEATURE) == {key for key, _, _ in NOT_IMPLEMENTED}


@pytest.mark.parametrize(
    ("key", "featureless", "why"), NOT_IMPLEMENTED, ids=[k for k, _, _ in NOT_IMPLEMENTED]
)
def test_not_implemented_value_is_refused(key, featureless, why):
    value = NEEDS_FEATURE[key]
    with pytest.raises(ConfigError) as info:
        validate(make(**{key: value}), HOST)
    assert f"{key}={value!r}: {why}" in info.value.problems
    # The featureless value is the default: it raises nothing for this key.
    assert not [p for p in problems_of(make(**{key: featureless})) if p.startswith(f"{key}=")]


def test_all_violations_reported_at_once():
    cfg = make(epochs=0, batch_size=0, vram_max_usage=1.5, easgd_alpha=0.5, device="cuda")
    with pytest.raises(ConfigError) as info:
        validate(cfg, host(gpus=0))
    problems = info.value.problems
    assert len(problems) >= 5
    assert_problem(problems, "epochs", 0, "must be >= 1")
    assert_problem(problems, "batch_size", 0, "must be >= 1")
    assert_problem(problems, "vram_max_usage", 1.5, "must be in [0.5, 0.99]")
    assert_problem(problems, "easgd_alpha", 0.5, "policy=async only")
    assert_problem(problems, "device", "cuda", "no CUDA device")
    for problem in problems:
        assert f"  - {problem}" in str(info.value)


outside_vram_range = st.one_of(
    st.floats(max_value=0.5, exclude_max=True),
    st.floats(min_value=0.99, exclude_min=True),
    st.just(NAN),
)


@given(value=outside_vram_range)
def test_any_vram_max_usage_outside_range_is_named(value):
    problems = problems_of(dataclasses.replace(BASE, vram_max_usage=value))
    assert any(p.startswith(f"vram_max_usage={value!r}: must be in [0.5, 0.99]") for p in problems), problems


@given(value=st.floats(min_value=0.5, max_value=0.99))
def test_any_vram_max_usage_inside_range_passes_the_range_rule(value):
    problems = problems_of(dataclasses.replace(BASE, vram_max_usage=value))
    assert not [p for p in problems if "must be in" in p], problems


@given(gamma=st.floats(allow_nan=False, allow_infinity=False), longest=st.integers(2, 10**6))
def test_gamma_is_refused_exactly_when_a_weight_share_would_leave_the_normal_floats(gamma, longest):
    """Each weight n^gamma (n up to max_anchor + overshoot), their sum over 2 ranks and each share: normal."""
    cfg = dataclasses.replace(BASE, policy="cadence", anchor=1, max_anchor=longest, gamma=gamma)
    refused = any(p.startswith("gamma=") for p in problems_of(cfg, host(world_size=2)))
    exponent = abs(gamma) * math.log(longest) + math.log(2)
    if not refused:  # the extreme share 1 / (2 * longest^|gamma|) is a normal float64
        assert exponent <= -math.log(sys.float_info.min)
    elif exponent < -math.log(sys.float_info.min) * 0.999:
        raise AssertionError(f"gamma={gamma} refused for windows of {longest} steps")


@pytest.mark.parametrize("gamma", [1e308, -1e308])
def test_huge_gammas_are_refused_either_way(gamma):
    problems = problems_of(dataclasses.replace(BASE, policy="cadence", gamma=gamma))
    assert_problem(problems, "gamma", gamma, "outside float64's normal range")


@given(gamma=st.sampled_from([INF, -INF, NAN]))
def test_non_finite_gamma_is_named(gamma):
    problems = problems_of(dataclasses.replace(BASE, policy="cadence", gamma=gamma))
    assert any(p.startswith(f"gamma={gamma!r}: must be finite") for p in problems), problems


@given(epochs=st.integers(-5, 5), batch_size=st.integers(-5, 5), augment=st.integers(-5, 5))
def test_integer_minimums_flag_exactly_the_values_below_one(epochs, batch_size, augment):
    cfg = dataclasses.replace(BASE, epochs=epochs, batch_size=batch_size, augment=augment)
    problems = problems_of(cfg)
    for key, value in (("epochs", epochs), ("batch_size", batch_size), ("augment", augment)):
        flagged = any(p.startswith(f"{key}={value!r}: must be") for p in problems)
        assert flagged == (value < 1)
    assert (problems == []) == (min(epochs, batch_size, augment) >= 1)


def test_nan_values_are_not_mistaken_for_valid():
    for key in ("max_grad_norm", "lr_scale_ratio", "divergence_threshold", "disk_stage_gb"):
        problems = problems_of(dataclasses.replace(BASE, policy="async", **{key: NAN}))
        assert any(p.startswith(f"{key}=nan: must be") for p in problems), (key, problems)


def test_fork_with_cuda_is_refused():
    gpu_host = host(gpus=2)
    problems = problems_of(make(**{"launch.start_method": "fork"}), gpu_host)
    assert_problem(problems, "launch.start_method", "fork", "CUDA cannot be used in forked ranks")
    # device=cpu too: torch's optimizers still ask CUDA in the forked rank
    assert_problem(
        problems_of(make(**{"launch.start_method": "fork", "device": "cpu"}), gpu_host),
        "launch.start_method",
        "fork",
        "this host has a GPU",
    )
    assert problems_of(make(**{"launch.start_method": "fork"}), HOST) == []


def test_simulate_rules():
    problems = problems_of(make(**{"simulate.slow_rank": 2, "simulate.factor": 0.5}), host(world_size=2))
    assert_problem(problems, "simulate.slow_rank", 2, "must be a rank of this job, 0..1")
    assert_problem(problems, "simulate.factor", 0.5, "must be in [1, 1000]")
    lone = problems_of(make(**{"simulate.factor": 3.0}))
    assert_problem(lone, "simulate.factor", 3.0, "slows simulate.slow_rank, which is not set")
    assert problems_of(make(**{"simulate.slow_rank": 1, "simulate.factor": 3.0}), host(world_size=2)) == []


def test_divergence_threshold_belongs_to_the_trend_guard():
    problems = problems_of(make(policy="cadence", divergence_guard="msf", divergence_threshold=0.1))
    assert_problem(problems, "divergence_threshold", 0.1, "applies to divergence_guard=trend")
    problems = problems_of(make(policy="cadence", divergence_guard="none", divergence_threshold=0.1))
    assert_problem(problems, "divergence_threshold", 0.1, "no guard reads it")
    assert problems_of(make(policy="cadence", divergence_guard="none")) == []
    assert problems_of(make(policy="cadence", divergence_threshold=0.1)) == []
    assert_problem(problems_of(make(divergence_guard="bogus")), "divergence_guard", "bogus", "must be one of")


def test_one_wire_at_a_time():
    both = problems_of(make(policy="cadence", bf16_wire=True, quantized_wire="int4"))
    assert_problem(both, "quantized_wire", "int4", "one wire at a time: set bf16_wire=false")
    assert problems_of(make(policy="cadence", quantized_wire="int8")) == []
    assert_problem(
        problems_of(make(policy="cadence", quantized_wire="int2")),
        "quantized_wire",
        "int2",
        "must be one of int8, int4 or null",
    )
    assert problems_of(make(policy="sync", bf16_wire=True)) == []


def test_outer_optimizer_rules():
    assert_problem(problems_of(make(outer="diloco")), "outer", "diloco", "use policy=cadence or async")
    assert_problem(problems_of(make(outer="adam")), "outer", "adam", "must be one of avg, slowmo, diloco")
    problems = problems_of(make(policy="cadence", outer_lr=0.5, outer_momentum=0.5, outer_reset_inner=False))
    assert_problem(problems, "outer_lr", 0.5, "applies to outer=slowmo or diloco")
    assert_problem(problems, "outer_reset_inner", False, "applies to outer=slowmo or diloco")
    assert_problem(problems, "outer_momentum", 0.5, "applies to outer=slowmo or diloco")
    bad = problems_of(make(policy="async", outer="slowmo", outer_lr=-1.0, outer_momentum=1.0))
    assert_problem(bad, "outer_lr", -1.0, "must be finite and > 0")
    assert_problem(bad, "outer_momentum", 1.0, "must be in [0, 1)")
    assert problems_of(make(policy="async", outer="diloco", outer_lr=0.5, outer_momentum=0.8)) == []
    nesterov = problems_of(make(policy="async", outer="diloco", outer_momentum=0.0))
    assert_problem(nesterov, "outer_momentum", 0.0, "needs a momentum > 0")
    assert problems_of(make(policy="async", outer="slowmo", outer_momentum=0.0)) == []


def test_logger_rules():
    assert_problem(
        problems_of(make(**{"logger.name": "tensorboard"})), "logger.name", "tensorboard", "must be one of"
    )
    assert_problem(problems_of(make(**{"logger.mode": "cloud"})), "logger.mode", "cloud", "must be one of")
    assert_problem(problems_of(make(**{"logger.log_every": -1})), "logger.log_every", -1, "must be >= 0")
    assert problems_of(make(**{"logger.name": "wandb", "logger.mode": "offline"})) == []


def test_on_nonfinite_skip_needs_windows_to_drop():
    sync_ddp = problems_of(make(on_nonfinite="skip"))
    assert_problem(sync_ddp, "on_nonfinite", "skip", "mixes every step's gradients (DDP)")
    assert problems_of(make(on_nonfinite="skip", policy="cadence")) == []
    # Sync is DDP on the cpu backend too.
    assert_problem(problems_of(make(on_nonfinite="skip", backend="cpu")), "on_nonfinite", "skip", "DDP")


def test_restarts_under_torchrun_are_torchruns_to_count():
    facts = host(under_torchrun=True)
    assert_problem(
        problems_of(make(**{"launch.max_restarts": 2}), facts), "launch.max_restarts", 2, "--max-restarts"
    )
    alone = problems_of(make(**{"launch.max_restarts": 2}))
    assert_problem(alone, "launch.max_restarts", 2, "one in-process rank is never restarted")
    assert (
        problems_of(make(**{"launch.max_restarts": 2, "launch.nproc_per_node": 2}), host(world_size=2)) == []
    )
    # A rank started apart (RANK set, no torchrun agent) under survive is restarted by its own command, and
    # flodl-coordinator (WORLD_SIZE ranks apart, no RANK) takes the ranks' overrides.
    survive = make(**{"launch.max_restarts": 2, "fault_tolerance": "survive"})
    assert problems_of(survive, host(under_torchrun=True, world_size=3, ranks_per_node=1)) == []
    assert problems_of(survive, host(world_size=3, ranks_per_node=1)) == []
    agent = host(under_torchrun=True, elastic_agent=True, world_size=3, ranks_per_node=1)
    assert_problem(problems_of(survive, agent), "launch.max_restarts", 2, "--max-restarts")


def test_fp16_needs_cuda_and_says_to_use_bf16():
    gpu = host(gpus=1)
    for cfg, facts in ((make(precision="fp16"), HOST), (make(precision="fp16", device="cpu"), gpu)):
        assert_problem(problems_of(cfg, facts), "precision", "fp16", "use precision=bf16 on CPU")
    assert problems_of(make(precision="fp16"), gpu) == []  # device=auto takes the GPU
    assert problems_of(make(precision="bf16")) == []  # bf16 autocast runs on CPU


def test_fp8_needs_gpus_with_float8_matmuls_and_names_what_is_missing():
    hopper = host(gpus=1, gpu_capability=(9, 0), float8_matmul=True)
    assert problems_of(make(precision="fp8"), hopper) == []
    assert_problem(
        problems_of(make(precision="fp8", device="cpu"), hopper), "precision", "fp8", "runs on the GPU"
    )
    ampere = dataclasses.replace(hopper, gpu_capability=(8, 0))
    problem = assert_problem(
        problems_of(make(precision="fp8"), ampere), "precision", "fp8", "capability 8.9+"
    )
    assert "this host's lowest is 8.0" in problem
    old_torch = dataclasses.replace(hopper, float8_matmul=False)
    assert_problem(problems_of(make(precision="fp8"), old_torch), "precision", "fp8", "upgrade torch")


def test_compile_mode_needs_compile():
    problem = assert_problem(
        problems_of(make(compile_mode="max-autotune")), "compile_mode", "max-autotune", "set compile=true"
    )
    assert "applies to compile=true" in problem
    assert problems_of(make(compile_mode="max-autotune", compile=True)) == []


FIX = "fix the dotted path, or make its module importable from the run's directory (PYTHONPATH)"


def test_callback_targets_are_imported_and_each_bad_one_named_with_its_key() -> None:
    nodes = [
        {"_target_": "flodl.callbacks.BestModel", "mode": "max"},
        {"_target_": "flodl.callbacks.BestModle"},
        {"_target_": "no_such_package.Callback"},
        "flodl.callbacks.EarlyStopping",
    ]
    assert list(list_target_problems("callbacks", nodes)) == [
        "callbacks[1]._target_='flodl.callbacks.BestModle': does not import "
        "(AttributeError: module 'flodl.callbacks' has no attribute 'BestModle'); " + FIX,
        "callbacks[2]._target_='no_such_package.Callback': does not import "
        "(ModuleNotFoundError: No module named 'no_such_package'); " + FIX,
        "callbacks[3]='flodl.callbacks.EarlyStopping': must be a mapping with a _target_ "
        "(e.g. {_target_: mypkg.MyCallback})",
    ]


def test_a_missing_import_inside_a_found_module_is_reported_as_such(tmp_path, monkeypatch) -> None:
    (tmp_path / "user_callbacks.py").write_text("import not_installed_dependency\nclass Cb: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (problem,) = list_target_problems("callbacks", [{"_target_": "user_callbacks.Cb"}])
    assert "(ModuleNotFoundError: No module named 'not_installed_dependency');" in problem


def test_survive_takes_every_policy_outer_optimizer_and_wire():
    three = host(world_size=3, ranks_per_node=3)
    assert problems_of(make(fault_tolerance="survive", policy="cadence", min_ranks=2), three) == []
    assert problems_of(make(fault_tolerance="survive", policy="async"), three) == []
    assert problems_of(make(fault_tolerance="survive", policy="sync"), three) == []
    diloco = make(fault_tolerance="survive", policy="cadence", outer="diloco", bf16_wire=True)
    assert problems_of(diloco, three) == []
    assert problems_of(make(fault_tolerance="survive", policy="async", quantized_wire="int8"), three) == []
    too_many = problems_of(make(fault_tolerance="survive", policy="cadence", min_ranks=4), three)
    assert_problem(too_many, "min_ranks", 4, "must be in [1, 3]")
    assert_problem(
        problems_of(make(min_ranks=2), three), "min_ranks", 2, "applies to fault_tolerance=survive"
    )
    assert_problem(
        problems_of(make(fault_tolerance="maybe"), three), "fault_tolerance", "maybe", "must be one of"
    )


def test_a_job_grows_only_under_survive_and_never_below_its_start():
    three = host(world_size=3, ranks_per_node=3)
    grows = make(**{"fault_tolerance": "survive", "policy": "sync", "launch.max_ranks": 5})
    assert problems_of(grows, three) == []
    fixed = make(**{"launch.max_ranks": 5})
    assert_problem(problems_of(fixed, three), "launch.max_ranks", 5, "applies to fault_tolerance=survive")
    below = make(**{"fault_tolerance": "survive", "launch.max_ranks": 2})
    assert_problem(
        problems_of(below, three), "launch.max_ranks", 2, "at least the 3 rank(s) the job starts with"
    )
    zero = make(**{"fault_tolerance": "survive", "launch.max_ranks": 0})
    assert_problem(problems_of(zero, three), "launch.max_ranks", 0, "must be >= 1")


def test_overlapped_rounds_take_cadence_on_the_cpu_backend_with_any_wire_and_outer_optimizer():
    for extra in ({}, {"outer": "diloco"}, {"quantized_wire": "int8"}, {"checkpoint_every_steps": 50}):
        assert problems_of(make(overlap_rounds=True, policy="cadence", backend="cpu", **extra)) == []
    for policy, why in (("sync", "DDP overlaps them already"), ("async", "overshoot is known only")):
        problem = assert_problem(
            problems_of(make(overlap_rounds=True, policy=policy, backend="cpu")),
            "overlap_rounds",
            True,
            "applies to policy=cadence",
        )
        assert why in problem
    device = problems_of(make(overlap_rounds=True, policy="cadence"))
    assert "not overlapped yet" in assert_problem(device, "overlap_rounds", True, "needs backend=cpu")
    two = host(world_size=2, ranks_per_node=2)
    survive = make(overlap_rounds=True, policy="cadence", backend="cpu", fault_tolerance="survive")
    assert_problem(problems_of(survive, two), "overlap_rounds", True, "not with fault_tolerance=survive")


def test_survive_refuses_torchrun_s_agent():
    survive = make(fault_tolerance="survive", policy="cadence")
    agent = host(world_size=2, ranks_per_node=2, under_torchrun=True, elastic_agent=True)
    problem = assert_problem(problems_of(survive, agent), "fault_tolerance", "survive", "not under torchrun")
    assert "start flodl-coordinator and then each rank on its own" in problem
    assert problems_of(survive, dataclasses.replace(agent, ranks_per_node=1))  # one rank per torchrun too
    # Ranks started one by one (RANK / WORLD_SIZE set, no agent), beside flodl-coordinator: allowed.
    assert problems_of(survive, dataclasses.replace(agent, elastic_agent=False)) == []


@pytest.mark.parametrize(
    ("overrides", "device", "world", "mode"),
    [
        ({"compile": False}, "cuda", 1, None),
        ({"compile": True}, "cpu", 2, "default"),  # CUDA graphs need CUDA
        ({"compile": True}, "cuda", 1, "reduce-overhead"),
        ({"compile": True, "policy": "cadence"}, "cuda", 4, "reduce-overhead"),
        ({"compile": True, "policy": "sync", "backend": "cpu"}, "cuda", 2, "reduce-overhead"),
        ({"compile": True, "policy": "sync"}, "cuda", 2, "default"),  # over NCCL: not measured yet
        ({"compile": True, "policy": "cadence", "shard_group": 2}, "cuda", 4, "default"),  # FSDP2: neither
        ({"compile": True, "compile_mode": "max-autotune"}, "cpu", 1, "max-autotune"),  # asked for: kept
    ],
)
def test_compile_mode_auto_takes_cuda_graphs_where_they_are_measured_safe(overrides, device, world, mode):
    assert compile_mode_for(make(**overrides), device, world) == mode

"""Hydra composition of conf/ against the typed schema (flodl/config/schema.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_object

from flodl.config.host import HostFacts
from flodl.config.rules import validate
from flodl.config.schema import (
    FlodlConfig,
    LaunchConfig,
    LoggerConfig,
    TaskConfig,
    register_configs,
    to_config,
)
from flodl.launcher.run_dir import register_resolvers
from tests.helpers.procs import CONF

# conf/hydra/ holds launcher options for Hydra's own groups, not flodl's; conf/ is a package (__pycache__).
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__"))
GROUP_OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF / group).glob("*.yaml"))]
# Groups whose chosen option is recorded in the composed config, and where.
SELECTED_AS = {
    "policy": lambda cfg: cfg.policy,
    "backend": lambda cfg: cfg.backend,
    "task": lambda cfg: cfg.task.name,
    "logger": lambda cfg: cfg.logger.name,
}
NESTED = {"task", "logger", "launch", "simulate", "debug"}
GROUP_KEYS = {"policy", "backend"}

# One command-line override per top-level schema key (groups aside): (override, field, value, type).
OVERRIDES = [
    ("device=cpu", "device", "cpu", str),
    ("seed=7", "seed", 7, int),
    ("epochs=3", "epochs", 3, int),
    ("steps_per_epoch=100", "steps_per_epoch", 100, int),
    ("batch_size=64", "batch_size", 64, int),
    ("augment=2", "augment", 2, int),
    ("grad_accum=4", "grad_accum", 4, int),
    ("precision=bf16", "precision", "bf16", str),
    ("compile=true", "compile", True, bool),
    ("compile_mode=max-autotune", "compile_mode", "max-autotune", str),
    ("peak_tflops=989", "peak_tflops", 989.0, float),
    ("max_grad_norm=1.0", "max_grad_norm", 1.0, float),
    ("lr_scale_ratio=0.25", "lr_scale_ratio", 0.25, float),
    ("keep_global_batch=true", "keep_global_batch", True, bool),
    ("shard_group=2", "shard_group", 2, int),
    ("eval_every=2", "eval_every", 2, int),
    ("gamma=0.5", "gamma", 0.5, float),
    ("bf16_wire=true", "bf16_wire", True, bool),
    ("quantized_wire=int4", "quantized_wire", "int4", str),
    ("easgd_alpha=0.3", "easgd_alpha", 0.3, float),
    ("anchor=20", "anchor", 20, int),
    ("min_anchor=2", "min_anchor", 2, int),
    ("max_anchor=500", "max_anchor", 500, int),
    ("overhead_target=0.1", "overhead_target", 0.1, float),
    ("max_batch_diff=4", "max_batch_diff", 4, int),
    ("max_overshoot=5", "max_overshoot", 5, int),
    ("divergence_threshold=0.2", "divergence_threshold", 0.2, float),
    ("divergence_guard=msf", "divergence_guard", "msf", str),
    ("outer=diloco", "outer", "diloco", str),
    ("plan=true", "plan", True, bool),
    ("objective=eval/accuracy", "objective", "eval/accuracy", str),
    ("outer_lr=0.5", "outer_lr", 0.5, float),
    ("outer_reset_inner=false", "outer_reset_inner", False, bool),
    ("overlap_rounds=true", "overlap_rounds", True, bool),
    ("outer_momentum=0.8", "outer_momentum", 0.8, float),
    ("partition_ratios=[1,2]", "partition_ratios", [1.0, 2.0], list),
    ("vram_pool=false", "vram_pool", False, bool),
    ("vram_max_usage=0.8", "vram_max_usage", 0.8, float),
    ("ram_max_usage=0.3", "ram_max_usage", 0.3, float),
    ("sample_cache=false", "sample_cache", False, bool),
    ("disk_stage_gb=8", "disk_stage_gb", 8.0, float),
    ("disk_stage_dir=/tmp", "disk_stage_dir", "/tmp", str),
    ("num_workers=2", "num_workers", 2, int),
    ("prefetch_factor=4", "prefetch_factor", 4, int),
    ("persistent_workers=false", "persistent_workers", False, bool),
    ("pin_memory=false", "pin_memory", False, bool),
    ("checkpoint_every=2", "checkpoint_every", 2, int),
    ("checkpoint_every_steps=500", "checkpoint_every_steps", 500, int),
    ("checkpoint_every_s=1800", "checkpoint_every_s", 1800.0, float),
    ("stop_grace_s=25", "stop_grace_s", 25.0, float),
    ("checkpoint_background=false", "checkpoint_background", False, bool),
    ("checkpoint_writer=thread", "checkpoint_writer", "thread", str),
    ("save_path=/tmp/ckpts", "save_path", "/tmp/ckpts", str),
    ("checkpoint_keep=5", "checkpoint_keep", 5, int),
    ("resume=never", "resume", "never", str),
    ("heartbeat_timeout_s=20", "heartbeat_timeout_s", 20.0, float),
    ("on_nonfinite=skip", "on_nonfinite", "skip", str),
    ("fault_tolerance=survive", "fault_tolerance", "survive", str),
    ("min_ranks=2", "min_ranks", 2, int),
    (
        "callbacks=[{_target_:flodl.callbacks.EarlyStopping,monitor:eval/accuracy,mode:max}]",
        "callbacks",
        [{"_target_": "flodl.callbacks.EarlyStopping", "monitor": "eval/accuracy", "mode": "max"}],
        list,
    ),
]
NESTED_OVERRIDES = [
    ("launch.nproc_per_node=2", "nproc_per_node", 2, int),
    ("launch.start_method=fork", "start_method", "fork", str),
    ("launch.timeout_s=30", "timeout_s", 30.0, float),
    ("launch.max_restarts=2", "max_restarts", 2, int),
    ("launch.max_ranks=4", "max_ranks", 4, int),
    ("launch.spare=false", "spare", False, bool),
]


@pytest.fixture(scope="module")
def hydra_compose():
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda *overrides: compose(config_name="config", overrides=list(overrides))


def test_option_discovery_finds_the_shipped_options():
    found = {group: {option for g, option in GROUP_OPTIONS if g == group} for group in GROUPS}
    assert set(GROUPS) == {"policy", "backend", "task", "logger", "launch"}
    assert {"sync", "cadence", "async"} <= found["policy"]
    assert {"nccl", "cpu"} <= found["backend"]
    assert "digits" in found["task"]
    assert {"console", "wandb"} <= found["logger"]
    assert "default" in found["launch"]


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_to_the_typed_config(hydra_compose, group, option):
    cfg = to_config(hydra_compose(f"{group}={option}"))
    assert isinstance(cfg, FlodlConfig)
    assert isinstance(cfg.task, TaskConfig)
    assert isinstance(cfg.logger, LoggerConfig)
    assert isinstance(cfg.launch, LaunchConfig)
    if group in SELECTED_AS:
        assert SELECTED_AS[group](cfg) == option


def test_async_with_disk_stage_override(hydra_compose):
    cfg = to_config(hydra_compose("policy=async", "disk_stage_gb=8"))
    assert cfg.policy == "async"
    assert cfg.disk_stage_gb == 8
    assert isinstance(cfg.disk_stage_gb, float)
    assert cfg.easgd_alpha == 0.5


def test_async_preset_can_be_overridden_and_nulled(hydra_compose):
    assert to_config(hydra_compose("policy=async", "easgd_alpha=0.2")).easgd_alpha == 0.2
    assert to_config(hydra_compose("policy=async", "easgd_alpha=null")).easgd_alpha is None


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_non_async_policies_leave_easgd_alpha_unset(hydra_compose, policy):
    cfg = to_config(hydra_compose(f"policy={policy}"))
    assert cfg.policy == policy
    assert cfg.easgd_alpha is None


def test_override_table_covers_every_top_level_schema_key():
    scalar_fields = {f.name for f in dataclasses.fields(FlodlConfig)} - NESTED - GROUP_KEYS
    assert {field for _, field, _, _ in OVERRIDES} == scalar_fields
    assert {field for _, field, _, _ in NESTED_OVERRIDES} == {
        f.name for f in dataclasses.fields(LaunchConfig)
    }


@pytest.fixture(scope="module")
def default_cfg(hydra_compose):
    return to_config(hydra_compose())


@pytest.fixture(scope="module")
def overridden_cfg(hydra_compose):
    """One composition carrying every override of the tables at once (composition is the slow part)."""
    return to_config(hydra_compose(*(o[0] for o in OVERRIDES), *(o[0] for o in NESTED_OVERRIDES)))


@pytest.mark.parametrize(("override", "field", "value", "kind"), OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_top_level_key_overrides_from_the_command_line(
    default_cfg, overridden_cfg, override, field, value, kind
):
    assert getattr(default_cfg, field) != value, "pick an override value that differs from the default"
    assert getattr(overridden_cfg, field) == value
    assert type(getattr(overridden_cfg, field)) is kind
    if field == "partition_ratios":
        assert all(type(v) is float for v in getattr(overridden_cfg, field))


@pytest.mark.parametrize(
    ("override", "field", "value", "kind"), NESTED_OVERRIDES, ids=[o[0] for o in NESTED_OVERRIDES]
)
def test_launch_keys_override_from_the_command_line(
    default_cfg, overridden_cfg, override, field, value, kind
):
    assert getattr(default_cfg.launch, field) != value
    assert getattr(overridden_cfg.launch, field) == value
    assert type(getattr(overridden_cfg.launch, field)) is kind


def test_single_override_changes_only_its_key(hydra_compose, default_cfg):
    cfg = to_config(hydra_compose("gamma=0.5"))
    assert cfg.gamma == 0.5
    assert dataclasses.replace(cfg, gamma=default_cfg.gamma) == default_cfg


def test_group_keys_select_their_option(hydra_compose):
    cfg = to_config(hydra_compose("policy=cadence", "backend=cpu", "logger=wandb"))
    assert (cfg.policy, cfg.backend, cfg.logger.name) == ("cadence", "cpu", "wandb")


@pytest.mark.parametrize(
    ("override", "key"),
    [("batch_size=abc", "batch_size"), ("bf16_wire=maybe", "bf16_wire"), ("gamma=fast", "gamma")],
)
def test_wrong_type_fails_at_composition_naming_the_key(hydra_compose, override, key):
    with pytest.raises(ConfigCompositionException) as info:
        hydra_compose(override)
    chain = f"{info.value}\n{info.value.__cause__}"
    assert key in chain


def test_unknown_key_is_refused(hydra_compose):
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        hydra_compose("no_such_key=1")


def test_default_composition_is_the_digits_task(hydra_compose):
    raw = hydra_compose()
    cfg = to_config(raw)
    assert (cfg.policy, cfg.backend, cfg.logger.name) == ("sync", "nccl", "console")
    assert cfg.task.name == "digits"
    assert cfg.easgd_alpha is None
    for key in ("model", "train_data", "eval_data", "loss", "eval_fn", "optimizer"):
        node = raw.task[key]
        assert "_target_" in node, key
        assert callable(get_object(node["_target_"])), key
    for key in ("loss", "eval_fn", "optimizer"):
        assert raw.task[key]["_partial_"] is True, key
    assert raw.task.train_data.split == "train"
    assert raw.task.eval_data.split == "test"


def test_default_composition_passes_validation(default_cfg):
    cfg = default_cfg
    host = HostFacts(
        gpus=0,
        ranks_per_node=1,
        world_size=1,
        under_torchrun=False,
        stage_dir_free_bytes=100 << 30,
        available_ram=64 << 30,
    )
    validate(cfg, host)


def test_debug_switches_override_from_the_command_line(hydra_compose):
    default = to_config(hydra_compose()).debug
    assert (default.stager, default.data_plane, default.check_purity) == (True, True, False)
    cfg = to_config(hydra_compose("debug.stager=false", "debug.data_plane=false", "debug.check_purity=true"))
    assert (cfg.debug.stager, cfg.debug.data_plane, cfg.debug.check_purity) == (False, False, True)


def test_simulate_knobs_override_from_the_command_line(hydra_compose):
    cfg = to_config(hydra_compose("simulate.slow_rank=1", "simulate.factor=1.5"))
    assert (cfg.simulate.slow_rank, cfg.simulate.factor) == (1, 1.5)
    assert to_config(hydra_compose()).simulate.slow_rank is None


def test_task_entries_take_new_arguments_from_the_command_line(hydra_compose):
    # A model argument the task's yaml leaves at its default is added as plainly as one it names is changed.
    cfg = hydra_compose("task.model.dropout=0.1", "task.model.hidden=16", "+task.optimizer.weight_decay=0.01")
    assert (cfg.task.model.dropout, cfg.task.model.hidden, cfg.task.optimizer.weight_decay) == (0.1, 16, 0.01)


@pytest.mark.parametrize("typo", ["task.modle=1", "epochz=1", "launch.nproc=2"])
def test_the_task_and_every_other_node_stay_closed_to_typos(hydra_compose, typo):
    with pytest.raises(ConfigCompositionException):
        hydra_compose(typo)

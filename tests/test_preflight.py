"""Every config a rank could not run is refused before one starts: a table of invalid configs.

The table runs in process: each config is composed with Hydra's compose API and handed to `preflight`, the
function the CLI's Hydra callback calls (Hydra's own rejections are worded by `hydra_problem`, as the CLI
words them). A few go through the real CLI to show exit code 2, one line per problem, no traceback, no dir.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from flodl.checkpoints.disk import MANIFEST_FILE
from flodl.config.rules import ConfigError
from flodl.config.schema import register_configs
from flodl.launcher.launch import hydra_problem
from flodl.launcher.run_dir import register_resolvers
from flodl.preflight.checks import omegaconf_problem, preflight
from tests.helpers.byo_data import write_point_shards
from tests.helpers.procs import CONF, train

FILE = "{file}"  # an existing regular file: nothing can be created under it
# The training data as a stream (an IterableDataset).
STREAM = ("task.train_data._target_=tests.helpers.bad_tasks.stream", "~task.train_data.split")

# (overrides, the key the rejection must name)
INVALID: list[tuple[tuple[str, ...], str]] = [
    # Hydra's own rejections: unknown keys, bad values, missing options, bad syntax
    (("+foo=1",), "foo"),
    (("+simulate.bogus=1",), "simulate.bogus"),
    (("logger=wandb", "+logger.bogus=1"), "logger.bogus"),
    (("foo=1",), "foo"),
    (("task.model.bogus=1",), "task.model"),
    (("policy=nope",), "policy"),
    (("task=nope",), "task"),
    (("logger=nope",), "logger"),
    (("backend=gloo",), "backend"),
    (("seed=abc",), "seed"),
    (("epochs=ten",), "epochs"),
    (("batch_size=1.5",), "batch_size"),
    (("seed=[1",), "override"),
    # the task's targets: importable, their arguments bound, the model with something to train
    (("task.model=5",), "task.model"),
    (("task.model._target_=nope.Model",), "task.model._target_"),
    (("task.eval_fn._target_=flodl.tasks.classification.nope",), "task.eval_fn._target_"),
    (("+task.model.width={_target_:torch.nn.Linear,in_featurez:3}",), "task.model.width"),
    (("+task.model.bogus=1",), "task.model"),
    (("+task.optimizer.betaz=1",), "task.optimizer"),
    (("+task.train_data.nope=1",), "task.train_data"),
    (("+task.loss.nope=1",), "task.loss"),
    (
        ("task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_sizee:4}",),
        "task.scheduler",
    ),
    (("task.model.hidden=0",), "task.model"),
    (("task.optimizer.lr=0",), "task.optimizer.lr"),
    (("task.optimizer.lr=-0.1",), "task.optimizer.lr"),
    # numeric bounds from what the run will do
    (("seed=18446744073709551615",), "seed"),
    (("seed=-1",), "seed"),
    (("launch.timeout_s=inf",), "launch.timeout_s"),
    (("launch.timeout_s=0",), "launch.timeout_s"),
    (("simulate.slow_rank=0", "simulate.factor=1e308"), "simulate.factor"),
    (("augment=1000000000",), "augment"),
    (("augment=0",), "augment"),
    (("policy=cadence", "gamma=1e308"), "gamma"),
    (("policy=cadence", "gamma=-1e308"), "gamma"),
    (("policy=async", "gamma=200"), "gamma"),
    (("policy=cadence", "gamma=nan"), "gamma"),
    (("heartbeat_timeout_s=0.001",), "heartbeat_timeout_s"),
    (("heartbeat_timeout_s=inf",), "heartbeat_timeout_s"),
    (("epochs=0",), "epochs"),
    (("batch_size=0",), "batch_size"),
    (("eval_every=-1",), "eval_every"),
    (("vram_max_usage=1.5",), "vram_max_usage"),
    (("ram_max_usage=0.95",), "ram_max_usage"),
    (("disk_stage_gb=-1",), "disk_stage_gb"),
    (("disk_stage_gb=inf",), "disk_stage_gb"),
    (("checkpoint_every=0",), "checkpoint_every"),
    (("max_grad_norm=0",), "max_grad_norm"),
    (("lr_scale_ratio=-1",), "lr_scale_ratio"),
    (("policy=cadence", "overhead_target=0.9"), "overhead_target"),
    (("policy=cadence", "max_anchor=5"), "max_anchor"),
    (("simulate.nan_rank=3",), "simulate.nan_rank"),
    (("simulate.hang_at_step=0",), "simulate.hang_at_step"),
    (("launch.nproc_per_node=0",), "launch.nproc_per_node"),
    (("launch.start_method=thread",), "launch.start_method"),
    (("logger.log_every=-1",), "logger.log_every"),
    (("device=gpu",), "device"),
    # writable paths
    ((f"save_path={FILE}/ckpt", "checkpoint_every=1"), "save_path"),
    ((f"save_path={FILE}", "checkpoint_every=1"), "save_path"),
    (("disk_stage_gb=1", f"disk_stage_dir={FILE}"), "disk_stage_dir"),
    ((f"hydra.run.dir={FILE}/run",), "hydra.run.dir"),
    (("resume=/nonexistent/run",), "resume"),
    # /proc: its permissions say root may write; making a dir there fails for everyone
    (("save_path=/proc/flodl-checkpoints", "checkpoint_every=1"), "save_path"),
    # the task's parts, built once as a rank builds them (the model and what goes with it on the meta device)
    (("batch_size=2000",), "batch_size"),
    (("task.eval_data.split=validation",), "task.eval_data"),
    (
        (
            "task.train_data._target_=flodl.data.npy.NpyFolderDataSet",
            "~task.train_data.split",
            "+task.train_data.folder=/nonexistent",
        ),
        "task.train_data",
    ),
    (STREAM, "task.train_data"),
    # a stream: its epoch is steps_per_epoch (a map-style Dataset's is its length); no index to key views by
    (("steps_per_epoch=3",), "steps_per_epoch"),
    (("steps_per_epoch=0",), "steps_per_epoch"),
    ((*STREAM, "steps_per_epoch=3", "augment=2"), "augment"),
    ((*STREAM, "steps_per_epoch=3", "task.cacheable=true"), "task.cacheable"),
    (("task.eval_data._target_=tests.helpers.bad_tasks.stream", "~task.eval_data.split"), "task.eval_data"),
    (("steps_per_epoch=3", "fault_tolerance=survive", "launch.nproc_per_node=2"), "steps_per_epoch"),
    (("task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true}",), "task.scheduler"),
    (("task.eval_fn={_target_:tests.helpers.bad_tasks.sums_forgotten,_partial_:true}",), "task.eval_fn"),
    (("launch.nproc_per_node=2", "lr_scale_ratio=1e308"), "lr_scale_ratio"),
    (("launch.timeout_s=0.000001",), "launch.timeout_s"),
    # keys that would do nothing in this config
    (("policy=[sync,async]",), "policy"),
    (("hydra.run.dir=",), "hydra.run.dir"),
    (("launch.max_restarts=3",), "launch.max_restarts"),
    (("checkpoint_every=null", "checkpoint_keep=5"), "checkpoint_keep"),
    (("checkpoint_every=null", "save_path=ckpts"), "save_path"),
    (("simulate.factor=3",), "simulate.factor"),
    (("logger.mode=offline",), "logger.mode"),
    (("logger.project=mine",), "logger.project"),
    (("policy=cadence", "divergence_guard=none", "divergence_threshold=0.5"), "divergence_threshold"),
    (("policy=cadence", "min_anchor=20"), "min_anchor"),
    (("disk_stage_gb=1", "disk_stage_dir=''"), "disk_stage_dir"),
    (("disk_stage_dir=/tmp",), "disk_stage_dir"),
    (("debug.stager=false", "disk_stage_gb=1"), "disk_stage_gb"),
    (("policy=sync", "anchor=20"), "anchor"),
    (("easgd_alpha=0.5",), "easgd_alpha"),
    (("outer=slowmo",), "outer"),
    (("policy=cadence", "outer_lr=0.5"), "outer_lr"),
    (("policy=cadence", "max_overshoot=3"), "max_overshoot"),
    (("on_nonfinite=skip",), "on_nonfinite"),
    (("partition_ratios=[1,1]",), "partition_ratios"),
]


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def rejection(overrides: tuple[str, ...]) -> str | None:
    """What refuses the config, in the CLI's words (None: it passes every check)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        preflight(cfg)
    except ConfigError as err:
        return str(err)
    except OmegaConfBaseException as err:
        return omegaconf_problem(err)
    except HydraException as err:
        return hydra_problem(err)
    return None


def test_the_table_holds_sixty_invalid_configs() -> None:
    assert len(INVALID) >= 60 and len({o for o, _ in INVALID}) == len(INVALID)


@pytest.mark.parametrize(("overrides", "key"), INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_an_invalid_config_is_refused_naming_its_key(
    overrides: tuple[str, ...], key: str, hydra_conf: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    text = rejection(tuple(o.replace(FILE, str(blocker)) for o in overrides))
    assert text is not None, f"{overrides} was accepted"
    lines = text.splitlines()
    named = [
        line for line in lines if line.lstrip(" -").removeprefix("invalid flodl config: ").startswith(key)
    ]
    assert named, f"{key} not named by the rejection of {overrides}: {text}"
    assert list(tmp_path.iterdir()) == [blocker]  # nothing was created


def test_a_stream_without_steps_per_epoch_is_refused_saying_what_to_set(hydra_conf: None) -> None:
    text = rejection(STREAM)
    assert text is not None and "is an IterableDataset (a stream)" in text and "set steps_per_epoch" in text


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("policy=async", "anchor=5", "gamma=0.5"),
        ("policy=cadence", "checkpoint_every=1", "checkpoint_keep=1"),
        (*STREAM, "steps_per_epoch=3", "num_workers=2"),
    ],
)
def test_sound_configs_pass(
    overrides: tuple[str, ...], hydra_conf: None, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert rejection(overrides) is None


def test_the_shipped_tasks_bind_and_have_capacity(hydra_conf: None) -> None:
    for task in sorted(p.stem for p in (CONF / "task").glob("*.yaml")):
        assert rejection((f"task={task}",)) is None, task


# --- through the real CLI: exit code 2, one line per problem, no traceback, nothing left behind ---

CLI_CASES = [
    (("+foo=1",), ["foo"]),
    (("policy=nope",), ["policy"]),
    (("seed=abc",), ["seed"]),
    (
        ("task.model.hidden=0", "task.optimizer.lr=0", "launch.timeout_s=inf"),
        ["task.model", "task.optimizer.lr", "launch.timeout_s"],
    ),
    (("hydra.run.dir=",), ["hydra.run.dir"]),
    (
        (
            "launch.nproc_per_node=2",
            "policy=cadence",
            "gamma=-1e308",
            "simulate.slow_rank=1",
            "simulate.factor=1e308",
        ),
        ["gamma", "simulate.factor"],
    ),
]


@pytest.mark.parametrize(("overrides", "keys"), CLI_CASES, ids=[" ".join(o) for o, _ in CLI_CASES])
@pytest.mark.multiproc
def test_the_cli_refuses_with_exit_2_one_line_each_and_leaves_no_dir(
    overrides: tuple[str, ...], keys: list[str], tmp_path: Path
) -> None:
    result = train(*overrides, cwd=tmp_path, timeout=60, HYDRA_FULL_ERROR="0")
    assert result.code == 2, result.out
    assert "Traceback" not in result.out and "HYDRA_FULL_ERROR" not in result.out, result.out
    problems = [line for line in result.out.splitlines() if line.strip()]
    assert problems[0].startswith("flodl: ")
    for key in keys:
        assert sum(key in line for line in problems) >= 1, (key, result.out)
    assert len(problems) <= len(keys) + 1, result.out  # a header and one line per problem at most
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiproc
def test_hydra_full_error_still_shows_the_traceback(tmp_path: Path) -> None:
    result = train("seed=abc", cwd=tmp_path, timeout=60, HYDRA_FULL_ERROR="1")
    assert result.code != 0 and "Traceback" in result.out


@pytest.mark.multiproc
def test_a_disk_tier_on_in_memory_data_runs_with_one_warning(tmp_path: Path) -> None:
    result = train("policy=async", "disk_stage_gb=1", "epochs=1", cwd=tmp_path, timeout=120).check()
    assert result.out.count("the disk tier has nothing to stage") == 1, result.out


@pytest.mark.multiproc
def test_the_cli_refuses_a_missing_dataset_and_w_and_b_without_a_key_before_any_rank(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = tmp_path_factory.mktemp("home")  # W&B's settings and .netrc: none, and nothing of the user's
    wandb = {f"WANDB_{d}_DIR": str(home / d.lower()) for d in ("CONFIG", "CACHE", "DATA")}
    result = train(
        "task.train_data._target_=flodl.data.npy.NpyFolderDataSet",
        "~task.train_data.split",
        f"+task.train_data.folder={home / 'no-such-data'}",
        "logger=wandb",
        "logger.mode=online",
        cwd=tmp_path,
        timeout=60,
        HYDRA_FULL_ERROR="0",
        HOME=str(home),
        WANDB_API_KEY="",
        **wandb,
    )
    assert result.code == 2, result.out
    assert "Traceback" not in result.out, result.out
    problems = result.out.strip().splitlines()
    assert problems[0] == "flodl: invalid flodl config: ", result.out
    assert problems[1].startswith("  - task.train_data: building it failed (FileNotFoundError: "), result.out
    assert problems[2].startswith("  - logger=wandb: W&B has no API key, and it runs online; "), result.out
    assert len(problems) == 3 and list(tmp_path.iterdir()) == [], result.out  # no run dir


@pytest.mark.multiproc
def test_a_checkpoint_this_job_cannot_resume_is_refused_before_the_run_dir_is_made(
    tmp_path: Path, hydra_conf: None
) -> None:
    first = tmp_path / "first"
    train("epochs=1", "checkpoint_every=1", f"hydra.run.dir={first}", cwd=tmp_path, timeout=120).check()
    (checkpoint,) = [p for p in (first / "checkpoints").iterdir() if p.is_dir()]
    # An older flodl's checkpoint does not say which run wrote it: its policy, and what a resize keeps, are
    # checked.
    older = tmp_path / "older" / checkpoint.name
    shutil.copytree(checkpoint, older)
    manifest = json.loads((older / MANIFEST_FILE).read_text())
    (older / MANIFEST_FILE).write_text(json.dumps({k: v for k, v in manifest.items() if k != "run"}))
    second = tmp_path / "second"
    for overrides, why in [
        ((f"resume={checkpoint}", "seed=7"), "whose config differs from this run's (seed: 42 there, 7 here"),
        (
            (f"resume={older}", "launch.nproc_per_node=2", "keep_global_batch=true"),
            "keep_global_batch=true: the checkpoint's global batch of 32 (1 ranks) does not divide",
        ),
        ((f"resume={older}", "policy=cadence"), "was written under policy=sync"),
    ]:
        text = rejection((*overrides, f"hydra.run.dir={second}"))
        assert text is not None, overrides
        assert f"resume='{overrides[0].removeprefix('resume=')}': " in text and why in text, text
    refused = train(
        f"resume={checkpoint}", "seed=7", f"hydra.run.dir={second}", cwd=tmp_path, HYDRA_FULL_ERROR="0"
    )
    assert refused.code == 2 and "Traceback" not in refused.out, refused.out
    assert "whose config differs" in refused.out and not second.exists(), refused.out


@pytest.mark.multiproc
def test_a_plan_writes_nothing_and_warns_of_more_ranks_than_cores(tmp_path: Path) -> None:
    ranks = len(os.sched_getaffinity(0)) + 1
    result = train("plan=true", f"launch.nproc_per_node={ranks}", cwd=tmp_path, timeout=60).check()
    assert "flodl plan (nothing was started)" in result.out, result.out
    assert f"warning         {ranks} ranks on this host share its {ranks - 1} CPU core(s)" in result.out
    assert list(tmp_path.iterdir()) == []  # not even the run dir Hydra would have made


def _shards(pattern: str) -> tuple[str, ...]:
    """The training data as a webdataset stream of the shards `pattern` names."""
    return (
        "task.train_data._target_=webdataset.WebDataset",
        "~task.train_data.split",
        f"+task.train_data.urls='{pattern}'",
        "+task.train_data.shardshuffle=false",
        "steps_per_epoch=3",
    )


def test_a_webdataset_pattern_that_names_missing_shards_is_refused_naming_its_key(
    hydra_conf: None, tmp_path: Path
) -> None:
    pytest.importorskip("webdataset", exc_type=ImportError)
    write_point_shards(tmp_path, 16, 4)  # points-000000.tar .. points-000003.tar
    assert rejection(_shards(f"{tmp_path}/points-{{000000..000003}}.tar")) is None
    for names, missing in (
        ("{000010..000013}", "4 of its 4 shards"),
        ("{000000..000005}", "2 of its 6 shards"),
    ):
        pattern = f"{tmp_path}/points-{names}.tar"
        text = rejection(_shards(pattern))
        assert text is not None
        (line,) = text.splitlines()
        assert line.startswith(f"invalid flodl config: task.train_data.urls={pattern!r}: "), line
        assert f"names no file for {missing}" in line


@pytest.mark.parametrize(
    ("overrides", "records"),
    [
        ((), "eval/accuracy, eval/loss"),  # digits' eval_fn, run once on the meta device
        (("task.eval_fn=null",), "eval/loss"),  # no eval_fn: the eval measures the task's loss
    ],
)
def test_an_objective_the_eval_does_not_record_is_refused_naming_what_it_records(
    overrides: tuple[str, ...], records: str, hydra_conf: None
) -> None:
    text = rejection((*overrides, "objective=eval/acc"))
    assert text == (
        f"invalid flodl config: objective='eval/acc': the run's eval records no such metric ({records}); "
        "name one of them"
    )
    assert rejection((*overrides, "objective=eval/loss")) is None

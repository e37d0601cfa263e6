"""flodl under the sweepers and launchers users bring (issue 41): Optuna reads each job's objective, a failed
job is a failed trial, joblib's workers start ranks, a config error of the whole sweep stops it first."""

from __future__ import annotations

import math
import os

import pytest
from omegaconf import DictConfig, OmegaConf

from flodl.config.rules import ConfigError
from flodl.config.sweep import FlodlSweeperConf
from flodl.launcher.objective import NoObjective, objective_key, objective_of
from flodl.launcher.sweep_job import drawn_on_rank_0, follow_rank_0


def test_the_objective_is_the_last_recorded_value_of_its_key() -> None:
    records = [{"epoch": 0, "loss": 2.0, "eval/loss": 1.5}, {"epoch": 1, "loss": 1.0, "eval/loss": 0.5}]
    assert objective_of(records, "eval/loss") == 0.5
    assert objective_of(records, "loss") == 1.0
    assert objective_key(None, evaluates=True) == "eval/loss"
    assert objective_key(None, evaluates=False) == "loss"
    assert objective_key("eval/accuracy", evaluates=True) == "eval/accuracy"


def test_no_objective_names_the_key_and_what_was_recorded() -> None:
    with pytest.raises(
        NoObjective, match=r"objective=eval/accuracy: no epoch record holds it \(recorded: loss\)"
    ):
        objective_of([{"epoch": 0, "loss": 2.0}], "eval/accuracy")
    with pytest.raises(NoObjective, match="no epoch was recorded"):
        objective_of([], "loss")
    # A run whose last value of its objective is NaN gives the sweeper nothing to compare: a failed trial.
    with pytest.raises(NoObjective, match="not finite at epoch 1"):
        objective_of([{"epoch": 0, "loss": 2.0}, {"epoch": 1, "loss": math.nan}], "loss")


OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def _sweep(sweeper: str) -> DictConfig:
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": sweeper}}})


@pytest.mark.parametrize("rank", ["0", "1"])
def test_ranks_started_without_torchruns_store_are_refused_a_sweeper_that_draws(
    rank: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not drawn_on_rank_0(_sweep(FlodlSweeperConf._target_))  # a grid: every rank composes it alike
    config = _sweep(OPTUNA)
    assert drawn_on_rank_0(config)
    refused = rf"hydra.sweeper: {OPTUNA} draws each trial.*start them with torchrun"
    with pytest.raises(ConfigError, match=refused):
        follow_rank_0(config)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank walks the sweep alone
    assert not drawn_on_rank_0(config)

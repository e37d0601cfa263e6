"""flodl's default sweeper: Hydra's basic sweeper that checks the whole grid before the first job trains.

Every job's config is composed and given the pre-spawn check of a single run
(`flodl.launcher.launch.check_job`).
An invalid job stops the sweep (exit 2, one block naming each invalid job and its rules, nothing trained);
with `hydra.sweeper.skip_invalid=true` the valid jobs run and the skipped ones go to `skipped.json`. Each job
keeps its place in the grid as its number (its dir's name), so a skipped job's number is no job dir's.
A failed job ends the sweep with exit code 1 after its one line (a sweeper that searches, such as Optuna,
counts it as a failed trial instead). Once the grid is checked the sweep's own start-up is over
(`flodl.metrics.run_clock.sweep_ready`). Ranks walking a sweep together (torchrun) each run it; only rank 0
says Hydra's launcher lines. Under a sweeper that draws its trials (Optuna, ...), every rank but 0 walks
`RankZerosTrials` instead (flodl/launcher/sweep_job.py).
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module unregistered.
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from flodl.config.sweep import CheckedJob, grid_batches, invalid_block, write_skipped
from flodl.metrics import run_clock


def _rank() -> int:
    from flodl.config.host import RankEnv

    return RankEnv.from_environ().rank


class _GridNumbered(Launcher):
    """The launcher, given each batch's place in the grid as the number its jobs are numbered on from
    (Hydra gives the count of the jobs launched before it)."""

    def __init__(self, launcher: Launcher, first_of: dict[int, int]) -> None:
        self.launcher = launcher
        # Hydra's number for a batch -> the grid place of its first job.
        self.first_of = first_of

    def setup(self, **kwargs: Any) -> None:
        self.launcher.setup(**kwargs)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from flodl.launcher.sweep_job import JobFailed

        returns = self.launcher.launch(job_overrides, self.first_of.get(initial_job_idx, initial_job_idx))
        for job in returns:
            try:
                job.return_value  # noqa: B018 (raises the job's failure)
            except JobFailed:  # the job said why in one line: the sweep ends there, as a run does
                sys.exit(1)
        return returns

    def __getattr__(self, name: str) -> Any:
        return getattr(self.launcher, name)


def _quiet_unless_rank_0() -> None:
    if _rank() != 0:  # every rank walks the sweep: rank 0 says what is launched
        logging.getLogger("hydra").setLevel(logging.WARNING)


class RankZerosTrials(Sweeper):
    """Under torchrun, the sweep of every rank but 0 when rank 0's sweeper draws the trials: it runs each job
    rank 0 runs, with rank 0's overrides and number, until rank 0's sweep ends."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        _quiet_unless_rank_0()

    def sweep(self, arguments: list[str]) -> None:
        from flodl.launcher.sweep_job import rank_0s_jobs

        assert self.config is not None and self.launcher is not None
        for num, overrides in rank_0s_jobs(self.config):
            self.launcher.launch([overrides], initial_job_idx=num)


class FlodlSweeper(BasicSweeper):
    def __init__(
        self,
        max_batch_size: int | None = None,
        params: dict[str, str] | None = None,
        skip_invalid: bool = False,
    ) -> None:
        super().__init__(max_batch_size, params)
        self.skip_invalid = skip_invalid
        self._first_of: dict[int, int] = {}

    def setup(self, **kwargs: Any) -> None:
        super().setup(**kwargs)
        assert self.launcher is not None
        self.launcher = _GridNumbered(self.launcher, self._first_of)
        _quiet_unless_rank_0()

    # The basic sweeper's static split, called through `self`: the grid is checked here, before `sweep`
    # makes the sweep dir or launches a batch.
    def split_arguments(  # type: ignore[override]
        self, overrides: list[Override], max_batch_size: int | None
    ) -> list[list[list[str]]]:
        jobs = BasicSweeper.split_arguments(overrides, None)[0]
        checked = [CheckedJob(index, job, self._problems(job)) for index, job in enumerate(jobs)]
        invalid = [job for job in checked if job.problems]
        if invalid:
            self._stop_or_skip(invalid, len(jobs), len(jobs) - len(invalid))
        batches, launched = [], 0
        for first, batch in grid_batches(checked, max_batch_size):
            self._first_of[launched] = first
            batches.append([job.overrides for job in batch])
            launched += len(batch)
        return batches

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        super().validate_batch_is_legal(batch)
        assert self.config is not None
        run_clock.sweep_ready(Path(str(self.config.hydra.sweep.dir)) if _rank() == 0 else None)

    def _stop_or_skip(self, invalid: list[CheckedJob], total: int, valid: int) -> None:
        speaks = _rank() == 0  # torchrun walking the sweep: every rank checks, one says
        block = invalid_block(invalid, total)
        if not self.skip_invalid or not valid:
            if speaks:
                hint = f"; hydra.sweeper.skip_invalid=true runs the {valid} valid ones" if valid else ""
                print(f"flodl: {block}\nnothing was trained{hint}", file=sys.stderr)
            sys.exit(2)
        if speaks:
            assert self.config is not None
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            written = write_skipped(sweep_dir, invalid)
            print(f"flodl: {block}\nskipping them (listed in {written}); running {valid} jobs")

    def _problems(self, job: list[str]) -> list[str]:
        from flodl.config.rules import ConfigError
        from flodl.launcher.launch import check_job

        assert self.hydra_context is not None and self.config is not None
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            with open_dict(cfg):
                del cfg["hydra"]
            config: Any = OmegaConf.to_container(cfg, resolve=True)
            check_job(config)
        except ConfigError as err:
            return err.problems
        except Exception as err:  # Hydra's composition errors, as one line
            return [f"{type(err).__name__}: {' '.join(str(err).split())}"]
        return []

"""From a composed config to running ranks.

Three ways in, one rank body (`run_rank`):
- under torchrun (RANK/WORLD_SIZE set): this process is one rank;
- `launch.nproc_per_node=N` (N > 1) without torchrun: this process starts N ranks through torch's
  elastic launcher (c10d rendezvous on a free port) and waits for them;
- otherwise: a single rank in this process.
The config is validated before any rank starts; every rank then checks it holds the same config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.errors import HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed import TCPStore

from flodl.config.host import HostFacts, RankEnv
from flodl.config.policy import hosts_apart
from flodl.config.rules import ConfigError
from flodl.config.schema import FlodlConfig
from flodl.job import failures
from flodl.job.host import HostFailed
from flodl.job.rank import run_rank, stopped_line
from flodl.job.settings import data_plane_settings
from flodl.launcher import sweep_job
from flodl.launcher.apart import supervise_apart, supervised_apart
from flodl.launcher.cluster_env import adopt_scheduler_environ
from flodl.launcher.run_dir import RunDirTaken, claim_run_dir, release_claimed, run_uid
from flodl.launcher.self_launch import RankFailure, failure_line, host_run, keep_on_loopback, say, self_launch
from flodl.links.group import is_loopback, loopback_store
from flodl.links.liveness import LivenessListener
from flodl.links.stop import Stopped, catch_stop_signals
from flodl.logs import one_line, stderr_kept_in
from flodl.metrics import run_clock
from flodl.metrics.run_info import RunInfo, from_hydra
from flodl.metrics.wandb_sink import WandbStartError
from flodl.preflight.checks import omegaconf_problem, preflight, warn_of_idle_disk_tier
from flodl.preflight.plan import describe

log = logging.getLogger("flodl")


EXIT_CONFIG = 2
_FULL_ERROR = "HYDRA_FULL_ERROR"
# Set while `report_config_errors` asks Hydra to raise its errors instead of printing them (not the user's).
_raised_by_us = False


def report_config_errors(main: Callable[[], Any]) -> None:
    """Run a @hydra.main function; a config Hydra or flodl rejects ends in one line and exit code 2.

    Hydra prints its own rejections and exits 1; with HYDRA_FULL_ERROR=1 it raises them, which is asked
    for here (a user's own HYDRA_FULL_ERROR=1 keeps Hydra's full traceback)."""
    global _raised_by_us
    if os.environ.get(_FULL_ERROR) == "1":
        main()
        return
    os.environ[_FULL_ERROR], _raised_by_us = "1", True
    try:
        main()
    except OmegaConfBaseException as err:
        _exit_config(omegaconf_problem(err))
    except HydraException as err:
        _exit_config(hydra_problem(err))
    finally:
        _hand_back_full_error()


def _hand_back_full_error() -> None:
    """Once the job runs, errors are Hydra's to report as usual (and ranks and sweep jobs inherit no flag)."""
    global _raised_by_us
    if _raised_by_us:
        os.environ.pop(_FULL_ERROR, None)
        _raised_by_us = False


def hydra_problem(err: HydraException) -> str:
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return omegaconf_problem(cause)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    missing = getattr(err, "missing_cfg_file", None)
    if missing:  # a config group option that does not exist: name the group and its options
        group, _, option = str(missing).rpartition("/")
        options = ", ".join(getattr(err, "options", None) or [])
        return f"{group or 'config'}: no option {option!r}" + (f" (options: {options})" if options else "")
    if isinstance(err, OverrideParseException):
        return f"override: {first} (override grammar: https://hydra.cc/docs/advanced/override_grammar/basic)"
    return f"hydra: {first}"


def _exit_config(message: str) -> None:
    print(f"flodl: {message}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


class Preflight(Callback):
    """Hydra callback: every check of `flodl.preflight.checks` before Hydra creates the run dir (a rejected
    config leaves no dir behind), and `plan=true`'s summary, which writes nothing; under a sweeper that checks
    no job (Optuna, ...), what every job shares, before the first. Hydra turns a callback's exception into a
    warning, so it exits itself."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        # The run dir may interpolate ${hydra:...}, which reads HydraConfig: set it as run_job does.
        HydraConfig.instance().set_config(config)
        try:
            typed, host = preflight(config)
        except (ConfigError, OmegaConfBaseException) as err:
            release_claimed()  # resolving the run dir claimed it: a refused config leaves nothing behind
            _exit_config(str(err) if isinstance(err, ConfigError) else omegaconf_problem(err))
        warn_of_idle_disk_tier(typed)
        if typed.plan:
            _print_plan(typed, host, Path(config.hydra.run.dir) if config.get("hydra") else None)
            release_claimed()
            sys.exit(0)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problems = sweep_job.shared_problems(config)
        if problems:  # every job would fail on them: the sweep's error, before any job
            _exit_config(f"{ConfigError(problems)} (in every job of this sweep)")
        if sweep_job.drawn_on_rank_0(config):  # before Hydra builds the sweeper from `config`
            try:
                sweep_job.follow_rank_0(config)
            except ConfigError as err:
                _exit_config(str(err))
            if RankEnv.from_environ().rank == 0:
                self._leading = 0

    # Rank 0 of a sweep whose trials it draws under torchrun: the number of the job it hands out next.
    _leading: int | None = None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._leading is not None:  # each job to the other ranks, as it starts
            self._leading = config.hydra.job.num + 1
            sweep_job.publish_job(config, config.hydra.job.num, list(config.hydra.overrides.task))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._leading is not None:  # the other ranks' sweeps end
            sweep_job.publish_job(config, self._leading, None)


# The failures flodl words in one line (the rest are a traceback's).
_SAID = (ConfigError, RankFailure, WandbStartError, HostFailed, sweep_job.NoObjective)


def launch_from_hydra(cfg: DictConfig) -> float | None:
    """The @hydra.main body: validate, then run the ranks. A single run exits 2 on a config error, 1 on a
    failure; a sweep's job raises its failure for the sweeper (a failed trial) and returns the run's
    objective (flodl/launcher/sweep_job.py)."""
    from hydra.core.hydra_config import HydraConfig

    _hand_back_full_error()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    in_sweep = sweep_job.in_multirun()
    try:
        launch(cfg, from_hydra(run_dir, cfg.logger.group))
        return sweep_job.objective(cfg, run_dir) if in_sweep else None
    except _SAID as err:
        if isinstance(err, RankFailure) or RankEnv.from_environ().rank == 0:  # torchrun's ranks: one says it
            print(f"flodl: {err}", file=sys.stderr)
        if in_sweep:  # SystemExit would end the whole sweep, past the sweeper's own count of failures
            raise sweep_job.JobFailed(str(err)) from None
        sys.exit(EXIT_CONFIG if isinstance(err, ConfigError) else 1)
    except Stopped as stop:  # rank 0 or the launcher said where the run stopped and how to resume it
        sys.exit(stop.exit_code)


def launch(cfg: DictConfig, info: RunInfo) -> None:
    launched_at = run_clock.launch_time()
    adopt_scheduler_environ()
    # A DictConfig's container is a dict, keyed by the schema's names.
    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    typed, host = check_job(config)
    env = RankEnv.from_environ()
    if typed.plan:  # a sweep's job (a single run's plan is printed before Hydra makes its dir)
        _print_plan(typed, host, Path(info.run_dir))
        return
    info = dataclasses.replace(info, uid=run_uid(Path(info.run_dir)))
    try:  # before any rank starts: the run dir is this run's alone
        claim_run_dir(Path(info.run_dir), info.uid)
    except RunDirTaken as err:
        raise ConfigError([str(err)]) from None
    # torchrun's ranks: rank 0 records the run's end.
    with _exit_recorded(Path(info.run_dir), launched_at, records=env.rank == 0):
        if supervised_apart(typed, env):
            supervise_apart(config, info, typed, env)
        elif env.launched:
            run_rank(config, info.as_dict())
        else:
            keep_on_loopback()
            if typed.launch.nproc_per_node == 1:
                _single_rank(config, info, typed)
            else:
                self_launch(config, info, typed, host.gpus)


@contextlib.contextmanager
def _exit_recorded(run_dir: Path, launched_at: float, records: bool) -> Iterator[None]:
    """The job's exit in its run.json, with the line that says why when it failed (the compare report lists
    a failed job by it); a stop is no exit recorded."""
    try:
        yield
    except Exception as err:
        if records:
            said = str(err) if isinstance(err, _SAID) else f"{type(err).__name__}: {err}"
            run_clock.record_exit(run_dir, launched_at, failed=one_line(said))
        raise
    if records:
        run_clock.record_exit(run_dir, launched_at)


def coordinator_from_hydra(cfg: DictConfig) -> None:
    """`flodl-coordinator`'s @hydra.main body: the run of ranks started apart from it, on several hosts."""
    from hydra.core.hydra_config import HydraConfig

    _hand_back_full_error()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        host_apart(cfg, from_hydra(run_dir, cfg.logger.group))
    except (ConfigError, RankFailure, WandbStartError) as err:
        print(f"flodl: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG if isinstance(err, ConfigError) else 1)
    except Stopped as stop:
        sys.exit(stop.exit_code)


def host_apart(cfg: DictConfig, info: RunInfo) -> None:
    """Host a fault_tolerance=survive run whose WORLD_SIZE ranks are started apart (each with RANK,
    WORLD_SIZE, MASTER_ADDR pointing here and MASTER_PORT): its store on MASTER_PORT, its coordinator, its
    records. Any rank may die and come back; this process must live as long as the run."""
    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    typed, facts = check_job(config)
    env = RankEnv.from_environ()
    if env.launched or not env.hosts_ranks_apart or env.master_port is None:
        why = "set WORLD_SIZE (the ranks) and MASTER_PORT (where they meet), and no RANK: it is no rank"
        raise ConfigError([f"flodl-coordinator: {why}"])
    if not hosts_apart(typed):
        why = "flodl-coordinator hosts a fault_tolerance=survive run (otherwise rank 0 hosts the run)"
        raise ConfigError([f"fault_tolerance={typed.fault_tolerance!r}: {why}"])
    info = dataclasses.replace(info, uid=run_uid(Path(info.run_dir)))
    try:
        claim_run_dir(Path(info.run_dir), info.uid)
    except RunDirTaken as err:
        raise ConfigError([str(err)]) from None
    catch_stop_signals()
    timeout = timedelta(seconds=typed.launch.timeout_s)
    address = env.master_addr or "0.0.0.0"
    if is_loopback(address):
        store = loopback_store(env.master_port, None, timeout)
    else:
        store = TCPStore(
            address, env.master_port, None, is_master=True, timeout=timeout, wait_for_workers=False
        )
    # A rank's death is known the moment its process ends, as a supervisor would know it.
    liveness = LivenessListener(store, address)
    liveness.start()
    try:
        reachable = address if address not in ("0.0.0.0", "::") else socket.getfqdn()
        host_run(config, info, typed, env.world_size, facts.gpus, store, reachable)
    except Stopped as stop:
        say(stopped_line(stop.signum, typed, Path(info.run_dir), info))
        raise
    finally:
        liveness.wait_quiet(typed.stop_grace_s)
        liveness.stop()


def _single_rank(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    """The one rank, in this process: its stderr in its log while it runs (as a self-launched rank's), its
    failure in one line, the traceback in its log."""
    run_dir = Path(info.run_dir)
    try:
        with stderr_kept_in(run_dir / "rank0.log"):
            run_rank(config, info.as_dict())
    except Exception as err:
        otherwise = f"rank 0 failed ({type(err).__name__}: {err})"
        line = failure_line(cfg, run_dir, 1, failures.recorded(run_dir, info.uid, 0), {}, otherwise)
        raise RankFailure(line) from None


def _print_plan(cfg: FlodlConfig, host: HostFacts, run_dir: Path | None) -> None:
    if RankEnv.from_environ().rank == 0:  # torchrun's ranks: one says it
        print(describe(cfg, host, data_plane_settings(cfg, host.ranks_per_node), run_dir))


def check_job(config: dict[str, Any]) -> tuple[FlodlConfig, HostFacts]:
    """One job's pre-spawn check (also the sweeper's, for every job of a grid): the rules on its values and
    everything else flodl/preflight/checks.py checks, in one ConfigError."""
    return preflight(OmegaConf.create(config))

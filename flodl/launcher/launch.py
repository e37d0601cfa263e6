"""From a composed config to running ranks.

Three ways in, one rank body (`run_rank`):
- under torchrun (RANK/WORLD_SIZE set): this process is one rank;
- `launch.nproc_per_node=N` (N > 1) without torchrun: this process starts N ranks through torch's
  elastic launcher (c10d rendezvous on a free port) and waits for them;
- otherwise: a single rank in this process.
The config is validated before any rank starts; every rank then checks it holds the same config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.errors import HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed import TCPStore

from flodl.config.host import HostFacts, RankEnv
from flodl.config.policy import hosts_apart, saves_on_stop
from flodl.config.rules import ConfigError
from flodl.config.schema import FlodlConfig
from flodl.coordinator.roster import TooFewRanks
from flodl.job import failures
from flodl.job.assembly import (
    checkpoint_store,
    data_plane_settings,
)
from flodl.job.host import HostFailed, RunHost
from flodl.job.rank import (
    EXIT_WORDED,
    device_type_of,
    log_plan,
    run_rank,
    self_launched_rank,
    stopped_line,
)
from flodl.launcher.cluster_env import adopt_scheduler_environ
from flodl.launcher.run_dir import RunDirTaken, claim_run_dir, release_claimed, run_uid
from flodl.launcher.supervisor import SupervisedRankFailure, signal_name, supervise
from flodl.links.group import hosted_exchange, is_loopback, loopback_store
from flodl.links.stop import STOP_EXIT_CODES, Stopped, catch_stop_signals
from flodl.links.transport import Mailbox
from flodl.logs import setup_host_logging, stderr_kept_in
from flodl.metrics import run_clock
from flodl.metrics.run_info import RunInfo, from_hydra
from flodl.metrics.wandb_sink import WandbStartError
from flodl.preflight.checks import omegaconf_problem, preflight, warn_of_idle_disk_tier
from flodl.preflight.plan import describe

log = logging.getLogger("flodl")


class RankFailure(RuntimeError):
    """A rank this process launched failed; the message names the rank that began it and its log."""


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
    config leaves no dir behind), and `plan=true`'s summary, which writes nothing. Hydra turns a callback's
    exception into a warning, so it exits itself."""

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
            _print_plan(typed, host)
            release_claimed()
            sys.exit(0)


def launch_from_hydra(cfg: DictConfig) -> None:
    """The @hydra.main body: validate, then run the ranks. Exits 2 on a config error."""
    from hydra.core.hydra_config import HydraConfig

    _hand_back_full_error()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        launch(cfg, from_hydra(run_dir, cfg.logger.group))
    except (ConfigError, RankFailure, WandbStartError, HostFailed) as err:
        if isinstance(err, RankFailure) or RankEnv.from_environ().rank == 0:  # torchrun's ranks: one says it
            print(f"flodl: {err}", file=sys.stderr)
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
        _print_plan(typed, host)
        return
    info = dataclasses.replace(info, uid=run_uid(Path(info.run_dir)))
    try:  # before any rank starts: the run dir is this run's alone
        claim_run_dir(Path(info.run_dir), info.uid)
    except RunDirTaken as err:
        raise ConfigError([str(err)]) from None
    if env.launched:
        run_rank(config, info.as_dict())
        if env.rank != 0:
            return
    else:
        keep_on_loopback()
        if typed.launch.nproc_per_node == 1:
            _single_rank(config, info, typed)
        else:
            self_launch(config, info, typed, host.gpus)
    run_clock.record_exit(Path(info.run_dir), launched_at)


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
    try:
        _host(config, info, typed, env.world_size, facts.gpus, store)
    except Stopped as stop:
        _say(stopped_line(stop.signum, typed, Path(info.run_dir), info))
        raise


def _single_rank(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    """The one rank, in this process: its stderr in its log while it runs (as a self-launched rank's), its
    failure in one line, the traceback in its log."""
    run_dir = Path(info.run_dir)
    try:
        with stderr_kept_in(run_dir / "rank0.log"):
            run_rank(config, info.as_dict())
    except Exception as err:
        otherwise = f"rank 0 failed ({type(err).__name__}: {err})"
        line = _failure_line(cfg, run_dir, 1, failures.recorded(run_dir, info.uid, 0), {}, otherwise)
        raise RankFailure(line) from None


def _print_plan(cfg: FlodlConfig, host: HostFacts) -> None:
    if RankEnv.from_environ().rank == 0:  # torchrun's ranks: one says it
        print(describe(cfg, host, data_plane_settings(cfg, host.ranks_per_node)))


def keep_on_loopback() -> None:
    """A job flodl starts itself has every rank on this host: gloo's and NCCL's own sockets listen on the
    loopback interface too (they would take the address the host name resolves to), unless the user chose."""
    import psutil

    loopback = [
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses)
    ]
    if loopback:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback[0])


def check_job(config: dict[str, Any]) -> tuple[FlodlConfig, HostFacts]:
    """One job's pre-spawn check (also the sweeper's, for every job of a grid): the rules on its values and
    everything else flodl/preflight/checks.py checks, in one ConfigError."""
    return preflight(OmegaConf.create(config))


def self_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, gpus: int) -> None:
    """Start the ranks and wait for them. The terminal gets one line of flodl's for a failure or a stop: what
    the ranks, torch's launcher and gloo write to stderr goes to the run dir (each rank's own into its
    rank{N}.log, the rest into .launch/launcher.log)."""
    run_dir = Path(info.run_dir)
    catch_stop_signals()  # a stop while the launcher sets up is a stop too (torch's launcher takes over)
    try:
        with stderr_kept_in(run_dir / ".launch" / "launcher.log"):
            if hosts_apart(cfg):
                _supervised_launch(config, info, cfg, gpus)
            else:
                _elastic_launch(config, info, cfg)
    except Stopped as stop:
        _say(stopped_line(stop.signum, cfg, run_dir, info))
        raise


def _say(line: str) -> None:
    print(f"flodl: {line}", file=sys.stderr)


def _elastic_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(info.run_dir)
    # Every rank is on this host, so nothing listens beyond loopback: the rendezvous store is ours, bound
    # to 127.0.0.1 (torch's would listen on every interface); the agent does not open a shared store of
    # its own, and rank 0 hosts the ranks' store on MASTER_ADDR=127.0.0.1 (flodl/links/group.py).
    rendezvous = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launch.nproc_per_node,
        run_id=f"flodl-{uuid.uuid4().hex[:12]}",
        # The default rendezvous needs etcd; c10d joins the store above as a client.
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{rendezvous.port}",
        rdzv_configs={"is_host": False},
        local_addr="127.0.0.1",
        # Each restart starts every rank again; they resume from the run's last checkpoint (resume=auto).
        max_restarts=cfg.launch.max_restarts,
        monitor_interval=0.1,
        start_method=cfg.launch.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / ".launch")),
    )

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_quiet_stops)
    try:
        elastic_launch(launch_config, self_launched_rank)(config, info.as_dict())
    except SignalException as err:  # the launcher got it: the agent forwarded it and waited for the ranks
        raise Stopped(err.sigval) from None
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if len(codes) == 1 and codes <= STOP_EXIT_CODES:  # a rank got it and every rank stopped on it
            raise Stopped(codes.pop() - 128) from None
        failed = sorted(err.failures)
        deaths = {r: signal_name(-f.exitcode) for r, f in err.failures.items() if f.exitcode < 0}
        exits = ", ".join(f"rank {r}: exit code {err.failures[r].exitcode}" for r in failed)
        logs = ", ".join(str(run_dir / f"rank{r}.log") for r in failed)
        recorded = failures.recorded(run_dir, info.uid, cfg.launch.max_restarts)
        otherwise = f"rank(s) {failed} failed ({exits}; see {logs})"
        raise RankFailure(
            _failure_line(cfg, run_dir, cfg.launch.nproc_per_node, recorded, deaths, otherwise)
        ) from None


def _supervised_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, gpus: int) -> None:
    """fault_tolerance=survive: each rank supervised on its own (torch's elastic agent would stop them all
    when one dies); this process hosts the store and the run (flodl/job/host.py), which outlive any rank,
    rank 0 included."""
    world = cfg.launch.nproc_per_node
    store = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def supervised(ended: Callable[[], bool]) -> None:
        supervise(
            self_launched_rank, (config, info.as_dict()), world, cfg.launch.max_restarts,
            cfg.launch.start_method, store, store.port, Path(info.run_dir), ended,
            saving_s=cfg.stop_grace_s if saves_on_stop(cfg) else 0.0,
        )  # fmt: skip

    _host(config, info, cfg, world, gpus, store, supervised)


def _host(
    config: dict[str, Any],
    info: RunInfo,
    cfg: FlodlConfig,
    world: int,
    gpus: int,
    store: TCPStore,
    ranks: Callable[[Callable[[], bool]], None] | None = None,
) -> None:
    """This process hosts the run (flodl/job/host.py) in `store`, while `ranks(ended)` supervises its ranks
    until `ended()` (None: the ranks run apart; the host ends with the run). A planned stop (min_ranks) and a
    failure end in one line."""
    run_dir = Path(info.run_dir)
    setup_host_logging(run_dir)

    def connect(namespace: str, owner: int | str) -> Mailbox:  # the store listens here too
        return Mailbox.connect("127.0.0.1", store.port, namespace, owner, cfg.launch.timeout_s)

    host = RunHost(cfg, config, info, world, hosted_exchange(store), connect)
    host.open()
    log_plan(cfg, world, device_type_of(cfg, gpus))
    serving = threading.Thread(target=host.serve, name="flodl-run-host", daemon=True)
    serving.start()
    try:
        if ranks is not None:
            ranks(host.ended.is_set)
        while not host.ended.wait(0.5):  # a stop signal can land between the waits
            pass
        serving.join()
        host.finish()
    except SupervisedRankFailure as err:
        host.stop()
        raise RankFailure(f"{err}; {_where(cfg, run_dir)}") from None
    except TooFewRanks as err:  # a planned stop: one line naming min_ranks
        raise RankFailure(str(err)) from None
    except BaseException:
        host.stop()
        raise


def _failure_line(
    cfg: FlodlConfig,
    run_dir: Path,
    world_size: int,
    recorded: list[failures.Failure],
    deaths: dict[int, str],
    otherwise: str,
    note: str = "",
) -> str:
    """The launcher's line for failed ranks: the one that began it (flodl/job/failures.py) and its log, or
    `otherwise` when none recorded why and none was killed; `note` on a fault; where the run stands."""
    where = _where(cfg, run_dir)
    blamed = failures.blame(recorded, deaths)
    if blamed is None:
        return f"{otherwise}; {where}"
    if note and not blamed.planned:
        where = f"{note}; {where}"
    return failures.verdict(blamed, world_size, where, run_dir)


def _where(cfg: FlodlConfig, run_dir: Path) -> str:
    latest = checkpoint_store(cfg, run_dir).latest()
    return f"the last checkpoint is {latest.path}" if latest else "no checkpoint was written"


def _quiet_stops(record: logging.LogRecord) -> bool:
    """The elastic launcher logs a rank that exits 130 / 143 as failed, with a traceback: a stop is not; nor
    is a rank that recorded its failure (EXIT_WORDED: the launcher words it)."""
    err = record.exc_info[1] if record.exc_info else None
    return getattr(err, "exit_code", None) not in {*STOP_EXIT_CODES, EXIT_WORDED}

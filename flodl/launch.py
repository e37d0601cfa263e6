"""From a composed config to running ranks.

Three ways in, one rank body (`run_rank`):
- under torchrun (RANK/WORLD_SIZE set): this process is one rank;
- `launch.nproc_per_node=N` (N > 1) without torchrun: this process starts N ranks through torch's
  elastic launcher (c10d rendezvous on a free port) and waits for them;
- otherwise: a single rank in this process.
The config is validated before any rank starts; every rank then checks it holds the same config.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hydra.errors import HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flodl import failures
from flodl.assembly import (
    checkpoint_store,
    data_plane_settings,
    make_coordinator,
    make_survival,
    make_worker,
    resume_settings,
    task_settings,
)
from flodl.checkpoint import MODEL_FILE, CheckpointError, save_model
from flodl.cluster_env import adopt_scheduler_environ
from flodl.config.host import HostFacts, RankEnv
from flodl.config.policy import (
    collective_backend,
    compile_mode_for,
    heartbeat_timeout_of,
    step_samples,
    step_words,
)
from flodl.config.rules import ConfigError
from flodl.config.schema import FlodlConfig, to_config
from flodl.coordinator.coordinator import Coordinator, RankHung, TooFewRanks
from flodl.coordinator.hooks import CallbackError, RunSummary
from flodl.counting import shown_epoch
from flodl.logs import FILE_ONLY, setup_rank_logging, stderr_kept_in, stderr_to
from flodl.metrics import run_clock
from flodl.metrics.run_info import RunInfo, from_hydra
from flodl.metrics.sinks import METRICS_FILE
from flodl.metrics.wandb_sink import WandbStartError
from flodl.plan import describe
from flodl.preflight import omegaconf_problem, preflight, warn_of_idle_disk_tier
from flodl.resume import agree_on_checkpoint, coordinator_state, load_model, restore_worker
from flodl.run_dir import RunDirTaken, claim_run_dir, release_claimed, run_uid
from flodl.run_identity import run_identity
from flodl.supervisor import SupervisedRankFailure, signal_name, supervise
from flodl.wire.group import agree_on_config, init_group, loopback_store, pick_device, publish_json, read_json
from flodl.wire.heartbeat import HeartbeatSender, Rank0Watch, beat_interval
from flodl.wire.messages import Exiting
from flodl.wire.stop import STOP_EXIT_CODES, Stopped, StopWatch, catch_stop_signals, post, posted, received
from flodl.wire.transport import COORDINATOR, InboxReader, Mailbox
from flodl.worker.nonfinite import NonFiniteError
from flodl.worker.task_setup import build_task, lr_scale_factor

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
    """Hydra callback: every check of `flodl.preflight` before Hydra creates the run dir (a rejected config
    leaves no dir behind), and `plan=true`'s summary, which writes nothing. Hydra turns a callback's
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
    except (ConfigError, RankFailure, WandbStartError, RankZeroFailed) as err:
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
            self_launch(config, info, typed)
    run_clock.record_exit(Path(info.run_dir), launched_at)


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
    everything else flodl/preflight.py checks, in one ConfigError."""
    return preflight(OmegaConf.create(config))


def self_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    """Start the ranks and wait for them. The terminal gets one line of flodl's for a failure or a stop: what
    the ranks, torch's launcher and gloo write to stderr goes to the run dir (each rank's own into its
    rank{N}.log, the rest into .launch/launcher.log)."""
    run_dir = Path(info.run_dir)
    catch_stop_signals()  # a stop while the launcher sets up is a stop too (torch's launcher takes over)
    try:
        with stderr_kept_in(run_dir / ".launch" / "launcher.log"):
            if cfg.fault_tolerance == "survive":
                _supervised_launch(config, info, cfg)
            else:
                _elastic_launch(config, info, cfg)
    except Stopped as stop:
        _say(_stopped_line(stop.signum, cfg, run_dir, info))
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
    # its own, and rank 0 hosts the ranks' store on MASTER_ADDR=127.0.0.1 (flodl/wire/group.py).
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


def _supervised_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    """fault_tolerance=survive: each rank supervised on its own (torch's elastic agent would stop them all
    when one dies); this process hosts the store, which outlives any rank but rank 0's coordinator."""
    run_dir = Path(info.run_dir)
    store = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        supervise(
            self_launched_rank, (config, info.as_dict()), cfg.launch.nproc_per_node, cfg.launch.max_restarts,
            cfg.launch.start_method, store, store.port, run_dir,
        )  # fmt: skip
    except SupervisedRankFailure as err:  # rank 0's end is the job's: only its own record counts
        rank0 = [e for e in err.exits if e.rank == 0][-1]
        deaths = {0: rank0.signal_name} if rank0.signal_name else {}
        recorded = failures.recorded(run_dir, info.uid, 0, rank=0)
        line = _failure_line(
            cfg, run_dir, cfg.launch.nproc_per_node, recorded, deaths, str(err),
            note="fault_tolerance=survive cannot go on without rank 0 (the coordinator)",
        )  # fmt: skip
        raise RankFailure(line) from None


def _failure_line(
    cfg: FlodlConfig,
    run_dir: Path,
    world_size: int,
    recorded: list[failures.Failure],
    deaths: dict[int, str],
    otherwise: str,
    note: str = "",
) -> str:
    """The launcher's line for failed ranks: the one that began it (flodl/failures.py) and its log, or
    `otherwise` when none recorded why and none was killed; `note` on a fault; where the run stands."""
    latest = checkpoint_store(cfg, run_dir).latest()
    where = f"the last checkpoint is {latest.path}" if latest else "no checkpoint was written"
    blamed = failures.blame(recorded, deaths)
    if blamed is None:
        return f"{otherwise}; {where}"
    if note and not blamed.planned:
        where = f"{note}; {where}"
    return failures.verdict(blamed, world_size, where, run_dir)


def _quiet_stops(record: logging.LogRecord) -> bool:
    """The elastic launcher logs a rank that exits 130 / 143 as failed, with a traceback: a stop is not; nor
    is a rank that recorded its failure (EXIT_WORDED: the launcher words it)."""
    err = record.exc_info[1] if record.exc_info else None
    return getattr(err, "exit_code", None) not in {*STOP_EXIT_CODES, EXIT_WORDED}


def run_rank(config: dict[str, Any], info_fields: dict[str, Any], self_launched: bool = False) -> None:
    """The body of every rank, whichever way it was started (plain values only: it may be spawned).
    SIGINT / SIGTERM stop it quietly with exit code 130 / 143. `self_launched`: this process's launcher
    tells the user how the run ended (the rank's own lines about it go to its log only)."""
    catch_stop_signals()
    try:
        _run_rank(config, info_fields, self_launched)
    except Stopped as stop:  # everything worth doing is done, and a preempted job has no seconds to spare
        _leave_now(stop.exit_code)


class RankZeroFailed(RuntimeError):
    """Rank 0 could not start the run (its reason is in the message): every other rank stops with it."""


# Errors whose message says all a user needs (what is wrong, what to do): rank 0 failing to start its
# coordinator with one tells the other ranks why.
_WORDED = (ConfigError, CheckpointError, WandbStartError, CallbackError, RankZeroFailed)
# A self-launched rank's exit code after a failure it recorded and logged (the launcher words it).
EXIT_WORDED = 3
# Where rank 0 says whether its coordinator (and its sinks: W&B) started.
_COORDINATOR_STARTED = "coordinator_started"


def self_launched_rank(config: dict[str, Any], info_fields: dict[str, Any]) -> None:
    """A rank this process's launcher started. Its stderr goes to its log (native code's reports too); a
    failure, recorded and logged with its traceback, ends it with EXIT_WORDED, and the launcher words it."""
    stderr_to(Path(info_fields["run_dir"]) / f"rank{RankEnv.from_environ().rank}.log")
    try:
        run_rank(config, info_fields, self_launched=True)
    except Exception:
        _leave_now(EXIT_WORDED)


def _leave_now(code: int) -> None:
    """Run the exit handlers (logs, stage files) and end the process without the interpreter's teardown of
    torch and gloo, which can take seconds."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(config: dict[str, Any], info_fields: dict[str, Any], self_launched: bool) -> None:
    cfg = to_config(config)
    info = RunInfo(**info_fields)
    env = RankEnv.from_environ()
    run_dir = Path(info.run_dir)
    setup_rank_logging(env.rank, run_dir)
    # Who tells the user how the run ended: a self-launched rank's launcher, the launch in this process for
    # a single rank; ranks torchrun (or a scheduler) started say it themselves.
    failure_extra = None if env.launched and not self_launched else FILE_ONLY
    stop_extra = FILE_ONLY if self_launched else None
    coordinator: Coordinator | None = None
    outbox: Mailbox | None = None
    try:
        device = pick_device(cfg.device, env.local_rank)
        backend = collective_backend(cfg.backend, device.type)
        survive = cfg.fault_tolerance == "survive"
        group = init_group(env, backend, device, cfg.launch.timeout_s, world=not survive)
        log.info(
            "rank %d/%d (pid %d) on %s (%s), master port %s, CUDA_VISIBLE_DEVICES=%s, run dir %s",
            env.rank, env.world_size, os.getpid(), device, backend, group.store_port,
            os.environ.get("CUDA_VISIBLE_DEVICES", "(all)"), run_dir,
        )  # fmt: skip
        namespace = agree_on_config(config, env.rank, env.world_size, group.exchange)

        def connect(owner: int | str) -> Mailbox:
            return Mailbox.connect(group.store_host, group.store_port, namespace, owner, cfg.launch.timeout_s)

        inbox = InboxReader(connect(env.rank))
        survival = make_survival(cfg, env, device, backend, group.exchange, inbox)
        # A restarted rank receives the running group's state when it is admitted, not from a checkpoint.
        joining = survival is not None and survival.joining
        parts = build_task(task_settings(cfg), device, env.world_size, env.rank)
        total_picks = len(parts.train_data) * cfg.augment
        settings = resume_settings(cfg, run_dir, run_identity(config, env.world_size, info.uid))
        checkpoint = agree_on_checkpoint(settings, env.rank, env.world_size, group.exchange)
        if joining:
            checkpoint = None
        if checkpoint is not None:
            load_model(checkpoint, parts.model)
            if checkpoint.epoch + 1 >= cfg.epochs:
                log.info(
                    "checkpoint %s covers all %d epochs: nothing left to train", checkpoint.path, cfg.epochs
                )
                if env.rank == 0:
                    save_model(parts.model, run_dir / MODEL_FILE)
                return

        if env.rank == 0:
            _log_plan(cfg, env.world_size, device.type)
            has_eval = parts.eval_data is not None
            reader = InboxReader(connect(COORDINATOR))
            outbox = connect(COORDINATOR)
            resumed = coordinator_state(checkpoint) if checkpoint is not None else None
            try:
                coordinator = make_coordinator(
                    cfg, config, info, env.world_size, total_picks, has_eval, reader, outbox, resumed,
                    (parts.model, device),
                )  # fmt: skip
            except _WORDED as err:  # the others hear it before they wait for rank 0 in a collective
                # First: the launcher names the first failure's cause.
                failures.record(run_dir, info.uid, env.restart_count, env.rank, err)
                publish_json(group.exchange, _COORDINATOR_STARTED, {"error": f"{type(err).__name__}: {err}"})
                raise
            publish_json(group.exchange, _COORDINATOR_STARTED, {})
            coordinator.start()
        else:
            started = read_json(group.exchange, _COORDINATOR_STARTED)
            if "error" in started:
                raise RankZeroFailed(f"rank 0 could not start the run: {started['error']}")
        outbox = connect(env.rank)
        keeps_evaluated = coordinator is not None and coordinator.hooks.run.keeps_evaluated_models
        worker = make_worker(cfg, parts, env, device, inbox, outbox, run_dir, keeps_evaluated, survival)
        if checkpoint is not None:
            restore_worker(checkpoint, worker)
        interval = beat_interval(heartbeat_timeout_of(cfg))
        heartbeat = HeartbeatSender(env.rank, connect(env.rank), interval, lambda: worker.stepper.steps_total)
        heartbeat.start()
        watch = StopWatch(connect(env.rank))
        watch.start()
        rank0_watch = None
        if env.rank != 0:  # its store client gives up within a beat: the store may live in frozen rank 0
            quick = Mailbox.connect(group.store_host, group.store_port, namespace, env.rank, interval)
            on_hang = functools.partial(_stop_on_hang, run_dir, info.uid, env)
            rank0_watch = Rank0Watch(quick, heartbeat_timeout_of(cfg), interval, on_hang)
            rank0_watch.start()
        try:
            worker.run(alive=lambda: _raise_if_failed(coordinator))
        finally:
            if rank0_watch is not None:
                rank0_watch.stop()
            watch.stop()
            heartbeat.stop()
        if coordinator is not None:
            coordinator.join()
            _raise_if_failed(coordinator)
            save_model(parts.model, run_dir / MODEL_FILE)
            log.info("run dir %s: %s, %s", run_dir, METRICS_FILE, MODEL_FILE)
            _end_run(coordinator, run_dir)
            if coordinator.too_few is not None:  # the consensus is saved: now the run ends, naming why
                raise TooFewRanks(f"{coordinator.too_few}; its consensus is saved as {run_dir / MODEL_FILE}")
    except BaseException as err:
        step = err.step if isinstance(err, NonFiniteError) else None
        planned = isinstance(err, TooFewRanks)
        failures.record(run_dir, info.uid, env.restart_count, env.rank, err, step, planned)
        # A stop signal to this rank, or to a peer (whose leaving is then why this rank failed).
        signum = received() or (posted(outbox) if outbox is not None else None)
        if signum is not None and outbox is not None:
            post(outbox, signum)
        if coordinator is not None:  # it shares this process's store: let it stop before the store goes
            coordinator.stop_requested.set()
            coordinator.join(timeout=10)
        elif outbox is not None:  # tell the coordinator why, so rank 0 stops with this rank's reason
            with contextlib.suppress(Exception):
                outbox.send(COORDINATOR, Exiting(env.rank, f"{type(err).__name__}: {err}"))
        if signum is None:
            name = type(err).__name__
            log.error("rank %d failed: %s: %s", env.rank, name, err, exc_info=True, extra=failure_extra)
            raise
        if env.rank == 0:
            log.warning("%s", _stopped_line(signum, cfg, run_dir, info), extra=stop_extra)
        raise Stopped(signum) from None
    finally:
        if dist.is_initialized():  # survive never forms the world (a dead member would hang its teardown)
            dist.destroy_process_group()


def _stop_on_hang(run_dir: Path, uid: str, env: RankEnv, why: str) -> None:
    """Rank 0 went silent: this rank's training thread waits in a collective with it, so end the process now
    (the launcher stops the others), naming rank 0."""
    log.error("%s; stopping rank %d", why, env.rank)
    failures.record(run_dir, uid, env.restart_count, env.rank, RankHung(why))
    logging.shutdown()
    os._exit(1)


def _end_run(coordinator: Coordinator, run_dir: Path) -> None:
    """Rank 0, once model.pt is written: the run's times for the compare report, then on_run_end."""
    assert coordinator.started_at is not None and coordinator.ended_at is not None
    run_clock.record(
        run_dir, training_started_at=coordinator.started_at, training_ended_at=coordinator.ended_at
    )
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line]
    summary = RunSummary(coordinator.last_epoch, coordinator.stopped, run_dir / MODEL_FILE, records[-1])
    coordinator.hooks.run_end(summary)


def _stopped_line(signum: int, cfg: FlodlConfig, run_dir: Path, info: RunInfo) -> str:
    """Where a stopped run stands and the command that continues it."""
    latest = checkpoint_store(cfg, run_dir).latest()
    if latest is not None:
        where = f"last checkpoint {latest.path} (epoch {shown_epoch(latest.epoch)})"
    else:
        where = "no checkpoint to resume from (checkpoint_every is off or none was due): resume starts over"
    resume = info.resume_command or f"resume=auto hydra.run.dir={run_dir}"
    return f"stopped by {signal.Signals(signum).name}: {where}; resume with: {resume}"


def _log_plan(cfg: FlodlConfig, world_size: int, device_type: str) -> None:
    factor = lr_scale_factor(world_size, cfg.lr_scale_ratio)
    log.info(
        "policy=%s world=%d batch=%s/rank (global %d) lr x%.3g (lr_scale_ratio=%g) precision=%s compile=%s",
        cfg.policy, world_size, step_words(cfg), step_samples(cfg) * world_size, factor,
        cfg.lr_scale_ratio, cfg.precision, compile_mode_for(cfg, device_type, world_size) or "off",
    )  # fmt: skip


def _raise_if_failed(coordinator: Coordinator | None) -> None:
    if coordinator is not None and coordinator.error is not None:
        raise RuntimeError(f"the coordinator failed: {coordinator.error}") from coordinator.error

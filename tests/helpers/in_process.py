"""Ranks as threads: a whole fault_tolerance=none run in the test's process, as torchft tests its Manager.

Each rank is a thread running flodl/job/rank.py's `serve_rank`, the body of every rank: rank 0 hosts the run
(RunHost: the real Coordinator thread, its ledger, driver, sinks and committer), every rank builds its task
and the real worker (`make_worker`: SyncWorker with DDP, or LocalSgdWorker with its averager), and they talk
through mailboxes on a real loopback TCPStore. What differs from a rank's process is what `RankMaking` hands
in: the world is not torch's default process group (one per process) but gloo groups of each rank's own,
built on the store (a second one for the cpu backend's host rounds, as `make_group` makes); a rank's task is
built under a lock, so that its model comes from the seed alone; a fault plan wraps a rank's loss. DDP's
note of the module whose forward runs, a class attribute, is each thread's own.

What the harness cannot cover (a process of its own is the only faithful test of these):
- torch's RNG, numpy's and Python's are the process's: the ranks' own streams (dropout, augmentation, batch
  reads of a map-style Dataset) interleave, so a task that draws per step is not reproducible here;
- signals: no handler is installed (only the main thread may), so stops, Ctrl-C and preemption are not here;
- deaths and freezes (`simulate.kill_*`, `hang_*` stop the whole process): a planned fault raises in the
  rank's thread instead, and its process groups are destroyed as its process would end, so that its peers'
  collectives fail at once as they do when a rank dies;
- a path that ends the process (`end_process`: a silent rank, rank 0 frozen) raises `ProcessExit` in its
  thread;
- launchers, torchrun, survive's supervisor, spawn and fork; DataLoader workers (they are processes);
- logging: the ranks log to `in_process.log` in the run dir, without the [rN] prefix and rank{N}.log;
- timing: the ranks share one interpreter lock, so measured speeds (ElChe's balance) are rougher than apart.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.distributed import PrefixStore, TCPStore
from torch.nn.parallel import DistributedDataParallel

from flodl.config.host import RankEnv
from flodl.config.policy import PolicyFacts, collective_backend
from flodl.config.schema import FlodlConfig, register_configs, to_config
from flodl.coordinator import coordinator as coordinator_module
from flodl.job import failures
from flodl.job import rank_threads as rank_module
from flodl.job.rank import Joined, RankMaking, serve_rank
from flodl.launcher.run_dir import register_resolvers
from flodl.links.group import GroupHandle, agree_on_config, loopback_store
from flodl.links.membership import AveragingGroup
from flodl.links.transport import InboxReader
from flodl.metrics.run_info import RunInfo
from flodl.metrics.timeline import read_timeline
from flodl.worker.group import FixedGroup
from flodl.worker.task_setup import TaskParts, TaskSettings, build_task
from tests.helpers.procs import CONF
from tests.helpers.runs import epochs_of

# The run's keys in the harness's store (a process's rank has flodl/group/<restart>/<n>/ there).
_PREFIX = "flodl/group/in-process/"
# Where flodl ends its process (flodl/links/stop.py's `end_process`, looked up in these modules).
_ENDS_PROCESS = (coordinator_module, rank_module)
# How long a failed rank's process groups may take to go once its thread ended.
_RELEASE_S = 10.0


class InjectedFault(RuntimeError):
    """The fault a plan put in a rank's training step."""


class ProcessExit(RuntimeError):
    """flodl would have ended the whole process here (`end_process`): here only this thread fails."""


@dataclass(frozen=True)
class Fault:
    """A fault in `rank`'s `step`-th training forward (1-based; micro-batches each count, as the loss is
    called for each): it fails with InjectedFault there, as a rank's own error would."""

    rank: int
    step: int

    def strike(self) -> None:
        raise InjectedFault(f"rank {self.rank}: fault injected at step {self.step}")


@dataclass
class RankEnd:
    """How a rank's thread ended: its error (None: it finished), and its model's state and buffers then (a
    finished rank's only; `buffers` also holds those outside the state, registered persistent=False)."""

    rank: int
    error: str | None = None
    state: dict[str, Tensor] | None = None
    buffers: dict[str, Tensor] | None = None


@dataclass
class InProcessRun:
    run_dir: Path
    uid: str
    ranks: list[RankEnd]

    @property
    def records(self) -> list[dict]:
        return epochs_of(self.run_dir)

    @property
    def timeline(self) -> dict[str, Any]:
        return read_timeline(self.run_dir)

    @property
    def log(self) -> str:
        return (self.run_dir / "in_process.log").read_text()

    def blamed(self) -> failures.Failure | None:
        """The failure the launcher would name (flodl/job/failures.py: `blame`)."""
        return failures.blame(failures.recorded(self.run_dir, self.uid, 0), {})

    def model(self) -> dict[str, Tensor]:
        return cast(dict[str, Tensor], torch.load(self.run_dir / "model.pt", weights_only=True))


def compose_config(world: int, *overrides: str) -> dict[str, Any]:
    """flodl's config as the command composes it (conf/, `overrides`) for `world` ranks, resolved."""
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"launch.nproc_per_node={world}", *overrides])
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


class _ThreadWorld(FixedGroup):
    """The fixed world of one thread's rank, over `world` (survive's averaging group, formed once, with every
    rank: gloo built on the store, as no default group is): its averager starts every rank from rank 0's
    state over it, as a process's does over the default group."""

    def __init__(
        self, env: RankEnv, world: AveragingGroup, process_group: dist.ProcessGroup, timeout_s: float
    ) -> None:
        super().__init__(env.rank, env.world_size, process_group, timeout_s)
        self.world = world

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        return self.process_group, "gloo"  # torch knows the backend of its registered groups only

    def share_before_start(self, tensors: list[Tensor]) -> None:
        self.world.broadcast(tensors, 0)


class _Harness:
    def __init__(
        self, cfg: FlodlConfig, config: dict[str, Any], info: RunInfo, world: int, faults: tuple[Fault, ...]
    ):
        self.cfg, self.config, self.info, self.world = cfg, config, info, world
        self.faults = faults
        self.store = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
        self.ends = [RankEnd(rank) for rank in range(world)]
        self.models: dict[int, nn.Module] = {}
        # Each rank's process groups, watched: a failed rank's must go as its process would.
        self.held = dict.fromkeys(range(world), 0)
        self.released = {rank: threading.Event() for rank in range(world)}
        self._refs: list[weakref.ref[dist.ProcessGroup]] = []
        self.unreleased: list[int] = []  # failed ranks whose process groups stayed held (its peers hang)
        self._build_lock = threading.Lock()

    def env(self, rank: int) -> RankEnv:
        port = self.store.port
        return RankEnv(
            rank, self.world, rank, self.world, launched=True, master_addr="127.0.0.1", master_port=port
        )

    def join(self, env: RankEnv) -> Joined:
        """What `_join` does in a process, but for `init_group`: the store joined, no default group."""
        timeout = timedelta(seconds=self.cfg.launch.timeout_s)
        client = TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=timeout)
        group = GroupHandle("127.0.0.1", self.store.port, None, PrefixStore(f"{_PREFIX}exchange/", client))
        agree_on_config(self.config, env.rank, env.world_size, group.exchange)
        device = torch.device("cpu")
        return Joined(device, collective_backend(self.cfg.backend, device.type), group)

    def group_of(
        self,
        cfg: FlodlConfig,
        env: RankEnv,
        device: torch.device,
        backend: str,
        exchange: PrefixStore,
        reader: InboxReader,
    ) -> FixedGroup:
        """The world as this rank's own gloo groups: DDP's (a ProcessGroup), or the averager's, over a group
        apart from the world's for the cpu backend's host rounds (as `make_group` makes it)."""
        world = self._formed(exchange, "world", env, device)
        timeout_s = cfg.launch.timeout_s
        if not PolicyFacts.of(cfg).averages_parameters:
            ddp_group = world.process_group()  # DDP's wrapper holds the gloo group: it must go too
            self._watch(env.rank, ddp_group)
            return _ThreadWorld(env, world, ddp_group, timeout_s)
        rounds = self._formed(exchange, "host_rounds", env, device) if cfg.backend == "cpu" else world
        assert rounds.group is not None
        return _ThreadWorld(env, world, rounds.group, timeout_s)

    def _formed(self, exchange: PrefixStore, name: str, env: RankEnv, device: torch.device) -> AveragingGroup:
        group = AveragingGroup(
            PrefixStore(f"{name}/", exchange), "gloo", env.rank, device, self.cfg.launch.timeout_s
        )
        group.form(0, list(range(env.world_size)))
        assert group.group is not None
        self._watch(env.rank, group.group)
        return group

    def _watch(self, rank: int, group: dist.ProcessGroup) -> None:
        def gone(_: object) -> None:
            self.held[rank] -= 1
            if not self.held[rank]:
                self.released[rank].set()

        self.held[rank] += 1
        self._refs.append(weakref.ref(group, gone))

    def build(self, settings: TaskSettings, device: torch.device, world_size: int, rank: int) -> TaskParts:
        with self._build_lock:  # the seed, then the model: no other rank's draw in between
            parts = build_task(settings, device, world_size, rank)
        planned = [f for f in self.faults if f.rank == rank]
        if planned:
            parts.loss_fn = _faulty(parts.loss_fn, planned)
        self.models[rank] = parts.model
        return parts

    def serve(self, rank: int) -> None:
        env = self.env(rank)
        making = RankMaking(lambda: self.join(env), self.group_of, self.build)
        try:
            serve_rank(self.cfg, self.config, self.info, env, making)
        except BaseException as err:  # its traceback holds the rank's worker: it goes when this block ends
            self.ends[rank].error = f"{type(err).__name__}: {err}"
            self.models.pop(rank, None)
        model = self.models.get(rank)
        if model is not None:
            self.ends[rank].state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.ends[rank].buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        else:
            self._release(rank)

    def _release(self, rank: int) -> None:
        """A failed rank's process groups go, as they do with its process: its peers' collectives fail."""
        released = self.released[rank]
        for _ in range(int(_RELEASE_S / 0.1)):
            gc.collect()  # its worker's cycles (DDP, the averager) hold them
            if released.wait(0.1):
                return
        self.unreleased.append(rank)


def _faulty(
    loss_fn: Callable[[nn.Module, Any], Tensor], planned: list[Fault]
) -> Callable[[nn.Module, Any], Tensor]:
    """`loss_fn`, with the planned faults in its training calls (gradients on: not the FLOP count's)."""
    steps = 0

    def loss(module: nn.Module, batch: Any) -> Tensor:
        nonlocal steps
        if torch.is_grad_enabled():
            steps += 1
            for fault in planned:
                if fault.step == steps:
                    fault.strike()
        return loss_fn(module, batch)

    return loss


def run_in_process(
    run_dir: Path, world: int, *overrides: str, faults: tuple[Fault, ...] = (), timeout_s: float = 120.0
) -> InProcessRun:
    """A `world`-rank run of flodl's config with `overrides` (fault_tolerance=none), its ranks threads of this
    process, `faults` planned; it ends within `timeout_s` (else AssertionError, naming the ranks still on)."""
    config = compose_config(world, f"hydra.run.dir={run_dir}", *overrides)
    cfg = to_config(config)
    assert cfg.fault_tolerance == "none", (
        "the harness runs the fixed world (survive's host is a process apart)"
    )
    info = RunInfo(str(run_dir), "in-process", run_dir.name, uid=uuid.uuid4().hex)
    run_dir.mkdir(parents=True, exist_ok=True)
    harness = _Harness(cfg, config, info, world, faults)
    threads = [
        threading.Thread(target=harness.serve, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)
    ]
    with _one_process(run_dir / "in_process.log"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
    running = [t.name for t in threads if t.is_alive()]
    held = f"failed ranks whose process groups are still held: {harness.unreleased}"
    assert not running, (
        f"{running} still running after {timeout_s:g} s ({held}):\n"
        f"{(run_dir / 'in_process.log').read_text()[-4000:]}"
    )
    assert not harness.unreleased, held
    return InProcessRun(run_dir, info.uid, harness.ends)


@contextlib.contextmanager
def _ddp_forward_per_thread() -> Iterator[None]:
    """DDP notes the module whose forward runs in a class attribute (for torchdynamo), restoring the one it
    found there on the way out. One per process with ranks apart; with ranks as threads, two forwards that
    overlap restore each other's, and the attribute kept a failed rank's DDP, whose gloo pairs then stayed
    open: its peer's all-reduce waited out its timeout (about one sync run in five). Here each thread keeps
    its own."""
    local = threading.local()

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)
    def inside_forward(ddp: DistributedDataParallel) -> Iterator[None]:
        before = getattr(local, "module", None)
        local.module = ddp
        try:
            yield
        finally:
            local.module = before

    def active(_: type) -> DistributedDataParallel | None:
        return getattr(local, "module", None)

    with (
        mock.patch.object(DistributedDataParallel, "_inside_ddp_forward", inside_forward),
        mock.patch.object(DistributedDataParallel, "_get_active_ddp_module", classmethod(active)),
    ):
        yield


@contextlib.contextmanager
def _one_process(log_file: Path) -> Iterator[None]:
    """What the ranks share in this process, for the run: one OpenMP thread (as each of the suite's rank
    processes has), flodl's `end_process` raising ProcessExit where it is called (os._exit itself stays: a
    forked DataLoader worker ends with it, pytest-timeout too), flodl's log in `log_file` (pytest's capture
    would keep each failure's traceback, and with it the failed rank's process groups)."""
    threads = torch.get_num_threads()
    logger = logging.getLogger("flodl")
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
    saved = logger.propagate, logger.level, logger.handlers
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)

    def refuse_exit(code: int) -> None:
        raise ProcessExit(f"flodl would end the process here (exit code {code})")

    torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as ending:
            for module in _ENDS_PROCESS:
                ending.enter_context(mock.patch.object(module, "end_process", refuse_exit))
            ending.enter_context(_ddp_forward_per_thread())
            yield
    finally:
        torch.set_num_threads(threads)
        logger.propagate, logger.handlers = saved[0], saved[2]
        logger.setLevel(saved[1])
        handler.close()

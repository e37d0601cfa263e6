"""Put one rank together for its policy: its group and its worker (the run's coordinator is put together in
flodl/job/coordinator_assembly.py).

The policy's facts are resolved once (flodl/config/policy.py: `PolicyFacts`) and the config is mapped to
each room's settings by flodl/job/settings.py; what is built here takes those, and nothing under it reads
the schema.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import PrefixStore
from torch.nn.parallel import DistributedDataParallel

from flodl.averaging.consensus import DeviceAverager, HostAverager, ReduceGroup
from flodl.averaging.ddp_hooks import SettledBuckets, settled_gradient_hook
from flodl.averaging.flat import rank_own_buffers
from flodl.averaging.outer import OuterSettings
from flodl.averaging.shards import ShardSharers
from flodl.averaging.wire import Wire, wire_for
from flodl.config.host import RankEnv
from flodl.config.layout import Layout
from flodl.config.policy import (
    PolicyFacts,
    checkpoints_on,
    collective_backend,
    heartbeat_timeout_of,
    writes_in_a_process,
    writes_in_background,
)
from flodl.config.schema import FlodlConfig
from flodl.job.settings import (
    checkpoint_store,
    stepper_settings,
    worker_settings,
)
from flodl.links.group import bound_device
from flodl.links.membership import AveragingGroup
from flodl.links.seats import count_start
from flodl.links.transport import InboxReader, Mailbox
from flodl.sharding.fsdp import group_mesh, shard_model
from flodl.sharding.groups import ShardGroups
from flodl.worker.base import RankLink, WorkerBase
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.group import FixedGroup, RankGroup, SurvivingGroup
from flodl.worker.group_evals import GroupEvals
from flodl.worker.group_grads import GroupGradients
from flodl.worker.group_steps import GroupSteps
from flodl.worker.local_sgd import LocalSgdWorker
from flodl.worker.sharded_state import ShardedState
from flodl.worker.stepper import Stepper
from flodl.worker.sync import SyncWorker
from flodl.worker.task_setup import TaskParts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("flodl")

# --- the rank's parts ---


def _ddp(
    cfg: FlodlConfig,
    parts: TaskParts,
    device: torch.device,
    wire: Wire,
    group: dist.ProcessGroup | None = None,
    settle: Callable[[dist.Work], object] | None = None,
) -> DistributedDataParallel:
    """DDP around the model, on `group` (survive: the members' group; None: the world's). `settle`:
    survive over gloo, how the group's collectives are waited for (so that a cut frees a step)."""
    device_ids = [device.index] if device.type == "cuda" else None
    # The cpu backend averages the gradients on the host: DDP over a gloo group, also for CUDA tensors
    # (collective: every rank builds its worker in step). Survive's group is gloo then already.
    if group is None and cfg.backend == "cpu" and device.type == "cuda":
        group = dist.new_group(backend="gloo")
    if own := rank_own_buffers(parts.model):  # float8's maxima seen: not broadcast from rank 0 each step
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(parts.model, own)
    ddp = DistributedDataParallel(
        parts.model, device_ids=device_ids, gradient_as_bucket_view=True, process_group=group
    )
    if settle is not None:
        assert group is not None, "a settled DDP runs on survive's group"
        ddp.register_comm_hook(SettledBuckets(group, settle, wire.bucket_dtype), settled_gradient_hook)
    elif (hook := wire.gradient_hook) is not None:  # bf16 buckets
        ddp.register_comm_hook(group or dist.group.WORLD, hook)
    return ddp


def _sync_module(
    cfg: FlodlConfig,
    parts: TaskParts,
    device: torch.device,
    wire: Wire,
    group: RankGroup,
    shards: ShardGroups,
    rank: int,
) -> nn.Module:
    """What a sync rank trains through in the fixed world: the model sharded in place inside its group over
    the groups' mesh (HSDP: FSDP2's reduce-scatter in the group, all-reduce across), or DDP around it."""
    # On the group's process group: the world's (None) in a process of its own; the in-process harness's
    # ranks, threads of one process, each have their own.
    world = group.collective()[0]
    if shards.sharded:
        assert world is None, "sharded groups run over the world's process group, one process per rank"
        _shard(parts, shards, rank, group_mesh(shards, device.type), "HSDP")
        return parts.model
    return _ddp(cfg, parts, device, wire, world) if shards.world_size > 1 else parts.model


def _surviving_wrap(
    cfg: FlodlConfig,
    parts: TaskParts,
    device: torch.device,
    wire: Wire,
    group: RankGroup,
    shards: ShardGroups,
    rank: int,
) -> Callable[[dist.ProcessGroup], nn.Module] | None:
    """What a sync rank trains through on each group survive forms (None: the fixed world's, `_sync_module`):
    DDP, wrapped again on each; sharded groups: the model sharded in its group once, its gradient shards
    averaged over each group of its shard index."""
    if not isinstance(group, SurvivingGroup):
        return None
    if shards.sharded:
        return _sync_by_groups(parts, shards, rank, device, group)
    # Over gloo DDP's buckets are waited for the way the group's collectives are (a cut frees them).
    gloo = collective_backend(cfg.backend, device.type) == "gloo"
    return functools.partial(_ddp, cfg, parts, device, wire, settle=group.settle if gloo else None)


def _shard(parts: TaskParts, shards: ShardGroups, rank: int, mesh: DeviceMesh, how: str) -> None:
    """The model sharded in place over `mesh` (collective), and the rank's log line saying what it holds."""
    whole = sum(p.numel() for p in parts.model.parameters())
    held = shard_model(parts.model, parts.optimizer, mesh)
    log.info(
        "rank %d: shard %d of group %d (%s over %s): %s of the model's %s parameter elements",
        rank,
        shards.shard_index(rank),
        shards.group_of(rank),
        how,
        shards.words(),
        f"{held:,}",
        f"{whole:,}",
    )


def _shard_averaging(
    parts: TaskParts, shards: ShardGroups, rank: int, device: torch.device, group: RankGroup
) -> ReduceGroup:
    """Local SGD over sharded groups: the model sharded inside the rank's group (FSDP2 over the mesh's
    "shard" dimension: the groups train apart), and who its rounds average its shard with: the ranks of
    the other groups holding the same one (the mesh's "replicate" dimension). Under survive the process's
    world is its group alone (`make_group`) and the surviving group averages per shard index."""
    how = "FSDP2 in the group, rounds per shard index"
    if isinstance(group, SurvivingGroup):
        _shard_in_group(parts, shards, rank, device, how)
        return group
    mesh = group_mesh(shards, device.type)
    _shard(parts, shards, rank, mesh["shard"], how)
    sharers = mesh.get_group("replicate")
    return ShardSharers(sharers, shards.sharers(shards.shard_index(rank))[0], group.timeout_s)


def _shard_in_group(parts: TaskParts, shards: ShardGroups, rank: int, device: torch.device, how: str) -> None:
    """Under survive: the model sharded over the rank's group, its process's world (a 1-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    _shard(parts, shards, rank, init_device_mesh(device.type, (shards.size,)), how)


def _sync_by_groups(
    parts: TaskParts, shards: ShardGroups, rank: int, device: torch.device, group: SurvivingGroup
) -> Callable[[dist.ProcessGroup], nn.Module]:
    """Sync over sharded groups under survive: the model sharded inside the rank's group, each step's gradient
    shards averaged across the groups over the members of its shard index (`GroupGradients`; its `on`, the
    sync worker's wrap, takes each group survive forms), the group's members voting before each step on a
    gloo group of theirs (collective: each forms it in step)."""
    _shard_in_group(parts, shards, rank, device, "FSDP2 in the group, gradients averaged per shard index")
    vote = dist.new_group(backend="gloo", timeout=timedelta(seconds=group.timeout_s))
    return GroupGradients(parts.model, parts.optimizer, vote, group.settle).on


def _group_steps(shards: ShardGroups, group: RankGroup) -> GroupSteps:
    """Async over sharded groups: the vote of the rank's group before each step, on a gloo group of its
    ranks (collective: every rank makes every group's, in step). Under survive the process's world is its
    group alone: the vote is over that world, bounded as its collectives are (a dead member fails it), and
    carries the generation the member formed."""
    if isinstance(group, SurvivingGroup):
        vote = dist.new_group(backend="gloo", timeout=timedelta(seconds=group.timeout_s))
        return GroupSteps(vote, lambda: group.generation)
    mine, _ = dist.new_subgroups_by_enumeration(
        [shards.members(g) for g in range(shards.count)], backend="gloo"
    )
    return GroupSteps(mine)


def make_worker(
    cfg: FlodlConfig,
    parts: TaskParts,
    env: RankEnv,
    device: torch.device,
    reader: InboxReader,
    outbox: Mailbox,
    run_dir: Path,
    group: RankGroup,
    layout: Layout,
    keeps_evaluated_models: bool = False,
) -> WorkerBase:
    """`group`: who the rank trains and averages with (`make_group`). `layout`: the world the run is laid
    out for, as the run's host built it. `keeps_evaluated_models` (rank 0): write the parameters of each
    eval for a callback (BestModel)."""
    rank, world_size = env.rank, env.world_size
    policy = PolicyFacts.of(cfg)
    wire = wire_for(cfg.bf16_wire, cfg.quantized_wire)
    link = RankLink(rank, world_size, reader, outbox)
    settings = worker_settings(cfg, run_dir if keeps_evaluated_models else None)
    shards = ShardGroups(world_size, cfg.shard_group)

    def checkpointer(stepper: Stepper, state: ShardedState) -> RankCheckpointer | None:
        if not checkpoints_on(cfg):
            return None
        store = checkpoint_store(cfg, run_dir)
        process = writes_in_a_process(cfg, device.type)
        sharded = state if shards.sharded else None
        background = writes_in_background(cfg)
        return RankCheckpointer(store, rank, parts.model, stepper, background, process, sharded)

    stepper_for = stepper_settings(
        cfg, env, device.type, first_start=not group.joining and env.restart_count == 0
    )
    if not policy.averages_parameters:
        wrap = _surviving_wrap(cfg, parts, device, wire, group, shards, rank)
        # Under survive the model itself, wrapped on each group; else DDP or HSDP over the fixed world.
        train_module = parts.model if wrap else _sync_module(cfg, parts, device, wire, group, shards, rank)
        stepper = Stepper(stepper_for, parts, device, train_module)
        # HSDP: every group steps one state; under survive each group saves its own (they share no world).
        apart = wrap is not None and shards.sharded
        saver = shards.group_of(rank) if apart else None
        state = ShardedState(parts.model, parts.optimizer, rank, saver, shards.count, apart=apart)
        checkpoints, ratio = checkpointer(stepper, state), cfg.lr_scale_ratio
        synced = SyncWorker(stepper, link, settings, wire, checkpoints, ratio, group, wrap, layout=layout)
        return _reading(synced, state)
    outer = OuterSettings.resolve(cfg.outer, cfg.outer_lr, cfg.outer_momentum, cfg.outer_reset_inner)
    averager: DeviceAverager | HostAverager
    group_steps = None
    rounds: ReduceGroup = group
    if shards.sharded:  # over gloo groups with backend=cpu, also on a GPU
        rounds = _shard_averaging(parts, shards, rank, device, group)
        group_steps = _group_steps(shards, group) if policy.crosses_epochs else None
    if policy.rounds_on_host:
        averager = HostAverager(parts.model, cfg.gamma, device, rounds, wire, outer, shards.size)
    else:
        keeps_own = policy.guarded or policy.blends
        averager = DeviceAverager(parts.model, cfg.gamma, device, wire, outer, keeps_own, rounds, shards.size)
    # Built (and compiled) after the averager re-pointed the parameters into its flat buffers: compiled
    # graphs read them there, so each round's in-place update is what the next step sees.
    stepper = Stepper(stepper_for, parts, device, parts.model)
    own = (shards.group_of(rank), shards.count, averager.outer_momentum)  # the groups train apart
    apart = cfg.fault_tolerance == "survive"  # a process's world is its group: each group saves its own
    state = ShardedState(parts.model, parts.optimizer, rank, *own, apart=apart)
    worker = LocalSgdWorker(
        stepper,
        link,
        settings,
        averager,
        policy.easgd_alpha,
        policy.trains_during_round,
        checkpointer(stepper, state),
        group,
        cfg.overlap_rounds,
        group_steps,
    )
    return _reading(worker, state)


def _reading(worker: WorkerBase, state: ShardedState) -> WorkerBase:
    """`worker`, given what it reads of a checkpoint of sharded groups (any run may resume one)."""
    worker.sharded_state = state
    return worker


def make_group(
    cfg: FlodlConfig,
    env: RankEnv,
    device: torch.device,
    backend: str,
    exchange: PrefixStore,
    reader: InboxReader,
) -> RankGroup:
    """The group this rank trains and averages with, chosen here once. fault_tolerance=none: the world (the
    cpu backend's host rounds over a gloo group of its own, full replicas only, a sharded group's over its
    shard index's: collective, every rank makes it in step). survive: the members' averaging group, formed
    by the worker with every rank, unless this process is a restart (the store counts each rank's starts),
    which joins the running group when admitted."""
    if cfg.fault_tolerance != "survive":
        host_rounds = PolicyFacts.of(cfg).rounds_on_host and cfg.shard_group <= 1
        gloo = dist.new_group(backend="gloo") if host_rounds else None
        return FixedGroup(env.rank, env.world_size, gloo, cfg.launch.timeout_s)
    incarnation = env.incarnation
    if incarnation is None:  # a supervisor numbers its starts; a rank started apart without one, here
        incarnation = count_start(exchange, env.rank)
    # gloo has no abort: its timeout bounds a collective (or a group's forming) that a member left without
    # closing its sockets. NCCL's is aborted instead, and its watchdog must not fire on a slow first round.
    timeout_s = cfg.launch.timeout_s if backend == "nccl" else max(3 * heartbeat_timeout_of(cfg), 10.0)
    shards = ShardGroups(env.world_size, cfg.shard_group)
    rounds, evals = exchange, None
    # Sharded groups: the rank's group is its process's world (FSDP2's collectives), its rounds its shard's;
    # its members vote before an eval on a gloo group of theirs (collective: each forms it in step).
    if shards.sharded:
        _form_shard_group(shards, env.rank, incarnation, backend, exchange, device, timeout_s)
        rounds = PrefixStore(f"shard/{shards.shard_index(env.rank)}/", exchange)
        evals = GroupEvals(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    membership = AveragingGroup(rounds, backend, env.rank, device, timeout_s)
    # A rank whose round failed hears who is still in once the coordinator has seen the silence.
    wait_s = 2 * heartbeat_timeout_of(cfg) + 10
    # A restart, or a rank in a seat past the ones the job started with (flodl-join), joins a running group.
    joining = incarnation > 0 or env.rank >= env.world_size
    return SurvivingGroup(
        membership, reader, env.world_size, incarnation, joining, wait_s, shards.size, evals
    )


def _form_shard_group(
    shards: ShardGroups,
    rank: int,
    incarnation: int,
    backend: str,
    exchange: PrefixStore,
    device: torch.device,
    timeout_s: float,
) -> None:
    """Under survive: this process's world is its sharded group (survive never forms the job's), on a store
    prefix of its own. A rank's death takes the group out whole (the roster cuts its others), so no member
    of it ever waits on a world with a dead rank in it for longer than `timeout_s`; and every process of the
    group starts again once (the dead one's restart, its others' after their cut), so a group's processes
    meet by their incarnation: its restarted ones form a world of their own."""
    dist.init_process_group(
        backend,
        store=PrefixStore(f"sharded/{shards.group_of(rank)}/{incarnation}/", exchange),
        rank=shards.shard_index(rank),
        world_size=shards.size,
        timeout=timedelta(seconds=timeout_s),
        device_id=bound_device(backend, device),
    )

"""What shard_group asks of the job's ranks, and what sharded groups cannot do yet (sharded-groups.md)."""

from __future__ import annotations

from collections.abc import Iterator

from flodl.config.host import HostFacts
from flodl.config.policy import GRAPH_MODES
from flodl.config.rules.problem import problem
from flodl.config.schema import FlodlConfig


def sharding_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    k = cfg.shard_group
    if k <= 1:  # full replicas (below 1: the range's own problem)
        return
    if host.world_size % k:
        yield problem("shard_group", k, f"must divide the job's {host.world_size} ranks into whole groups")
    elif host.ranks_per_node % k:
        yield problem(
            "shard_group",
            k,
            f"each host's {host.ranks_per_node} ranks must form whole groups (a group is {k} consecutive "
            "ranks of one host)",
        )
    if cfg.fault_tolerance == "survive":
        for key, value, why in _surviving_groups(cfg):
            yield problem(key, value, f"not with fault_tolerance=survive and shard_group={k} yet ({why})")
    for key, value, why in _unsharded_only(cfg):
        yield problem(key, value, f"not with shard_group={k} yet ({why}): set shard_group=1 for it")


def _unsharded_only(cfg: FlodlConfig) -> Iterator[tuple[str, object, str]]:
    """Keys a sharded group does not run with yet: what DDP gives a full replica and FSDP2 is not told."""
    if cfg.bf16_wire and cfg.policy == "sync":
        yield (
            "bf16_wire",
            True,
            "under policy=sync: DDP's bf16 buckets; HSDP's gradients travel as float32 (under cadence and "
            "async a round's deltas travel as bf16, shard by shard)",
        )
    if cfg.compile and cfg.compile_mode in GRAPH_MODES:
        why = "CUDA graphs around FSDP2's gathers are not measured; compile_mode=default compiles it"
        yield "compile_mode", cfg.compile_mode, why


def _surviving_groups(cfg: FlodlConfig) -> Iterator[tuple[str, object, str]]:
    """What survive by groups does not do yet: a rank's death takes its group out, the other groups train on,
    and the group comes back whole once its ranks are restarted (docs/survive.md); under sync each step's
    gradient shards are averaged across the groups in (FSDP2 inside a group, torchft's FT-HSDP); a job grows
    by whole groups."""
    if cfg.policy == "sync":
        yield from _sync_by_groups(cfg)
    if cfg.launch.max_ranks is not None and cfg.launch.max_ranks % cfg.shard_group:
        yield (
            "launch.max_ranks",
            cfg.launch.max_ranks,
            f"a job grows by whole groups: make it a multiple of shard_group={cfg.shard_group}",
        )


def _sync_by_groups(cfg: FlodlConfig) -> Iterator[tuple[str, object, str]]:
    """Sync by groups under survive runs with a fixed seat count, each member's step of the job's batch, at a
    precision whose every step the members vote on (docs/sharded-groups.md#under-sync-torchfts-ft-hsdp)."""
    if cfg.keep_global_batch:
        why = "under policy=sync the groups left step their own micro-batches: set keep_global_batch=false"
        yield "keep_global_batch", True, why
    if cfg.precision == "fp16":
        why = "under policy=sync its GradScaler skips a step without the vote on its averaging across groups"
        yield "precision", "fp16", why
    if cfg.launch.max_ranks is not None:
        why = "under policy=sync a job does not grow by groups yet: leave it unset, or set policy=cadence"
        yield "launch.max_ranks", cfg.launch.max_ranks, why

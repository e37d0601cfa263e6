"""What shard_group asks of the job's ranks, and what sharded groups cannot do yet (sharded-groups.md)."""

from __future__ import annotations

from collections.abc import Iterator

from flodl.config.host import HostFacts
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
    if cfg.policy != "sync":
        yield problem(
            "shard_group",
            k,
            f"runs under policy=sync only yet (HSDP), not policy={cfg.policy}: set policy=sync, or "
            "shard_group=1 for cadence and async",
        )
    if cfg.fault_tolerance == "survive":
        yield problem(
            "shard_group",
            k,
            "not with fault_tolerance=survive yet (a group leaving and joining whole is to come): set "
            "fault_tolerance=none, or shard_group=1",
        )
    for key, value, why in _unsharded_only(cfg):
        yield problem(key, value, f"not with shard_group={k} yet ({why}): set shard_group=1 for it")


def _unsharded_only(cfg: FlodlConfig) -> Iterator[tuple[str, object, str]]:
    """Keys a sharded group does not run with yet: what DDP gives a full replica and FSDP2 is not told."""
    if cfg.bf16_wire:
        yield "bf16_wire", True, "DDP's bf16 buckets; a group's gradients travel as float32"
    if cfg.precision == "fp8":
        yield "precision", "fp8", "its scales are kept per rank beside DDP"
    if cfg.compile:
        yield "compile", True, "not measured around FSDP2"

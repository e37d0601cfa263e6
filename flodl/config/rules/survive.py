"""What fault_tolerance=survive cannot do yet, or cannot do under this launcher."""

from __future__ import annotations

from collections.abc import Iterator

from flodl.config.host import HostFacts
from flodl.config.rules.problem import problem
from flodl.config.schema import FlodlConfig


def survive_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    if cfg.fault_tolerance != "survive":
        if cfg.min_ranks != 1:
            yield problem("min_ranks", cfg.min_ranks, "applies to fault_tolerance=survive")
        if cfg.launch.max_ranks is not None:
            yield problem(
                "launch.max_ranks",
                cfg.launch.max_ranks,
                "applies to fault_tolerance=survive (only a surviving job takes ranks while it trains)",
            )
        return
    if cfg.launch.max_ranks is not None and cfg.launch.max_ranks < host.world_size:
        yield problem(
            "launch.max_ranks",
            cfg.launch.max_ranks,
            f"must be at least the {host.world_size} rank(s) the job starts with",
        )
    if cfg.steps_per_epoch is not None:
        yield problem(
            "steps_per_epoch",
            cfg.steps_per_epoch,
            "a stream is not read under fault_tolerance=survive yet: each rank's place in its shard lives in "
            "that rank, and a cut rank's would be lost",
        )
    if not 1 <= cfg.min_ranks <= host.world_size:
        yield problem("min_ranks", cfg.min_ranks, f"must be in [1, {host.world_size}] (the job's ranks)")
    if host.elastic_agent:
        yield problem(
            "fault_tolerance",
            "survive",
            "not under torchrun: its agent stops every rank of its host when one dies, and a survive run is "
            "hosted apart from its ranks; self-launch with launch.nproc_per_node, or start flodl-coordinator "
            "and then each rank on its own (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)",
        )
    if cfg.checkpoint_every_s is not None and cfg.policy == "sync":
        yield problem(
            "checkpoint_every_s",
            cfg.checkpoint_every_s,
            "under policy=sync needs fault_tolerance=none (the members agree on the step through the store, "
            "which a cut member would leave half agreed); with survive use checkpoint_every_steps",
        )

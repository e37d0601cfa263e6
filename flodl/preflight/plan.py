"""`python train.py plan=true ...`: validate, then print what the run would do — and start nothing.

The model is built on the meta device (no memory, no weights) only to count its parameters. Every figure
comes from the function the run itself asks (backend, averaging, staging budgets), given the host's facts
and the data plane settings the assembly maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate

from flodl.averaging.wire import BF16, WIRES, wire_for
from flodl.checkpoints.disk import Checkpoint, CheckpointError, resolve_resume
from flodl.checkpoints.sharded import SHARDED_DIR, regrouped, saved_apart, saved_groups
from flodl.config.host import GIB, HostFacts
from flodl.config.policy import (
    PolicyFacts,
    checkpoints_on,
    collective_backend,
    compile_mode_for,
    heartbeat_timeout_of,
    saves_on_stop,
    step_samples,
    step_words,
    writes_in_a_process,
    writes_in_background,
)
from flodl.config.rules.problem import problem
from flodl.config.schema import FlodlConfig
from flodl.data.feeder import DataPlaneSettings, staging_budgets
from flodl.data.memory import RAM_FRACTION_CAP
from flodl.job.resume import continues_at, resize_of
from flodl.job.settings import checkpoint_store
from flodl.sharding.footprint import TensorBytes, rank_bytes
from flodl.sharding.groups import ShardGroups


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ModelSize:
    params: int
    param_bytes: int
    float32_numel: int  # what a delta wire encodes; the other dtypes travel as they are
    float32_buffer_bytes: int


def model_size(cfg: FlodlConfig) -> ModelSize:
    """The task's model measured on the meta device: no memory, no weights."""
    with torch.device("meta"):
        model = instantiate(cfg.task.model)
    params = [p for p in model.parameters() if p.requires_grad]
    return ModelSize(
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        float32_numel=sum(p.numel() for p in params if p.dtype == torch.float32),
        float32_buffer_bytes=sum(
            b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.float32
        ),
    )


_STATE = "parameters, gradients and optimizer state"


def training_state(cfg: FlodlConfig) -> list[TensorBytes] | None:
    """The model's trainable tensors with the state the task's optimizer keeps for each, measured on the meta
    device after one step there; None: the optimizer does not step there (it then holds its state unseen)."""
    with torch.device("meta"):
        model = instantiate(cfg.task.model)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = instantiate(cfg.task.optimizer)(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    except Exception:  # preflight's probe builds the optimizer and says what fails there
        return None

    def state_bytes(p: torch.Tensor) -> int:  # per element: the optimizer's tensors shaped as `p`
        kept = optimizer.state.get(p, {}).values()
        return sum(t.element_size() for t in kept if torch.is_tensor(t) and t.shape == p.shape)

    return [TensorBytes(tuple(p.shape), p.element_size(), state_bytes(p)) for p in params]


def device_room(cfg: FlodlConfig, host: HostFacts) -> tuple[int, str]:
    """The memory one rank's training state must fit in, and its words: its GPU's (the smallest this host's
    ranks use), its share of it where ranks share the GPUs round-robin (backend=cpu), or its share of this
    host's available RAM."""
    if _uses_gpu(cfg, host):
        gpus = min(host.gpus, host.ranks_per_node)
        sharing = [len(range(i, host.ranks_per_node, gpus)) for i in range(gpus)]  # ranks on each GPU
        props = [torch.cuda.get_device_properties(i) for i in range(gpus)]
        room, i = min((p.total_memory // n, i) for i, (p, n) in enumerate(zip(props, sharing, strict=True)))
        total, name = human_bytes(props[i].total_memory), props[i].name
        if sharing[i] == 1:
            return room, f"the {total} of a {name}"
        return room, f"its {human_bytes(room)} share of a {name} ({total}, {sharing[i]} ranks on it)"
    room = host.available_ram // max(host.ranks_per_node, 1)
    return room, f"its {human_bytes(room)} share of this host's available RAM"


def state_fit_problems(cfg: FlodlConfig, host: HostFacts) -> list[str]:
    """A model whose parameters, gradients and optimizer state alone would not fit one rank's device, sharded
    as shard_group says; the line names the group size that fits, if one of this host's does."""
    tensors = training_state(cfg)
    if tensors is None or host.world_size % cfg.shard_group:  # the rules refused the groups already
        return []
    room, where = device_room(cfg, host)
    held = rank_bytes(tensors, cfg.shard_group)
    if held <= room:
        return []
    sizes = [k for k in range(cfg.shard_group + 1, host.ranks_per_node + 1) if host.ranks_per_node % k == 0]
    fits = next((k for k in sizes if rank_bytes(tensors, k) <= room), None)
    advice = f"shard_group={fits} fits" if fits else "no group of this host's ranks makes it fit"
    rule = f"each rank would hold {human_bytes(held)} of {_STATE}, more than {where}: {advice}"
    return [problem("shard_group", cfg.shard_group, rule)]


def state_line(cfg: FlodlConfig, host: HostFacts) -> str:
    """What each rank holds of the training state, and across which groups."""
    tensors = training_state(cfg)
    groups = ShardGroups(host.world_size, cfg.shard_group)
    if tensors is None:
        held = "not measured (the optimizer does not step on the meta device)"
    elif groups.sharded:
        held = f"{human_bytes(rank_bytes(tensors, groups.size))} (of {human_bytes(rank_bytes(tensors, 1))})"
    else:
        held = human_bytes(rank_bytes(tensors, 1))
    if not groups.sharded:
        return f"  rank state      {held} of {_STATE} per rank (full replicas)"
    if PolicyFacts.of(cfg).averages_parameters:
        across = "each shard averaged across in a round per shard index"
    else:
        across = "gradients all-reduced across (HSDP)"
    return f"  sharded groups  {groups.words()}; FSDP2 in each, {across}; per rank {held} of {_STATE}"


def _uses_gpu(cfg: FlodlConfig, host: HostFacts) -> bool:
    return cfg.device != "cpu" and host.gpus > 0


def compile_words(cfg: FlodlConfig, device_type: str, world: int) -> str:
    """The compile mode the run takes, and why when compile_mode=auto chose it."""
    mode = compile_mode_for(cfg, device_type, world)
    if cfg.compile_mode != "auto":
        return str(mode)
    if mode == "reduce-overhead":
        return "reduce-overhead: auto, CUDA graphs on a GPU"
    if device_type != "cuda":
        return "default: auto, on the CPU"
    return "default: auto, sync over NCCL with several ranks (CUDA graphs not measured there)"


def wire_words(cfg: FlodlConfig, size: ModelSize) -> str:
    """What the compressed wires send instead (the quantized ones only under local SGD), and which is on."""
    compressed = [w for w in WIRES.values() if w.needs_reference]
    wires = compressed if PolicyFacts.of(cfg).averages_parameters else [BF16]
    others = size.param_bytes - 4 * size.float32_numel + size.float32_buffer_bytes
    on = wire_for(cfg.bf16_wire, cfg.quantized_wire)
    return ", ".join(
        f"{human_bytes(wire.payload_bytes(size.float32_numel) + others)} with {wire.key} "
        + ("(on)" if wire == on else "(off)")
        for wire in wires
    )


def describe(cfg: FlodlConfig, host: HostFacts, data: DataPlaneSettings, run_dir: Path | None = None) -> str:
    """`data`: the data plane settings the run would map for this host (flodl/job/assembly.py); `run_dir`:
    the one it would resume in."""
    size = model_size(cfg)
    numel, param_bytes, buffer_bytes = size.params, size.param_bytes, size.float32_buffer_bytes
    world = host.world_size
    uses_gpu = _uses_gpu(cfg, host)
    devices = (
        ", ".join(torch.cuda.get_device_name(i) for i in range(min(host.gpus, host.ranks_per_node)))
        if uses_gpu
        else "CPU"
    )
    if uses_gpu and host.ranks_per_node > host.gpus:
        devices += f" (shared: rank r on cuda:(r mod {host.gpus}), up to "
        devices += f"{-(-host.ranks_per_node // host.gpus)} ranks per GPU)"
    device_type = "cuda" if uses_gpu else "cpu"
    backend = collective_backend(cfg.backend, device_type)
    unit = "averaging round" if PolicyFacts.of(cfg).averages_parameters else "step (DDP gradients)"
    lines = [
        "flodl plan (nothing was started)",
        f"  ranks           {world} in all, {host.ranks_per_node} on this host; devices: {devices}; "
        f"collectives: {backend}",
        f"  model           {numel:,} parameters, {human_bytes(param_bytes)} "
        f"(+{human_bytes(buffer_bytes)} float32 buffers)",
        f"  on the wire     {human_bytes(param_bytes + buffer_bytes)} per rank per {unit}, "
        + wire_words(cfg, size),
        state_line(cfg, host),
        *staging_lines(data, host),
        f"  VRAM budget     {cfg.vram_max_usage:.0%} of each GPU's memory for the data plane, device sample "
        f"pool {'on' if cfg.vram_pool and cfg.debug.data_plane else 'off'}"
        + ("" if uses_gpu else " (no GPU in use)"),
        f"  policy          {cfg.policy} on backend={cfg.backend}, batch {step_words(cfg)}/rank "
        f"(global {step_samples(cfg) * world}), {cfg.epochs} epochs, seed {cfg.seed}",
        f"  step            precision={cfg.precision}, compile="
        + (f"true (mode {compile_words(cfg, device_type, world)})" if cfg.compile else "false"),
    ]
    if PolicyFacts.of(cfg).averages_parameters:
        lines.append(
            f"  local SGD       gamma={cfg.gamma} easgd_alpha={cfg.easgd_alpha} outer={cfg.outer} "
            f"anchor={cfg.anchor} (min {cfg.min_anchor or cfg.anchor}, max {cfg.max_anchor}) "
            f"overhead_target={cfg.overhead_target} max_batch_diff={cfg.max_batch_diff} "
            f"max_overshoot={cfg.max_overshoot or 'auto 3-15'} guard={cfg.divergence_guard}"
            + (f"({cfg.divergence_threshold or 'auto'})" if cfg.divergence_guard == "trend" else "")
            + (" overlap_rounds (each round applied one window late)" if cfg.overlap_rounds else "")
        )
    lines.append(checkpoints_line(cfg, world, device_type))
    lines += resume_lines(cfg, world, run_dir)
    lines.append(faults_line(cfg))
    lines += crowding_lines(host, uses_gpu)
    return "\n".join(lines)


def resume_lines(cfg: FlodlConfig, world: int, run_dir: Path | None) -> list[str]:
    """Where a resumed run continues, and on another world what the resize does (flodl/job/resize.py)."""
    if run_dir is None or cfg.resume == "never":
        return []
    try:
        found = resolve_resume(cfg.resume, checkpoint_store(cfg, run_dir))
    except CheckpointError:  # preflight said why already
        return []
    if found is None:
        return []
    resized = resize_of(found, world, not PolicyFacts.of(cfg).averages_parameters)
    how = resized.words() if resized.changed else f"on the {world} ranks that wrote it"
    how += regroup_words(cfg, world, found)
    return [f"  resume          {found.path}: training continues {continues_at(found)}; {how}"]


def regroup_words(cfg: FlodlConfig, world: int, found: Checkpoint) -> str:
    """Under local SGD, a checkpoint of groups' own optimizer states resumed on other groups: which state
    each group takes (flodl/worker/sharded_state.py); empty otherwise."""
    if not found.sharded or world % cfg.shard_group:  # the world's own problem, said already
        return ""
    path = found.path / SHARDED_DIR
    saved = saved_groups(path)
    groups = ShardGroups(world, cfg.shard_group).count
    if saved is None or saved == tuple(range(groups)):
        return ""
    return f"; {regrouped(saved, groups, saved_apart(path))}"


def crowding_lines(host: HostFacts, uses_gpu: bool) -> list[str]:
    """A warning when this host's ranks outnumber what they run on: they would take turns, not speed up."""
    ranks = host.ranks_per_node
    if uses_gpu and ranks > host.gpus:
        return [f"  warning         {ranks} ranks on this host share its {host.gpus} GPU(s)"]
    if not uses_gpu and host.cpu_cores is not None and ranks > host.cpu_cores:
        return [
            f"  warning         {ranks} ranks on this host share its {host.cpu_cores} CPU core(s): they take "
            f"turns, each slower than alone (launch.nproc_per_node={host.cpu_cores} uses every core once)"
        ]
    return []


def checkpoints_line(cfg: FlodlConfig, world: int, device_type: str) -> str:
    """When checkpoints are taken, how they are written, and what a stop signal does."""
    if not checkpoints_on(cfg):
        return "  checkpoints     off: a stop or a dead rank ends the run where it is (resume starts over)"
    rounds = PolicyFacts.of(cfg).averages_parameters  # local SGD's boundary is a round, sync's a step
    when = [f"every {cfg.checkpoint_every} epoch(s)"] if cfg.checkpoint_every else []
    if cfg.checkpoint_every_steps:
        when.append(f"every {cfg.checkpoint_every_steps} global steps, inside epochs too")
        window = cfg.anchor * world  # ElChe's first window: every rank trains the anchor at least
        if rounds and cfg.checkpoint_every_steps < window:
            when[-1] += (
                f" (shorter than ElChe's first window, {window}+ global steps: each checkpoint ends its "
                "window early, so a round comes at least that often)"
            )
    if cfg.checkpoint_every_s:
        where = "the next round" if rounds else "a step the ranks agree on"
        when.append(f"{cfg.checkpoint_every_s:g} s after the last, at {where}")
    when.append("after the last epoch")
    writer = "by a process" if writes_in_a_process(cfg, device_type) else "on a thread"
    how = "written at the boundary"
    if writes_in_background(cfg):
        how = f"written in the background ({writer} of each rank's own)"
    stop = (
        f"a stop signal saves at the next {'round' if rounds else 'step'} within "
        f"{cfg.stop_grace_s:g} s, then stops"
        if saves_on_stop(cfg)
        else "a stop signal stops at once, naming the last checkpoint"
    )
    return f"  checkpoints     {', '.join(when)}; {how}; {stop}"


def faults_line(cfg: FlodlConfig) -> str:
    """What happens when a rank dies (fault_tolerance) and how soon a silent one is named."""
    if cfg.fault_tolerance == "survive":
        what = (
            f"survive: the others train on without a dead rank (min_ranks={cfg.min_ranks}); a self-launched "
            f"rank restarts alone, up to {cfg.launch.max_restarts} time(s), and is cut the moment it exits"
        )
        if cfg.launch.max_ranks is not None:
            what += f"; up to {cfg.launch.max_ranks} ranks, more joining with flodl-join RUN_DIR"
    else:
        what = "a dead rank ends the job" + (
            f" (self-launched: every rank restarts, up to {cfg.launch.max_restarts} time(s))"
            if cfg.launch.max_restarts
            else ""
        )
    return f"  faults          {what}; a rank silent for {heartbeat_timeout_of(cfg):g} s counts as dead"


def staging_lines(settings: DataPlaneSettings, host: HostFacts) -> list[str]:
    """What the run's data plane will do with the RAM and disk tiers on this host."""
    if not settings.data_plane:
        return ["  data plane      off (debug.data_plane=false): each batch is read and copied in the step"]
    if not settings.stager:
        return ["  staging         off (debug.stager=false): batches are read from the source"]
    budgets = staging_budgets(settings, host.available_ram)
    ranks = settings.ranks_on_host
    if budgets.ram is None:
        ram = "off (sample_cache=false)" if not settings.sample_cache else "off (ram_max_usage=0)"
    else:
        fraction = min(settings.ram_max_usage, RAM_FRACTION_CAP)
        ram = (
            f"{human_bytes(budgets.ram)} per rank = {fraction:.0%} of {host.available_ram / GIB:.1f} GiB "
            f"available / {ranks} rank(s) on this host"
        )
    if budgets.disk is None:
        disk = "off (disk_stage_gb=0)"
    else:
        free = host.stage_dir_free_bytes
        disk = (
            f"{human_bytes(budgets.disk)} per rank x {ranks} rank(s) in {settings.stage_dir} "
            f"({'missing' if free is None else f'{free / GIB:.1f} GiB free'})"
        )
    return [
        f"  RAM tier        {ram}",
        f"  disk tier       {disk}",
        "                  (a stager thread fills both ahead of the read plan; train data already in memory "
        "skips them)",
    ]

"""A rank's model sharded inside its group with FSDP2, over the 2-D device mesh of the job's groups.

`fully_shard` over the mesh (ShardGroups.mesh_shape, MESH_DIMS) is HSDP: each step's gradients are
reduce-scattered inside the group and all-reduced across groups, so every rank steps the mean gradient of the
global batch on its shard, as DDP's replicas do on the whole model. The parameters become DTensors (the
rank's shard of each); the optimizer the task built on the full ones is pointed at them before it holds any
state. Each forward gathers a module's parameters inside the group: every rank of a group must run as many
forwards (the stepper's eval pads a shorter share).

torch's FSDP2, DTensor and checkpoint modules are imported where a model is sharded, not with this module:
their import takes about a second, and every process of a run imports this one (the launcher, each rank, a
restart), sharded or not.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from flodl.sharding.groups import MESH_DIMS, ShardGroups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def group_mesh(groups: ShardGroups, device_type: str) -> DeviceMesh:
    """The job's groups as a 2-D device mesh (MESH_DIMS: across groups, inside one; collective: every rank
    builds it in step). Its "shard" dimension is the rank's group; its "replicate" dimension the ranks that
    hold the rank's shard (`mesh.get_group("replicate")`: the process group local SGD averages it over)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, groups.mesh_shape, mesh_dim_names=MESH_DIMS)


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> int:
    """Shard `model` in place over `mesh` (collective: every rank calls it in step), and point `optimizer`,
    which holds no state yet, at the shards; the parameters' elements this rank holds. The job's whole mesh
    (`group_mesh`) is HSDP: gradients reduce-scattered in the group and all-reduced across groups; its
    "shard" dimension alone is FSDP inside the group, the groups apart (local SGD averages them).

    Each item of the model's ModuleLists (a transformer's blocks) is a unit of its own, gathered for its
    forward and backward alone, then freed; the root holds the rest (embeddings, tied weights, a model
    without a ModuleList whole). No MixedPrecisionPolicy: the parameters are gathered and the gradients
    reduced in float32, and precision=bf16 is the stepper's autocast, as around a replica (the same math)."""
    from torch.distributed.fsdp import fully_shard

    if optimizer.state:
        raise RuntimeError(
            "the optimizer holds state already: a sharded model is built before its first step"
        )
    before = dict(model.named_parameters(remove_duplicate=False))
    for module in units_of(model):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    after = dict(model.named_parameters(remove_duplicate=False))
    sharded = {id(before[name]): after[name] for name in before}
    for group in optimizer.param_groups:
        group["params"] = [sharded[id(p)] for p in group["params"]]
    return sum(cast("DTensor", p).to_local().numel() for p in model.parameters())


def units_of(model: nn.Module) -> list[nn.Module]:
    """The items of the model's ModuleLists (a transformer's blocks), deepest first, holding parameters
    that no module outside them holds too (a weight tied across them stays with the root)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    units = []
    for stack in model.modules():
        if not isinstance(stack, nn.ModuleList):
            continue
        for item in stack:
            inside = {id(m) for m in item.modules()}
            params = list(item.parameters())
            if params and all(id(o) in inside for p in params for o in owners[id(p)]):
                units.append(item)
    return units[::-1]


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded (FSDP2's class exists once a model was: shard_model imported it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def gathered_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole sharded model as CPU tensors, as an unsharded one's state_dict holds them, on the job's rank
    0 (an empty dict on the others). Collective: every rank calls it together.

    Over gloo (backend=cpu: ranks on the CPU, or sharing a GPU) each shard is gathered from the CPU: DTensor's
    gather is a functional collective, which gloo runs on CPU tensors only (on CUDA ones it crashed the rank
    with SIGSEGV on an H100, torch 2.11). Over NCCL, torch's full state dict."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    meshes = {id(t.device_mesh): t.device_mesh for t in state.values() if isinstance(t, DTensor)}
    if not any(dist.get_backend(mesh.get_group(0)) == "gloo" for mesh in meshes.values()):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast("dict[str, Tensor]", get_model_state_dict(model, options=options))
    on_cpu = {key: _on_the_cpu(mesh) for key, mesh in meshes.items()}
    whole = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            local = tensor.to_local().detach().cpu()
            mesh = on_cpu[id(tensor.device_mesh)]
            placed = DTensor.from_local(
                local, mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
            )
            whole[name] = placed.full_tensor()
        else:
            whole[name] = tensor.detach().cpu()
    return whole if dist.get_rank() == 0 else {}


def _on_the_cpu(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh`'s ranks and process groups, for CPU tensors."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    # A 1-D mesh (survive by groups: the process's world) has no dimension names, which a list of groups asks.
    group = groups[0] if mesh.ndim == 1 else groups
    return DeviceMesh.from_group(group, "cpu", mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)


def laid_out_as(param: Tensor, local: Tensor) -> Tensor:
    """`local`, a tensor shaped as this rank holds `param` (its shard, sharded), as the whole tensor it is a
    piece of, laid out as `param` is: a DTensor over `param`'s mesh (sharing `local`'s storage), or `local`
    itself beside a replica's parameter. A checkpoint writes each rank's piece and reads it back in place."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )

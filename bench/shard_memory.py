"""What one rank holds of the training state with the model sharded in groups of k ranks (issue 56's goal: at
most 1/k + 5% of a full replica's), measured after a real step.

`world` gloo ranks on the CPU build a GPT (its head tied to the token embedding), shard it as a flodl run
with shard_group=k does (flodl/sharding/fsdp.py; k = 1: a full replica, as under DDP), take one AdamW step
on random tokens, and count the bytes of their own parameters, gradients and optimizer state (a DTensor's
local shard), beside what plan=true predicts (flodl/sharding/footprint.py). Writes bench/results/.

    python bench/shard_memory.py --world 4 --sizes 1 2 4
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from benchlib import environment_lines, results_path, write_report
from torch import Tensor

from flodl.sharding.footprint import TensorBytes, rank_bytes
from flodl.sharding.fsdp import group_mesh, shard_model
from flodl.sharding.groups import ShardGroups
from flodl.tasks.gpt import GPT

GPT_SHAPE = {"layers": 4, "dim": 256, "heads": 4, "context": 64, "vocab": 8192, "amp": False}


def local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def rank_main(rank: int, world: int, size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(**GPT_SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = ShardGroups(world, size)
    if groups.sharded:
        shard_model(model, optimizer, group_mesh(groups, "cpu"))
    tokens = torch.randint(0, GPT_SHAPE["vocab"], (2, GPT_SHAPE["context"] + 1))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()
    params = list(model.parameters())
    held = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0),
    }
    gathered: list[dict[str, int] | None] = [None] * world
    dist.all_gather_object(gathered, held)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def predicted(size: int) -> int:
    """plan=true's figure: AdamW's two float32 moments beside each float32 parameter and its gradient."""
    with torch.device("meta"):
        params = list(GPT(**GPT_SHAPE).parameters())
    return rank_bytes([TensorBytes(tuple(p.shape), 4, 8) for p in params], size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows, full = [], None
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "held.pt")
            mp.spawn(rank_main, args=(args.world, size, free_port(), out), nprocs=args.world)
            every = torch.load(out)
        totals = [sum(held.values()) for held in every]
        full = full if full is not None else max(totals)
        most = max(totals)
        rows.append(
            f"| {size} | {args.world // size} | {most / 2**20:.2f} | {most / full:.3f} | {1 / size:.3f} | "
            f"{predicted(size) / 2**20:.2f} | "
            + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in max(every, key=lambda h: sum(h.values())).items())
            + " |"
        )
    numel = sum(p.numel() for p in GPT(**GPT_SHAPE).parameters())
    sizes = " ".join(map(str, args.sizes))
    lines = [
        f"## sharded groups: what one rank holds, GPT {numel:,} parameters (tied head), AdamW, "
        f"{args.world} ranks",
        "",
        *environment_lines(cpu=True),
        f"- command: `python bench/shard_memory.py --world {args.world} --sizes {sizes}`",
        "- after one step, each rank's own parameters, gradients and AdamW state (a DTensor's local "
        "shard); the rank holding the most",
        "",
        "| shard_group | groups | MiB per rank | of a full replica | 1/k | plan's figure (MiB) | "
        "of it (MiB) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    write_report(results_path(args.results, "shard-memory", cpu=True), "\n".join(lines))


if __name__ == "__main__":
    main()

"""DDP communication hook for `bf16_wire` under sync: each gradient bucket crosses the wire as bf16.

torch ships the same idea for NCCL only; this one also runs on gloo, so CPU runs and tests take the
same path as GPUs. (No `from __future__ import annotations` here: DDP checks the hook's annotations as
real types.)
"""

import torch
import torch.distributed as dist
from torch.futures import Future


def bf16_gradient_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return reduced.then(decompress)

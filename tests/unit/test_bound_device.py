"""Which worlds bind their GPU at the start (flodl/links/group.bound_device): NCCL's only. A bound gloo world
is split by a device mesh through a copy of its options, which torch cannot make: every sharded-group run of
ranks sharing one GPU over gloo failed at its mesh ("cannot pickle '_Options' object", on an H100)."""

from __future__ import annotations

import torch

from flodl.links.group import bound_device


def test_only_an_nccl_world_on_a_gpu_binds_it():
    gpu = torch.device("cuda", 1)
    assert bound_device("nccl", gpu) == gpu
    assert bound_device("gloo", gpu) is None  # ranks sharing a GPU (backend=cpu)
    assert bound_device("gloo", torch.device("cpu")) is None

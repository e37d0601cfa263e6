"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def solo_group():
    """A one-rank gloo process group: the reducer's code paths without a second process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()

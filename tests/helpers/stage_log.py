"""A log of what a reduce does, in order: the caller's stages and the payload's collectives."""

from __future__ import annotations

import torch

from flodl.averaging.reducer import Reducer


class Recorder:
    """ChunkStages that logs each call as (stage, start of the chunk)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before(self, index: int, span: slice) -> None:
        self.calls.append(("before", span.start))

    def after(self, index: int, span: slice) -> None:
        self.calls.append(("after", span.start))


def logged_wire(reducer: Reducer, stages: Recorder) -> None:
    """Log each collective the reducer launches as ("wire", its storage offset, its length)."""
    launch = reducer._all_reduce

    def logged_launch(tensor: torch.Tensor, factor: float, async_op: bool = False):
        stages.calls.append(("wire", tensor.storage_offset(), tensor.numel()))
        return launch(tensor, factor, async_op)

    reducer._all_reduce = logged_launch

"""The per-chunk work a reduce runs around each chunk's collective (the guard's copy and norms)."""

from __future__ import annotations

from typing import Protocol


class ChunkStages(Protocol):
    """Work done on each chunk `tensor[span]` of the i-th reduced tensor: `before` its reduce is launched
    (what must read the chunk first) and `after` it (on the result)."""

    def before(self, index: int, span: slice) -> None: ...

    def after(self, index: int, span: slice) -> None: ...

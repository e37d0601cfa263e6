"""The planner tests' batches: (epoch, batch index within the epoch), as a dispatched slice names them."""

from __future__ import annotations

from flodl.links.messages import EpochSlice

Batch = tuple[int, int]  # (epoch, batch index within the epoch)


def expand(piece: EpochSlice, batch_size: int) -> list[Batch]:
    assert piece.offset % batch_size == 0, piece
    assert piece.size % batch_size == 0, piece
    assert piece.size > 0, piece
    first = piece.offset // batch_size
    return [(piece.epoch, first + i) for i in range(piece.size // batch_size)]


def all_batches(epochs: int, bpe: int) -> set[Batch]:
    return {(e, b) for e in range(epochs) for b in range(bpe)}


def settled(completed: frozenset[int] | set[int]) -> int:
    """The first epoch not completed: the epochs before it are settled."""
    end = 0
    while end in completed:
        end += 1
    return end

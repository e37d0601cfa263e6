"""How the lines a person reads count epochs: from 1, as the progress bar does (`epoch 5/8` is the fifth of
eight). What programs read keeps the 0-based index: metrics.jsonl's `epoch`, the callbacks' `epoch`
argument, and the names `checkpoints/epoch-NNNNNN` and `evaluated/epoch-NNNNNN.pt`."""

from __future__ import annotations


def shown_epoch(epoch: int) -> int:
    """The number a line shows for the 0-based `epoch`."""
    return epoch + 1

"""Every rank draws its own randomness: a map-style Dataset that draws in `__getitem__` (torch, numpy and
Python generators), 2 gloo ranks under sync. What each rank trained on is logged in order by the loss
(tests/helpers/byo_data.py): the ranks share no draw, a second run with the same seed draws the same per rank
(with DataLoader workers or without), and a run stopped after two epochs and resumed draws in its third
epoch what the uninterrupted run drew."""

from __future__ import annotations

import torch

from flodl.data.streams import SeededIndices, SeededReads, batch_seed, seed_rank_streams
from flodl.worker.task_setup import TaskSettings, build_task
from tests.helpers.byo_data import DrawingPoints


def test_the_model_is_built_alike_on_every_rank_then_each_rank_draws_its_own_stream():
    settings = TaskSettings(
        targets={
            "model": {"_target_": "tests.helpers.byo_data.linear"},
            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
            "scheduler": None,
            "eval_data": None,
            "train_data": {"_target_": "tests.helpers.byo_data.NoisyPoints", "n": 8},
            "cacheable": None,
            "loss": {"_target_": "tests.helpers.byo_data.dict_loss", "_partial_": True},
            "eval_fn": None,
            "transform": None,
            "collate_fn": None,
        },
        seed=7,
        lr_scale_ratio=1.0,
        check_purity=False,
    )
    built = [build_task(settings, torch.device("cpu"), 2, rank) for rank in (0, 1)]
    first_draw = []
    for rank in (0, 1):
        seed_rank_streams(7, rank)  # where build_task left this rank's generators
        first_draw.append(torch.rand(4))
    assert all(torch.equal(a, b) for a, b in zip(*(p.model.parameters() for p in built), strict=True))
    assert not torch.equal(*first_draw)
    build_task(settings, torch.device("cpu"), 2, 1)
    assert torch.equal(torch.rand(4), first_draw[1])


def test_a_batch_read_draws_its_own_stream_and_leaves_the_reader_s_where_it_was():
    reads = SeededReads(DrawingPoints(n=32))
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    batch = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 0, 5)))
    assert torch.equal(torch.rand(3), expected_next)  # the reader's own stream did not move
    again = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 0, 5)))
    other = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 1, 5)))
    assert [s[2] for s in batch] == [s[2] for s in again]
    assert not {s[2] for s in batch} & {s[2] for s in other}

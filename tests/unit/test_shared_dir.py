"""Whether the ranks see the checkpoint dir of the run's host (flodl/job/shared_dir.py): the refusal's line,
pure, and the agreement over a real store with each rank's own view of the dir on disk."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from flodl.checkpoints.disk import CheckpointDir
from flodl.config.rules import ConfigError
from flodl.job.shared_dir import View, agree_on_checkpoint_dir, mark_checkpoint_dir, refusal
from flodl.links.group import loopback_store

KEYS = ["checkpoint_every"]


def test_ranks_that_all_see_the_dir_are_not_refused() -> None:
    assert refusal("/shared/checkpoints", [View(1, True, "/shared/checkpoints")], KEYS) is None
    assert refusal("/shared/checkpoints", [], KEYS) is None


def test_a_rank_that_does_not_see_the_dir_is_named_with_the_keys_that_fix_it() -> None:
    views = [View(1, True, "/a/checkpoints"), View(2, False, "/b/checkpoints")]
    line = refusal("/a/checkpoints", views, ["checkpoint_every", "checkpoint_every_s"])
    assert line is not None
    assert line.startswith(
        "rank 2 does not see the checkpoint dir /a/checkpoints of the run's host (rank 2 looked in "
        "/b/checkpoints)"
    )
    assert "save_path=<a dir on storage every host sees>" in line
    assert line.endswith("run without checkpoints: checkpoint_every=null, checkpoint_every_s=null")


def test_every_rank_that_does_not_see_the_dir_is_named() -> None:
    views = [View(1, False, "/b/checkpoints"), View(2, True, "/a/checkpoints"), View(3, False, "/c/cp")]
    line = refusal("/a/checkpoints", views, KEYS)
    assert line is not None and line.startswith("ranks 1, 3 do not see the checkpoint dir /a/checkpoints")
    assert "(rank 1 looked in /b/checkpoints)" in line


@pytest.fixture
def exchange() -> PrefixStore:
    return PrefixStore("exchange/", loopback_store(0, 1, timedelta(seconds=10)))


def test_a_rank_with_a_dir_of_its_own_is_refused(tmp_path: Path, exchange: PrefixStore) -> None:
    host, own = CheckpointDir(tmp_path / "host0", 2), CheckpointDir(tmp_path / "host1", 2)
    mark = mark_checkpoint_dir(exchange, host)
    assert mark is not None and host.marked(mark) and not own.marked(mark)
    with pytest.raises(ConfigError, match=r"rank 1 does not see the checkpoint dir .*host0/checkpoints"):
        agree_on_checkpoint_dir(exchange, 1, [1], own, KEYS, together=[1])
    assert not own.root.exists()  # looking made nothing


def test_a_rank_that_shares_the_dir_agrees(tmp_path: Path, exchange: PrefixStore) -> None:
    host = CheckpointDir(tmp_path / "shared", 2)
    mark_checkpoint_dir(exchange, host)
    agree_on_checkpoint_dir(exchange, 1, [1], CheckpointDir(tmp_path / "shared", 2), KEYS, [1])


def test_checkpoints_off_check_nothing(tmp_path: Path, exchange: PrefixStore) -> None:
    assert mark_checkpoint_dir(exchange, None) is None
    agree_on_checkpoint_dir(exchange, 1, [1], CheckpointDir(tmp_path / "host1", 2), [], [1])


def test_unmark_leaves_no_empty_dir_but_keeps_checkpoints(tmp_path: Path) -> None:
    checkpoints = CheckpointDir(tmp_path, 2)
    checkpoints.mark(".host-a")
    checkpoints.unmark(".host-a")
    assert not checkpoints.root.exists()  # a fresh start here moves no history aside
    checkpoints.mark(".host-b")
    (checkpoints.root / "epoch-000001").mkdir()
    checkpoints.unmark(".host-b")
    assert [p.name for p in checkpoints.root.iterdir()] == ["epoch-000001"]


def test_a_refusal_waits_until_every_rank_knows_it(tmp_path: Path, exchange: PrefixStore) -> None:
    """Rank 1 refuses first, but leaves only once rank 0 read the refusal too: under torchrun the store may
    go with the first agent whose rank left, and rank 0 would then fail on a lost store instead."""
    mark_checkpoint_dir(exchange, CheckpointDir(tmp_path / "host0", 2))
    own = CheckpointDir(tmp_path / "host1", 2)
    raised: list[BaseException] = []
    server = exchange.underlying_store
    assert isinstance(server, TCPStore)
    # Rank 1's own connection, as a process of its own has (a connection waits for one answer at a time).
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    rank1_exchange = PrefixStore("exchange/", client)

    def rank1() -> None:
        try:
            agree_on_checkpoint_dir(rank1_exchange, 1, [1], own, KEYS, [0, 1])
        except ConfigError as err:
            raised.append(err)

    thread = threading.Thread(target=rank1)
    thread.start()
    exchange.wait(["checkpoint_dir/refused/1"])  # rank 1 knows it refuses...
    assert thread.is_alive() and not raised  # ...and waits for rank 0 to know it
    with pytest.raises(ConfigError, match="rank 1 does not see"):
        agree_on_checkpoint_dir(exchange, 0, [1], CheckpointDir(tmp_path / "host0", 2), KEYS, [0, 1])
    thread.join()
    assert len(raised) == 1 and "rank 1 does not see" in str(raised[0])

"""The seats of a job that grows (flodl/links/seats.py): a joiner takes the lowest free seat past the start's,
never one another joiner holds, and a seat whose rank left is taken again with the next number."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed import HashStore, TCPStore

from flodl.launcher.join_card import JoinError, read_card
from flodl.links.seats import seat_left, take_seat


def test_seats_are_taken_lowest_first_and_again_once_their_rank_left() -> None:
    store = HashStore()
    assert [take_seat(store, 2, 5) for _ in range(3)] == [(2, 0), (3, 0), (4, 0)]
    assert take_seat(store, 2, 5) is None
    seat_left(store, 3, 0)
    assert take_seat(store, 2, 5) == (3, 1)
    seat_left(store, 3, 0)  # an older taking's rank leaving frees nothing: the seat's rank is taking 1's
    assert take_seat(store, 2, 5) is None
    assert take_seat(store, 2, 2) is None, "a job without seats past its start takes no rank"


def test_joiners_at_once_never_share_a_seat() -> None:
    """Eight joiners race for five seats over one real store, each with its own client."""
    server = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=10))

    def join(_: int) -> tuple[int, int] | None:
        client = TCPStore("127.0.0.1", server.port, None, is_master=False, timeout=timedelta(seconds=10))
        return take_seat(client, 1, 6)

    with ThreadPoolExecutor(8) as pool:
        taken = list(pool.map(join, range(8)))
    seats = sorted(t for t in taken if t is not None)
    assert seats == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)], taken
    assert taken.count(None) == 3


def test_a_run_dir_without_a_join_card_is_refused_naming_the_card_and_the_key(tmp_path) -> None:
    with pytest.raises(JoinError, match=r"no \.launch/join\.json.*launch\.max_ranks above its ranks"):
        read_card(tmp_path)

"""Which rank the launcher blames, from the failures the ranks recorded (flodl/job/failures.py), and its
line."""

from __future__ import annotations

from pathlib import Path

from flodl.coordinator.roster import TooFewRanks
from flodl.job.failures import Failure, blame, record, recorded, verdict
from flodl.job.host import HostFailed
from flodl.worker.nonfinite import NonFiniteError


def test_a_rank_killed_without_a_word_is_blamed_over_the_peers_that_lost_it() -> None:
    peer = Failure(0, 10.0, "RuntimeError", "Connection closed by peer")
    assert blame([peer], {1: "SIGKILL"}) == Failure(1, 0.0, "", "", killed_by="SIGKILL")
    # A rank that said why it died is taken at its word, whatever ended its process.
    said = Failure(1, 12.0, "ValueError", "bad batch")
    assert blame([peer, said], {1: "SIGTERM"}) == peer


def test_the_earliest_step_of_a_non_finite_loss_goes_before_the_earliest_record() -> None:
    """Under sync rank 1's NaN is rank 0's a step later, and rank 0 may reach its check first."""
    caught_first = Failure(0, 10.0, "NonFiniteError", "rank 0: ... at step 31", step=31)
    origin = Failure(1, 11.0, "NonFiniteError", "rank 1: ... at step 30", step=30)
    peer_gone = Failure(2, 9.0, "RuntimeError", "Connection reset by peer")
    assert blame([caught_first, origin, peer_gone], {}) == origin
    assert blame([peer_gone, Failure(0, 8.5, "ValueError", "x")], {}).rank == 0  # else the earliest
    assert blame([], {}) is None


def test_a_rank_that_stopped_because_another_failed_is_not_blamed_for_it(tmp_path: Path) -> None:
    """rank 0's W&B failed to start (its process hosts the run); rank 1 heard it and recorded its own stop
    first (a loaded machine ran rank 1 ahead of rank 0's record)."""
    record(tmp_path, "uid", 0, 1, HostFailed("the run's host could not start the run: WandbStartError: ..."))
    record(tmp_path, "uid", 0, 0, ValueError("W&B could not start"))
    found = recorded(tmp_path, "uid", 0)
    assert min(found, key=lambda f: f.time).rank == 1, "rank 1 recorded first"
    assert blame(found, {}).rank == 0
    # When every record follows from another's (the host apart from the ranks failed), the earliest is named.
    assert blame([f for f in found if f.rank == 1], {}).rank == 1


def test_the_line_names_the_rank_its_cause_and_its_log_only_when_one_was_written(tmp_path: Path) -> None:
    where = "no checkpoint was written"
    log = tmp_path / "rank1.log"
    nan = Failure(1, 1.0, "NonFiniteError", "rank 1: NaN at step 30", step=30)
    assert verdict(nan, 2, where, log) == (
        f"rank 1 failed first (NonFiniteError: rank 1: NaN at step 30); {where}; see {log}"
    )
    assert verdict(nan, 1, where, log).startswith("rank 1 failed (NonFiniteError: ")  # no "first" alone
    killed = Failure(1, 0.0, "", "", killed_by="SIGKILL")
    assert verdict(killed, 2, where, log) == f"rank 1 was killed by SIGKILL; {where}; see {log}"
    assert verdict(killed, 2, where, None) == f"rank 1 was killed by SIGKILL; {where}"
    planned = Failure(0, 1.0, "TooFewRanks", "only 1 rank(s) left ([0]); min_ranks=2", planned=True)
    assert verdict(planned, 2, where, log).startswith("only 1 rank(s) left ([0]); min_ranks=2; ")


def test_a_rank_records_its_first_cause_only_and_each_run_and_attempt_its_own(tmp_path: Path) -> None:
    record(tmp_path, "run-a", 0, 1, NonFiniteError("rank 1: the loss\n  became NaN", step=30), step=30)
    record(tmp_path, "run-a", 0, 1, RuntimeError("what followed"))
    record(tmp_path, "run-a", 0, 0, TooFewRanks("only 1 rank(s) left"), planned=True)
    record(tmp_path, "run-a", 1, 1, ValueError("a later attempt"))
    record(tmp_path, "run-b", 0, 1, ValueError("the same dir, resumed"))
    (first,) = recorded(tmp_path, "run-a", 0, rank=1)
    assert (first.error, first.message, first.step) == ("NonFiniteError", "rank 1: the loss became NaN", 30)
    assert {f.rank for f in recorded(tmp_path, "run-a", 0)} == {0, 1}
    assert recorded(tmp_path, "run-a", 0, rank=0)[0].planned
    assert [f.message for f in recorded(tmp_path, "run-b", 0)] == ["the same dir, resumed"]

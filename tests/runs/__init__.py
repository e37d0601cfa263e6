"""Tests that start processes: CLI runs, ranks, launchers (marked multiproc)."""

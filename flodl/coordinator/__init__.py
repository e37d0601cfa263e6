"""Rank 0 only: the coordinator thread, its policy drivers, the epoch ledger and the checkpoint commit."""

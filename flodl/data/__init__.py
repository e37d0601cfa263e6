"""Data plane: datasets that serve whole batches, and the per-epoch partition plan."""

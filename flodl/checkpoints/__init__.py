"""The checkpoint format on disk: checkpoint dirs, their manifest and commit (`disk`), and which run wrote one
(`identity`). Read by every rank and the run's host; no process of its own."""

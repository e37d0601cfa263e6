"""Metrics: `record_scalar`, the ranks' reports aggregated per epoch on rank 0, the sinks they go to
(console, metrics.jsonl, W&B), the run's timeline and its plots."""

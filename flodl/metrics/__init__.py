"""Per-epoch metrics: aggregation on rank 0 and the sinks they go to."""

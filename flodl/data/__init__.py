"""The data plane: datasets that serve whole batches, the per-epoch partition, and the feeder behind each
rank's step (RAM, disk and GPU tiers, the stager, the prefetcher, augment views)."""

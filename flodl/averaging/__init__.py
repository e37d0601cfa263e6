"""Local-SGD averaging: the weighted reduce over flat parameters on the device or host backend, its weights,
the divergence it reports, outer optimizers; and sync's bf16 gradient hook. See docs/architecture.md."""

"""Sharded groups (docs/sharded-groups.md): the world as groups of ranks, the model sharded inside each."""

"""flodl's own Hydra configs (the root config and its groups), shipped as package data."""

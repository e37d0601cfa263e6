"""flodl's own Hydra configs (the root config and its groups): installed as the package `flodl.conf`, which
`@hydra.main` reads as `pkg://flodl.conf` (pyproject.toml maps this folder to it)."""

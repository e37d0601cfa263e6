"""flodl: Hydra-configured data-parallel training on PyTorch."""

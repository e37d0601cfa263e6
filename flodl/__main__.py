"""`python -m flodl` and `torchrun -m flodl`: flodl's command (flodl/cli.py)."""

from flodl.cli import main

main()

"""flodl's command from a checkout: `python train.py ...` is `flodl-train ...` (flodl/cli.py).

python train.py                                   # embedded default, one process
torchrun --nproc_per_node=2 train.py policy=sync  # torchrun starts the ranks
python train.py launch.nproc_per_node=2           # flodl starts the ranks itself
python train.py -m seed=0,1                       # multirun sweep
"""

from flodl.cli import main

if __name__ == "__main__":
    main()

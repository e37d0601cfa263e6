"""flodl's entry point: compose the Hydra config, validate it, hand it to flodl.launch.

python train.py                                   # embedded default, one process
torchrun --nproc_per_node=2 train.py policy=sync  # torchrun starts the ranks
python train.py launch.nproc_per_node=2           # flodl starts the ranks itself
python train.py -m seed=0,1                       # multirun sweep
"""

import hydra
from omegaconf import DictConfig

from flodl.config.schema import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from flodl.launch import launch_from_hydra

    launch_from_hydra(cfg)


if __name__ == "__main__":
    main()

"""The launcher's process, before and around the ranks: Hydra's side of the command (`launch`), survive's
per-rank `supervisor`, the run dir's stamp, owner and uid (`run_dir`), Slurm's variables as torchrun's
(`cluster_env`)."""

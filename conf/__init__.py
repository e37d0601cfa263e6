"""flodl's own Hydra configs (the root config and its groups): installed as the package `flodl.conf`, which
`@hydra.main` reads as `pkg://flodl.conf` (pyproject.toml maps this folder to it).

Importing it registers what the root config names: the schema of its defaults (`flodl_schema`) and the
resolvers of its run dir, so a user's own `initialize_config_module("flodl.conf")` + `compose(...)` works as
the command's does.
"""

from flodl.config.schema import register_configs
from flodl.launcher.run_dir import register_resolvers

register_configs()
register_resolvers()

"""torchtune-offload's recipes, run with ``tune run recipes/<file>.py --config <yaml>``."""

# Read by _torchtune_offload_recipes to tell this directory from torchtune's own `recipes`.
TORCHTUNE_OFFLOAD_RECIPES = True

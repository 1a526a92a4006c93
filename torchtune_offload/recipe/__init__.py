"""What the recipes share, one concept per module, in three rooms and a few modules beside them.

- ``checks/``: what a recipe checks before it loads anything (the config, the files it names,
  whether the run fits the machine), run together by ``preflight``.
- ``checkpoints/``: step checkpoints and resuming, crash-safe saves, the distributed recipe's.
- ``reports/``: memory figures while training, the metrics a run logged, runs side by side.
- Beside them: the chosen optimizer (``chosen_optimizer``) and the loop's one interface to it
  (``run_optimizer``), the builders of ``setup()``, the train loop (which stops a run that
  diverged), exact gradient math, progress, Ctrl-C handling, the shipped recipes and configs.

Each recipe in ``recipes/`` reads top to bottom as calls of these; none copies them.
"""

from torchtune_offload.recipe.builders import (
    build_dataloader,
    build_loss,
    build_lr_scheduler,
    build_metric_logger,
    build_optimizer,
    build_profiler,
    instantiate_model,
    load_checkpoint,
    loss_ignore_index,
)
from torchtune_offload.recipe.checkpoints.atomic_save import save_atomically
from torchtune_offload.recipe.checkpoints.distributed_checkpoints import DistributedCheckpoints
from torchtune_offload.recipe.checkpoints.resume import TrainingCheckpoints, run_output_dir
from torchtune_offload.recipe.checks.config import ConfigError, RecipeSettings, check_recipe_config
from torchtune_offload.recipe.checks.file_checks import check_files
from torchtune_offload.recipe.checks.fit import (
    HostMemoryNeed,
    check_host_memory,
    check_lora_model_fits_device,
    check_weights_fit_device,
    host_memory_need,
)
from torchtune_offload.recipe.checks.optimizer_rules import resolve_optimizer_component
from torchtune_offload.recipe.checks.preflight import preflight
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, OptimizerKind, describe_optimizer
from torchtune_offload.recipe.divergence import TrainingDivergedError
from torchtune_offload.recipe.grad_math import loss_scale, sum_over_ranks
from torchtune_offload.recipe.interrupt import interrupt_reported
from torchtune_offload.recipe.progress import Progress
from torchtune_offload.recipe.reports.disk_log import read_disk_log
from torchtune_offload.recipe.reports.memory import MemoryMonitor, use_expandable_segments
from torchtune_offload.recipe.run_optimizer import (
    HoldingOptimizer,
    InBackwardOptimizers,
    OwnGradientsOptimizer,
    RunOptimizer,
)
from torchtune_offload.recipe.shipped import RECIPE_KINDS, Shipped, shipped_root
from torchtune_offload.recipe.train_loop import SavePoint, TrainLoop, loss_of_logits

__all__ = [
    "ChosenOptimizer",
    "describe_optimizer",
    "ConfigError",
    "DistributedCheckpoints",
    "HoldingOptimizer",
    "HostMemoryNeed",
    "InBackwardOptimizers",
    "MemoryMonitor",
    "check_lora_model_fits_device",
    "check_weights_fit_device",
    "use_expandable_segments",
    "OptimizerKind",
    "OwnGradientsOptimizer",
    "Progress",
    "RECIPE_KINDS",
    "RecipeSettings",
    "RunOptimizer",
    "SavePoint",
    "Shipped",
    "TrainLoop",
    "TrainingCheckpoints",
    "TrainingDivergedError",
    "build_dataloader",
    "build_loss",
    "build_lr_scheduler",
    "build_metric_logger",
    "build_optimizer",
    "build_profiler",
    "check_files",
    "check_host_memory",
    "check_recipe_config",
    "host_memory_need",
    "instantiate_model",
    "interrupt_reported",
    "load_checkpoint",
    "loss_ignore_index",
    "loss_of_logits",
    "loss_scale",
    "preflight",
    "read_disk_log",
    "resolve_optimizer_component",
    "run_output_dir",
    "save_atomically",
    "shipped_root",
    "sum_over_ranks",
]

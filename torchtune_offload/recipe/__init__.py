"""What the recipes share: config checking, the builders of ``setup()``, the train loop, exact
gradient stepping, memory figures, progress, and reading the metrics a run logged.

Each recipe in ``recipes/`` reads top to bottom as calls of these; none copies them.
"""

from torchtune_offload.recipe.atomic_save import save_atomically
from torchtune_offload.recipe.builders import (
    build_dataloader,
    build_loss,
    build_lr_scheduler,
    build_metric_logger,
    build_optimizer,
    close_optimizer,
    build_profiler,
    instantiate_model,
    load_checkpoint,
    optimizer_state,
    steps_per_epoch,
)
from torchtune_offload.recipe.config import RecipeSettings, check_recipe_config, resolve_optimizer_component
from torchtune_offload.recipe.disk_log import read_disk_log
from torchtune_offload.recipe.file_checks import check_files
from torchtune_offload.recipe.host_preflight import HostMemoryNeed, check_host_memory, host_memory_need
from torchtune_offload.recipe.grad_math import GradientStepper, loss_scale, sum_over_ranks
from torchtune_offload.recipe.memory import MemoryMonitor
from torchtune_offload.recipe.progress import Progress
from torchtune_offload.recipe.resume import TrainingCheckpoints
from torchtune_offload.recipe.train_loop import TrainLoop

__all__ = [
    "GradientStepper",
    "HostMemoryNeed",
    "MemoryMonitor",
    "Progress",
    "RecipeSettings",
    "TrainLoop",
    "TrainingCheckpoints",
    "build_dataloader",
    "build_loss",
    "build_lr_scheduler",
    "build_metric_logger",
    "build_optimizer",
    "close_optimizer",
    "build_profiler",
    "check_files",
    "check_host_memory",
    "check_recipe_config",
    "host_memory_need",
    "instantiate_model",
    "load_checkpoint",
    "loss_scale",
    "optimizer_state",
    "read_disk_log",
    "resolve_optimizer_component",
    "save_atomically",
    "steps_per_epoch",
    "sum_over_ranks",
]

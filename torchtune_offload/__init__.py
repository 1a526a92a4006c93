"""Optimizer CPU offload for torchtune, with the exact math of plain optimizers.

- :class:`OffloadOptimizer`: this project's engine; any device, gradient accumulation with
  offloaded gradients, clipping, named checkpoints.
- :class:`CPUOffloadOptimizer`: torchao's implementation, configurable from YAML (CUDA/XPU only).

The package has one folder per concern, each importing only the ones listed before it:
``optim`` (the engine), ``models`` (tiny test architectures), ``data`` (synthetic benchmark data),
``distributed`` (FSDP2 sharding), ``assets`` (the offline asset generator), ``recipe`` (what the
recipes share), ``bench`` (the optimizer sweep).
"""

from torchtune_offload.optim import (
    CPUOffloadOptimizer,
    OffloadMemoryReport,
    OffloadOptimizer,
    resolve_optimizer_class,
)

__all__ = [
    "CPUOffloadOptimizer",
    "OffloadMemoryReport",
    "OffloadOptimizer",
    "resolve_optimizer_class",
]

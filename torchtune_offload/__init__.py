"""Optimizer CPU offload for torchtune, with the exact math of plain optimizers.

- :class:`OffloadOptimizer`: this project's engine; any device, gradient accumulation with
  offloaded gradients, clipping, named checkpoints.
- :class:`CPUOffloadOptimizer`: torchao's implementation, configurable from YAML (CUDA/XPU only).
"""

from torchtune_offload.ao_offload import CPUOffloadOptimizer
from torchtune_offload.offload_optimizer import OffloadMemoryReport, OffloadOptimizer
from torchtune_offload.optimizer_class import resolve_optimizer_class

__all__ = [
    "CPUOffloadOptimizer",
    "OffloadMemoryReport",
    "OffloadOptimizer",
    "resolve_optimizer_class",
]

"""Optimizer CPU offload for torchtune, with the exact math of plain optimizers.

- :class:`OffloadOptimizer`: this project's engine; any device, gradient accumulation with
  offloaded gradients, clipping, named checkpoints.
- :class:`CPUOffloadOptimizer`: torchao's implementation, configurable from YAML (CUDA/XPU only).
- :class:`AdamW8bit`: AdamW with 8-bit states in bitsandbytes' format, a fused host step; a base
  optimizer for :class:`OffloadOptimizer` at 6 bytes of host memory per bf16 parameter.

The package has one folder per concern, each importing only the ones listed before it:
``optim`` (the engine), ``models`` (tiny test architectures), ``data`` (synthetic benchmark data),
``distributed`` (FSDP2 sharding), ``assets`` (the offline asset generator), ``recipe`` (what the
recipes share), ``bench`` (the optimizer sweep), ``plan`` (the memory planner), ``cli``
(``tune-offload``). docs/architecture.md has the floors and who owns what.
"""

from torchtune_offload.optim import (
    AdamW8bit,
    CPUOffloadOptimizer,
    OffloadMemoryReport,
    OffloadOptimizer,
    resolve_optimizer_class,
)

__all__ = [
    "AdamW8bit",
    "CPUOffloadOptimizer",
    "OffloadMemoryReport",
    "OffloadOptimizer",
    "resolve_optimizer_class",
]

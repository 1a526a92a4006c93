"""The offload engine: optimizers that step on the host, and what they are built from.

- :class:`OffloadOptimizer` (``offload_optimizer``): this project's engine.
- :class:`CPUOffloadOptimizer` (``ao_offload``): torchao's, configurable from YAML.
- :class:`AdamW8bit` (``adamw8bit``): AdamW with 8-bit states in bitsandbytes' format, fused on the host.
- ``transfer``: host/device copies; ``grad_norm``: norms and clipping across devices;
  ``optimizer_class``: the ``optimizer_class`` option; ``capabilities``: what each optimizer can
  do; ``memory_report``: the figures an offload optimizer reports.
"""

from torchtune_offload.optim.adamw8bit import AdamW8bit
from torchtune_offload.optim.ao_offload import CPUOffloadOptimizer
from torchtune_offload.optim.capabilities import OptimizerCapabilities, capabilities_of
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.optim.optimizer_class import resolve_optimizer_class

__all__ = [
    "AdamW8bit",
    "CPUOffloadOptimizer",
    "OffloadMemoryReport",
    "OffloadOptimizer",
    "OptimizerCapabilities",
    "capabilities_of",
    "resolve_optimizer_class",
]

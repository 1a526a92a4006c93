"""Preloaded by a zygote in tests/test_zygote.py: torch reports CUDA initialized, as it does on a CUDA
machine once torchtune is imported (``torchtune.utils._import_guard`` asks for the device's capability)."""

import torch

torch.cuda.is_initialized = lambda: True

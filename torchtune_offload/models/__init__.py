"""Tiny test architectures: torchtune Llama builders at shapes that train in seconds on a CPU."""

from torchtune_offload.models.tiny import TINY_LLAMA_DEFAULTS, lora_tiny_llama, tiny_llama

__all__ = ["TINY_LLAMA_DEFAULTS", "lora_tiny_llama", "tiny_llama"]

"""Test and benchmark architectures: torchtune Llama builders at shapes that train on a CPU."""

from torchtune_offload.models.mid import llama3_2_mid, lora_llama3_2_mid, qlora_llama3_2_mid
from torchtune_offload.models.tiny import TINY_LLAMA_DEFAULTS, lora_tiny_llama, tiny_llama

__all__ = ["TINY_LLAMA_DEFAULTS", "llama3_2_mid", "lora_llama3_2_mid", "lora_tiny_llama", "qlora_llama3_2_mid", "tiny_llama"]

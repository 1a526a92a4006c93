"""A mid-size Llama 3.2 for benchmarks that must run on a CPU: the real architecture, narrower.

Llama 3.2's vocabulary, tied embedding, grouped-query attention and RoPE scaling (torchtune's own
``llama3_2`` component builder), at a width and depth that make 78M parameters: enough that the
optimizer step and the embedding's memory matter as in the real models, small enough for a sweep
of several optimizers in minutes on two cores. Random-init checkpoints come from
``python -m torchtune_offload.assets --real-arch llama3_2_mid``; its LoRA and QLoRA variants load
the same checkpoint (their adapters start from their own init), and every linear it quantises has
a multiple of 64 x 256 elements, as torchao's NF4 blocks need.
"""

from typing import List

from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
from torchtune.modules import TransformerDecoder

__all__ = ["llama3_2_mid", "lora_llama3_2_mid", "qlora_llama3_2_mid"]

_MID = dict(vocab_size=128_256, num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=512, max_seq_len=2048,
            intermediate_dim=1536, rope_base=500_000, scale_factor=32)


def llama3_2_mid() -> TransformerDecoder:
    """Llama 3.2 at width 512 and depth 4 (78M parameters, 66M of them the tied embedding).

    Returns:
        A ``TransformerDecoder`` that loads ``LLAMA3_2``-type Hugging Face checkpoints of its shapes.
    """
    return llama3_2(**_MID)


def lora_llama3_2_mid(
    *,
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`llama3_2_mid` with LoRA adapters, for the LoRA recipe.

    Args:
        lora_attn_modules: attention projections that get adapters (``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``).
        apply_lora_to_mlp: also adapt the feed-forward projections.
        apply_lora_to_output: accepted for the LoRA configs' sake; the output is the tied
            embedding, which torchtune's Llama 3.2 does not adapt.
        lora_rank: rank of each adapter.
        lora_alpha: adapter scaling numerator (scale is ``alpha / rank``).
        lora_dropout: dropout on the adapter path.
        quantize_base: keep the frozen base linears in NF4 (QLoRA).

    Returns:
        A ``TransformerDecoder`` whose base weights load from the ``llama3_2_mid`` checkpoint.
    """
    return lora_llama3_2(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                         apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         lora_dropout=lora_dropout, quantize_base=quantize_base, **_MID)


def qlora_llama3_2_mid(
    *,
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
) -> TransformerDecoder:
    """:func:`lora_llama3_2_mid` with NF4 base weights (QLoRA), as torchtune's ``qlora_*`` builders.

    Args:
        lora_attn_modules: see :func:`lora_llama3_2_mid`.
        apply_lora_to_mlp: see :func:`lora_llama3_2_mid`.
        apply_lora_to_output: see :func:`lora_llama3_2_mid`.
        lora_rank: see :func:`lora_llama3_2_mid`.
        lora_alpha: see :func:`lora_llama3_2_mid`.
        lora_dropout: see :func:`lora_llama3_2_mid`.

    Returns:
        A ``TransformerDecoder`` whose frozen linears hold torchao ``NF4Tensor`` weights.
    """
    return lora_llama3_2_mid(lora_attn_modules=lora_attn_modules, apply_lora_to_mlp=apply_lora_to_mlp,
                             apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank,
                             lora_alpha=lora_alpha, lora_dropout=lora_dropout, quantize_base=True)

"""Tiny Llama-architecture model builders for fast, offline CPU runs.

The configs under ``configs/tiny/`` point their ``model._component_`` here, and
``torchtune_offload.assets`` imports :data:`TINY_LLAMA_DEFAULTS` so that the
random checkpoint it writes always has exactly the shapes these builders build.
Change a default here and rebuild the assets with ``--force``; nothing else
needs editing.

Both builders are thin wrappers over torchtune's own Llama3 component builders,
so the resulting modules (and their state-dict keys) are the ones the real
recipes, checkpointers and LoRA utilities already understand.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import List, Mapping, Union

from torchtune.models.llama3 import llama3, lora_llama3
from torchtune.modules import TransformerDecoder

__all__ = ["TINY_LLAMA_DEFAULTS", "tiny_llama", "lora_tiny_llama"]

# Read-only so an importer cannot silently change the shapes for everyone else.
# vocab_size must equal the tiny tokenizer's vocabulary (base BPE ranks plus the
# Llama3 special tokens placed right after them); the asset generator checks this.
TINY_LLAMA_DEFAULTS: Mapping[str, Union[int, float]] = MappingProxyType(
    {
        "vocab_size": 512,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 64,
        "intermediate_dim": 192,
        "max_seq_len": 256,
        "norm_eps": 1e-5,
        "rope_base": 10_000,
    }
)

_D = TINY_LLAMA_DEFAULTS


def tiny_llama(
    *,
    vocab_size: int = _D["vocab_size"],
    num_layers: int = _D["num_layers"],
    num_heads: int = _D["num_heads"],
    num_kv_heads: int = _D["num_kv_heads"],
    embed_dim: int = _D["embed_dim"],
    intermediate_dim: int = _D["intermediate_dim"],
    max_seq_len: int = _D["max_seq_len"],
    norm_eps: float = _D["norm_eps"],
    rope_base: int = _D["rope_base"],
) -> TransformerDecoder:
    """Build the tiny Llama3-architecture decoder used by ``configs/tiny/``.

    Args:
        vocab_size: Number of token embeddings and output logits.
        num_layers: Number of transformer blocks.
        num_heads: Number of query heads.
        num_kv_heads: Number of key/value heads (grouped-query attention).
        embed_dim: Model width; ``embed_dim // num_heads`` is the head size.
        intermediate_dim: Hidden width of the SwiGLU feed-forward block.
        max_seq_len: Longest sequence the RoPE cache is built for.
        norm_eps: Epsilon of the RMS norms.
        rope_base: RoPE base frequency.

    Returns:
        An untied-embedding ``TransformerDecoder`` whose weights load from the
        ``LLAMA3``-type Hugging Face checkpoint written by
        ``python -m torchtune_offload.assets``.
    """
    return llama3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        attn_dropout=0.0,
        rope_base=rope_base,
        intermediate_dim=intermediate_dim,
        norm_eps=norm_eps,
    )


def lora_tiny_llama(
    *,
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    vocab_size: int = _D["vocab_size"],
    num_layers: int = _D["num_layers"],
    num_heads: int = _D["num_heads"],
    num_kv_heads: int = _D["num_kv_heads"],
    embed_dim: int = _D["embed_dim"],
    intermediate_dim: int = _D["intermediate_dim"],
    max_seq_len: int = _D["max_seq_len"],
    norm_eps: float = _D["norm_eps"],
    rope_base: int = _D["rope_base"],
) -> TransformerDecoder:
    """Build :func:`tiny_llama` with LoRA adapters, for the LoRA recipe.

    The base weights have the same names and shapes as :func:`tiny_llama`, so
    the same tiny checkpoint loads into it (adapters start from their own init).

    Args:
        lora_attn_modules: Attention projections that get adapters; any of
            ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp: Also adapt the feed-forward projections.
        apply_lora_to_output: Also adapt the final vocabulary projection.
        lora_rank: Rank of each adapter.
        lora_alpha: Adapter scaling numerator (scale is ``alpha / rank``).
        lora_dropout: Dropout applied on the adapter path.
        use_dora: Use DoRA (magnitude-decomposed) adapters instead of LoRA.
        quantize_base: Store frozen base linears in NF4 (QLoRA).
        vocab_size: See :func:`tiny_llama`.
        num_layers: See :func:`tiny_llama`.
        num_heads: See :func:`tiny_llama`.
        num_kv_heads: See :func:`tiny_llama`.
        embed_dim: See :func:`tiny_llama`.
        intermediate_dim: See :func:`tiny_llama`.
        max_seq_len: See :func:`tiny_llama`.
        norm_eps: See :func:`tiny_llama`.
        rope_base: See :func:`tiny_llama`.

    Returns:
        A ``TransformerDecoder`` with LoRA modules in place of the chosen linears.
    """
    return lora_llama3(
        lora_attn_modules=list(lora_attn_modules),
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        intermediate_dim=intermediate_dim,
        attn_dropout=0.0,
        norm_eps=norm_eps,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )

"""A mid-size Llama 3.2 for benchmarks that must run on a CPU: the real architecture, narrower.

Llama 3.2's vocabulary, tied embedding, grouped-query attention and RoPE scaling (torchtune's own
``llama3_2`` component builder), at a width and depth that make 78M parameters: enough that the
optimizer step and the embedding's memory matter as in the real models, small enough for a sweep
of several optimizers in minutes on two cores. Random-init checkpoints come from
``python -m torchtune_offload.assets --real-arch llama3_2_mid``.
"""

from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerDecoder

__all__ = ["llama3_2_mid"]


def llama3_2_mid() -> TransformerDecoder:
    """Llama 3.2 at width 512 and depth 4 (78M parameters, 66M of them the tied embedding).

    Returns:
        A ``TransformerDecoder`` that loads ``LLAMA3_2``-type Hugging Face checkpoints of its shapes.
    """
    return llama3_2(
        vocab_size=128_256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        embed_dim=512,
        max_seq_len=2048,
        intermediate_dim=1536,
        rope_base=500_000,
        scale_factor=32,
    )

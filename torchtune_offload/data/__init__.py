"""Datasets this project ships: random token sequences for benchmarks that need no download."""

from torchtune_offload.data.synthetic import SyntheticTokens, synthetic_dataset

__all__ = ["SyntheticTokens", "synthetic_dataset"]

"""Random token sequences of one fixed length, reproducible from a seed.

Benchmarks of real architectures (random-init checkpoints from ``python -m torchtune_offload.assets
--real-arch ...``) need batches of the right shape, not meaningful text: this dataset gives them with
no tokenizer file or dataset download beyond the tokenizer the config already names. From a config::

    dataset:
      _component_: torchtune_offload.data.synthetic_dataset
      seq_len: 2048
      num_samples: 1024
"""

from typing import Any, Dict, List, Optional

import numpy as np
from torch.utils.data import Dataset

class SyntheticTokens(Dataset):
    """``num_samples`` sequences of ``seq_len`` token ids drawn uniformly from ``[0, vocab_size)``.

    Sample ``i`` depends only on ``seed`` and ``i`` (not on the order samples are read), and its
    labels are its tokens: the recipes' loss shifts them, as for any SFT sample.

    Args:
        seq_len: Tokens per sample.
        num_samples: Samples in the dataset (one epoch).
        vocab_size: Ids are drawn below this.
        seed: Seed of the data; sample ``i`` is drawn from numpy's generator seeded with ``(seed, i)``.
    """

    def __init__(self, *, seq_len: int, num_samples: int, vocab_size: int, seed: int = 0) -> None:
        for key, value in (("seq_len", seq_len), ("num_samples", num_samples), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dataset.{key} must be a positive integer, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"dataset.seed must be a non-negative integer, got {seed!r}")
        self.seq_len, self.num_samples, self.vocab_size, self.seed = seq_len, num_samples, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a synthetic dataset of {self.num_samples}")
        # A seed sequence of (seed, index) mixes both fully (torch's CPU generator keeps 32 bits of a seed).
        tokens = np.random.default_rng((self.seed, index)).integers(self.vocab_size, size=self.seq_len).tolist()
        return {"tokens": tokens, "labels": list(tokens)}


def synthetic_dataset(
    tokenizer: Any,
    *,
    seq_len: int,
    num_samples: int,
    vocab_size: Optional[int] = None,
    seed: int = 0,
    packed: bool = False,
) -> SyntheticTokens:
    """The config builder of :class:`SyntheticTokens` (``dataset._component_``).

    Args:
        tokenizer: The config's tokenizer; its ``vocab_size`` is the default ``vocab_size``.
        seq_len: Tokens per sample (every sample is this long, so no padding and no packing).
        num_samples: Samples in one epoch; steps per epoch are ``num_samples // batch_size //
            gradient_accumulation_steps``.
        vocab_size: Draw ids below this (default: the tokenizer's vocabulary size). Must not exceed
            the model's vocabulary.
        seed: Seed of the data.
        packed: Must stay False: samples are already ``seq_len`` long.

    Returns:
        The dataset.

    Raises:
        ValueError: On a non-positive size, ``packed=True``, or no vocabulary size to use.
    """
    if packed:
        raise ValueError("dataset.packed=True: synthetic samples are already seq_len tokens long. "
                         "Set dataset.packed=False.")
    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is None:
            raise ValueError(f"dataset.vocab_size is not set and the tokenizer ({type(tokenizer).__name__}) "
                             "has no vocab_size. Set dataset.vocab_size.")
    return SyntheticTokens(seq_len=seq_len, num_samples=num_samples, vocab_size=vocab_size, seed=seed)

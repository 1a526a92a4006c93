"""The synthetic benchmark dataset: fixed length, reproducible per sample, usable from a config."""

import pytest
import torch
from torchtune.data import padded_collate_sft

from torchtune_offload.data import SyntheticTokens, synthetic_dataset


class _Tokenizer:
    vocab_size = 512


def test_samples_are_fixed_length_in_range_and_labels_are_tokens():
    ds = synthetic_dataset(_Tokenizer(), seq_len=64, num_samples=10)
    assert len(ds) == 10
    for i in range(10):
        sample = ds[i]
        assert len(sample["tokens"]) == 64 and sample["labels"] == sample["tokens"]
        assert 0 <= min(sample["tokens"]) and max(sample["tokens"]) < 512
    batch = padded_collate_sft([ds[0], ds[1]], padding_idx=0, ignore_idx=-100)
    assert batch["tokens"].shape == (2, 64)


def test_a_sample_depends_only_on_seed_and_index():
    a = SyntheticTokens(seq_len=32, num_samples=5, vocab_size=1000, seed=3)
    b = SyntheticTokens(seq_len=32, num_samples=5, vocab_size=1000, seed=3)
    assert [a[i] for i in (4, 0, 2)] == [b[i] for i in (4, 0, 2)]
    assert a[0] != a[1]
    assert a[0] != SyntheticTokens(seq_len=32, num_samples=5, vocab_size=1000, seed=4)[0]
    # Roughly uniform ids: every id of a small vocabulary appears in a long sample.
    assert set(SyntheticTokens(seq_len=4000, num_samples=1, vocab_size=16)[0]["tokens"]) == set(range(16))


def test_vocab_size_overrides_the_tokenizers():
    ds = synthetic_dataset(_Tokenizer(), seq_len=2000, num_samples=1, vocab_size=8)
    assert max(ds[0]["tokens"]) < 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=0, num_samples=1), "dataset.seq_len"),
    (dict(seq_len=4, num_samples=-1), "dataset.num_samples"),
    (dict(seq_len=4, num_samples=1, vocab_size=True), "dataset.vocab_size"),
    (dict(seq_len=4, num_samples=1, seed=-1), "dataset.seed"),
    (dict(seq_len=4, num_samples=1, packed=True), "dataset.packed=False"),
])
def test_bad_options_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_dataset(_Tokenizer(), **kwargs)


def test_a_tokenizer_without_vocab_size_needs_the_key():
    with pytest.raises(ValueError, match="Set dataset.vocab_size"):
        synthetic_dataset(object(), seq_len=4, num_samples=1)


def test_index_out_of_range():
    with pytest.raises(IndexError):
        SyntheticTokens(seq_len=4, num_samples=2, vocab_size=8)[2]
    assert torch.tensor(SyntheticTokens(seq_len=4, num_samples=2, vocab_size=8)[1]["tokens"]).numel() == 4

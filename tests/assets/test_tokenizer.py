"""Unit tests of torchtune_offload.assets.tokenizer: BPE training, files, tiktoken cache."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest

from torchtune_offload.assets.data import make_examples
from torchtune_offload.assets.files import SPECIAL_TOKENS_FILE, TOKENIZER_FILE
from torchtune_offload.assets.tokenizer import (
    TOKENIZER_MIN_CORPUS,
    load_tiny_tokenizer,
    special_token_names,
    train_byte_bpe,
    write_tokenizer,
)
from torchtune_offload.models import TINY_LLAMA_DEFAULTS

VOCAB_SIZE = TINY_LLAMA_DEFAULTS["vocab_size"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        examples = make_examples(num_examples=TOKENIZER_MIN_CORPUS, seed=0)
        special_ids = write_tokenizer(examples=examples, vocab_size=VOCAB_SIZE, out_dir=out)
    return out, special_ids


def test_bpe_starts_with_all_bytes_and_is_deterministic():
    corpus = [("abab abab", 3), ("abc", 1), ("xyz xyz", 2)]
    ranks = train_byte_bpe(weighted_texts=corpus, num_merges=4)
    assert ranks[:256] == [bytes([b]) for b in range(256)]
    assert len(ranks) == 260 == len(set(ranks))
    assert ranks[256] == b"ab"  # the most frequent pair is merged first
    assert train_byte_bpe(weighted_texts=corpus, num_merges=4) == ranks
    # Merges stay inside the tokenizer's regex chunks: a space only ever leads a word.
    assert all(b" " not in tok[1:] for tok in ranks[256:])


def test_bpe_rejects_a_corpus_too_small_for_the_merges():
    with pytest.raises(ValueError, match="corpus only supports"):
        train_byte_bpe(weighted_texts=[("ab", 1)], num_merges=5)


def test_written_files_have_the_tiktoken_and_hf_shapes(tokenizer_dir):
    out, special_ids = tokenizer_dir
    names = special_token_names()
    assert len(names) == 13 and names[0] == "<|begin_of_text|>"
    base_vocab = VOCAB_SIZE - len(names)
    assert special_ids == {name: base_vocab + i for i, name in enumerate(names)}
    lines = (out / TOKENIZER_FILE).read_text().splitlines()
    assert len(lines) == base_vocab
    ranks = [base64.b64decode(line.split()[0]) for line in lines]
    assert [int(line.split()[1]) for line in lines] == list(range(base_vocab))
    assert len(set(ranks)) == base_vocab
    added = json.loads((out / SPECIAL_TOKENS_FILE).read_text())["added_tokens"]
    assert {tok["content"]: tok["id"] for tok in added} == special_ids


def test_round_trip_through_torchtune(tokenizer_dir, monkeypatch):
    out, special_ids = tokenizer_dir
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    tok = load_tiny_tokenizer(out_dir=out, max_seq_len=64)
    assert "TIKTOKEN_CACHE_DIR" not in os.environ  # restored after loading
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.bos_id == special_ids["<|begin_of_text|>"]
    for text in ["Capital of France", "Ünïcode ✓, tabs\t& digits 12345", ""]:
        assert tok.decode(tok.encode(text, add_bos=False, add_eos=False)) == text


def test_write_tokenizer_drops_stale_tiktoken_cache_entries(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    out = tmp_path / "assets"
    path = out / TOKENIZER_FILE
    stale = cache / hashlib.sha1(str(path).encode()).hexdigest()
    stale.write_bytes(b"stale ranks")
    unrelated = cache / hashlib.sha1(b"some/other/tokenizer.model").hexdigest()
    unrelated.write_bytes(b"other")
    examples = make_examples(num_examples=TOKENIZER_MIN_CORPUS, seed=0)
    write_tokenizer(examples=examples, vocab_size=VOCAB_SIZE, out_dir=out)
    assert not stale.exists() and unrelated.exists()


def test_vocab_too_small_for_bytes_and_specials_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="256 bytes"):
        write_tokenizer(examples=[], vocab_size=260, out_dir=tmp_path)

"""The tiny tokenizer: a byte-level BPE in tiktoken format plus Llama3's special tokens.

Why the tokenizer is built this way: torchtune's ``llama3_tokenizer`` accepts
any tiktoken ranks file plus a ``special_tokens_path`` JSON in the shape of a
Hugging Face ``tokenizer.json`` (only its ``added_tokens`` list is read), so a
small vocabulary needs no custom tokenizer class. The BPE is trained here in a
few lines of pure Python rather than with the ``tokenizers`` package so that
tie-breaking, and therefore the output bytes, is fully under our control, and
so that ranks follow tiktoken's rule (merge the adjacent pair whose
concatenation has the lowest rank). All 256 single bytes are ranks 0..255, so
any text round-trips.

Quirks worth knowing:
  * tiktoken caches ranks files by the *path string* (under
    ``$TIKTOKEN_CACHE_DIR`` or ``<tmp>/data-gym-cache``) without checking the
    content, so a rebuilt tokenizer at the same path could be served stale.
    :func:`write_tokenizer` drops the cache entries for the path spellings it
    can predict; set ``TIKTOKEN_CACHE_DIR=`` (empty) to disable that cache
    entirely.
  * ``Llama3Tokenizer`` looks up ``<|finetune_right_pad_id|>``, ``<|step_id|>``
    and ``<|image|>`` besides the ids it validates, so all of llama3's 13 named
    special tokens are written.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import regex  # tiktoken's own dependency; supports \p{L}
from torchtune.models.llama3 import Llama3Tokenizer, llama3_tokenizer
from torchtune.models.llama3._tokenizer import (
    CL100K_PATTERN,
    SPECIAL_TOKENS as LLAMA3_NAMED_SPECIAL_TOKENS,
)

from torchtune_offload.assets.files import (
    SPECIAL_TOKENS_FILE,
    TOKENIZER_FILE,
    log,
    write_bytes,
    write_json,
)

# Small datasets do not contain enough distinct text for the requested merges,
# so the tokenizer always sees at least this many generated examples.
TOKENIZER_MIN_CORPUS = 1000

# The checkout this package lives in, when run from one: the configs name the
# tokenizer relative to it. (In an installed copy this is site-packages, which
# no asset path is below, so that spelling is simply skipped.)
_REPO_ROOT = Path(__file__).resolve().parents[2]

# Text the Llama3 chat format tokenizes besides message bodies; training on it
# makes each a single token instead of several bytes.
_TEMPLATE_TEXTS = ("user", "assistant", "system", "\n\n")


def special_token_names() -> List[str]:
    """Return llama3's named special tokens in canonical id order.

    Returns:
        The 13 names torchtune's ``Llama3Tokenizer`` knows, ordered as their
        canonical ids so that the small ids keep the same relative order.
    """
    return sorted(LLAMA3_NAMED_SPECIAL_TOKENS, key=LLAMA3_NAMED_SPECIAL_TOKENS.__getitem__)


def train_byte_bpe(*, weighted_texts: Iterable[Tuple[str, int]], num_merges: int) -> List[bytes]:
    """Train a byte-level BPE and return its tokens in rank order.

    Text is pre-split with the same regex ``llama3_tokenizer`` uses at encode
    time, so merges never cross a boundary the tokenizer would not cross.

    Args:
        weighted_texts: ``(text, count)`` pairs forming the training corpus.
        num_merges: How many multi-byte tokens to add after the 256 bytes.

    Returns:
        ``256 + num_merges`` distinct byte strings; index == tiktoken rank.

    Raises:
        ValueError: If the corpus cannot supply ``num_merges`` distinct merges.
    """
    pattern = regex.compile(CL100K_PATTERN)
    chunk_counts: Counter = Counter()
    for text, weight in weighted_texts:
        for chunk in pattern.findall(text):
            chunk_counts[chunk.encode("utf-8")] += weight
    # Sorted so iteration order (and with it every tie) is independent of hashing.
    words = [([bytes([b]) for b in chunk], count) for chunk, count in sorted(chunk_counts.items())]

    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < 256 + num_merges:
        pair_counts: Counter = Counter()
        for toks, count in words:
            for pair in zip(toks, toks[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            raise ValueError(
                f"corpus only supports {len(ranks) - 256} merges, {num_merges} requested; "
                "use more --num-examples or a smaller vocab_size"
            )
        # Most frequent first; ties by the merged bytes, then the left part.
        (left, right), _ = min(
            pair_counts.items(), key=lambda kv: (-kv[1], kv[0][0] + kv[0][1], kv[0][0])
        )
        merged = left + right
        if merged not in known:
            known.add(merged)
            ranks.append(merged)
        for toks, _count in words:
            i = 0
            while i < len(toks) - 1:
                if toks[i] == left and toks[i + 1] == right:
                    toks[i : i + 2] = [merged]
                i += 1
    return ranks


def write_tokenizer(
    *, examples: Sequence[Mapping[str, str]], vocab_size: int, out_dir: Path
) -> Dict[str, int]:
    """Train and write the tiktoken ranks file and the special-tokens JSON.

    Args:
        examples: Dataset records whose text the BPE is trained on.
        vocab_size: Total vocabulary (BPE ranks + special tokens) to produce.
        out_dir: Asset root; files go to ``tokenizer/`` below it.

    Returns:
        Mapping of special-token name to its id.

    Raises:
        ValueError: If ``vocab_size`` cannot hold the bytes plus special tokens.
    """
    names = special_token_names()
    base_vocab = vocab_size - len(names)
    if base_vocab < 256:
        raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {len(names)} special tokens")
    corpus: Counter = Counter()
    for ex in examples:
        # Llama3Tokenizer strips message bodies before encoding them.
        corpus[ex["input"].strip()] += 1
        corpus[ex["output"].strip()] += 1
    for text in _TEMPLATE_TEXTS:
        corpus[text] += len(examples)
    ranks = train_byte_bpe(weighted_texts=sorted(corpus.items()), num_merges=base_vocab - 256)

    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}" for rank, tok in enumerate(ranks)]
    write_bytes(path=out_dir / TOKENIZER_FILE, data=("\n".join(lines) + "\n").encode("ascii"))
    special_ids = {name: base_vocab + i for i, name in enumerate(names)}
    # Only "added_tokens" is read by torchtune's parse_hf_tokenizer_json.
    added = [{"id": i, "content": name, "special": True} for name, i in special_ids.items()]
    write_json(path=out_dir / SPECIAL_TOKENS_FILE, obj={"added_tokens": added})
    _forget_tiktoken_cache(path=out_dir / TOKENIZER_FILE)
    log(
        f"wrote {out_dir / TOKENIZER_FILE} ({len(ranks)} BPE ranks) and {SPECIAL_TOKENS_FILE} "
        f"(ids {base_vocab}..{vocab_size - 1}); vocab_size={vocab_size}"
    )
    return special_ids


def _forget_tiktoken_cache(*, path: Path) -> None:
    """Delete tiktoken's path-keyed cache entries for ``path`` (see the module docstring)."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not cache_dir:
        return
    spellings = {str(path), str(path.resolve()), os.path.relpath(path.resolve())}
    try:
        spellings.add(str(path.resolve().relative_to(_REPO_ROOT)))
    except ValueError:
        pass
    for spelling in spellings:
        entry = Path(cache_dir) / hashlib.sha1(spelling.encode()).hexdigest()
        if entry.exists():
            entry.unlink()
            log(f"dropped stale tiktoken cache entry for {spelling}")


def load_tiny_tokenizer(*, out_dir: Path, max_seq_len: Optional[int] = None) -> Llama3Tokenizer:
    """Load the written tokenizer through torchtune's public builder.

    Args:
        out_dir: Asset root written by :func:`~torchtune_offload.assets.build_assets`.
        max_seq_len: Passed through to the tokenizer.

    Returns:
        A ``torchtune.models.llama3.Llama3Tokenizer``.
    """
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the file itself, never a cached copy
    try:
        return llama3_tokenizer(
            path=str(out_dir / TOKENIZER_FILE),
            special_tokens_path=str(out_dir / SPECIAL_TOKENS_FILE),
            max_seq_len=max_seq_len,
        )
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved

#!/usr/bin/env python
"""Build tiny, offline, byte-for-byte reproducible assets for the tiny configs.

Usage (from the repository root)::

    python scripts/make_tiny_assets.py                 # -> assets/tiny/
    python scripts/make_tiny_assets.py --force         # rebuild even if up to date
    python scripts/make_tiny_assets.py --real-arch llama3_2_1b \\
        --output-dir assets/llama3_2_1b_random         # random-init real architecture
    python scripts/make_tiny_assets.py --real-arch qwen2_5_0_5b --num-layers 1 \\
        --output-dir /tmp/qwen_1layer                  # same, truncated (for tests)

Nothing is downloaded. For the same arguments every run writes the same bytes
on the same machine (the random weights come from torch's CPU generator, whose
vectorised normal sampler may differ between CPU instruction sets).

Tiny mode (default) writes into ``--output-dir`` (``assets/tiny``)::

    data/train.json             instruction data, JSON Lines, columns input/output
    tokenizer/tokenizer.model   byte-level BPE ranks in tiktoken format
    tokenizer/special_tokens.json  Llama3 special-token names -> small ids
    model/config.json           Hugging Face LlamaForCausalLM config
    model/model.safetensors     random-init weights (fp32 unless --dtype)
    manifest.json               content version, arguments, file hashes

and then self-checks them with torchtune's own loaders. The configs use::

    tokenizer:
      _component_: torchtune.models.llama3.llama3_tokenizer
      path: assets/tiny/tokenizer/tokenizer.model
      special_tokens_path: assets/tiny/tokenizer/special_tokens.json
    dataset:
      _component_: torchtune.datasets.instruct_dataset
      source: json
      data_files: assets/tiny/data/train.json
      split: train
    checkpointer:  FullModelHFCheckpointer, checkpoint_dir assets/tiny/model,
                   checkpoint_files [model.safetensors], model_type LLAMA3
    model:
      _component_: torchtune_offload.tiny_models.tiny_llama

The model shapes come from ``torchtune_offload.tiny_models.TINY_LLAMA_DEFAULTS``
so the checkpoint and the builder cannot drift apart; the tokenizer's total
vocabulary (BPE ranks + special tokens) is sized to that ``vocab_size``. The
tiny build takes about a second after the ~10 s torch/torchtune import.

The data uses ``instruct_dataset`` (columns input/output) rather than
``alpaca_dataset``: Alpaca's long fixed preamble would dwarf the 16..24-token
examples and the tiny vocabulary. Each example is one of ten templated tasks
(next/previous letter, reverse, sort, uppercase, say twice, capital of a fixed
country table, opposites, single-digit addition, counting), regular enough
that the 2-layer model's loss falls from ~6.3 to ~2.5 in 40 AdamW steps.

Why the tokenizer is built this way: torchtune's ``llama3_tokenizer`` accepts
any tiktoken ranks file plus a ``special_tokens_path`` JSON in the shape of a
Hugging Face ``tokenizer.json`` (only its ``added_tokens`` list is read), so a
small vocabulary needs no custom tokenizer class. The BPE is trained here in a
few lines of pure Python rather than with the ``tokenizers`` package so that
tie-breaking, and therefore the output bytes, is fully under our control, and
so that ranks follow tiktoken's rule (merge the adjacent pair whose
concatenation has the lowest rank). All 256 single bytes are ranks 0..255, so
any text round-trips.

Real-architecture mode (``--real-arch``) writes ``config.json`` and
``model.safetensors`` (bf16 unless ``--dtype``) directly into ``--output-dir``
(default ``assets/<arch>_random``), built on the meta device and filled tensor
by tensor from a seeded generator so peak memory stays near one model copy.
Point a real torchtune config at it with::

    checkpointer.checkpoint_dir=assets/llama3_2_1b_random checkpointer.model_type=LLAMA3_2
    (llama3_2_3b: LLAMA3_2; qwen2_5_0_5b: QWEN2)

These checkpoints carry no tokenizer. The tiny tokenizer also serves the Llama
3.2 random checkpoints when loaded *without* ``special_tokens_path``: its BPE
ids are all < 499 and the canonical special ids (128000..128255 for text) fit
the 128256-token vocabulary. With the tiny dataset that is::

    tokenizer.path=assets/tiny/tokenizer/tokenizer.model tokenizer.special_tokens_path=null \\
    dataset._component_=torchtune.datasets.instruct_dataset dataset.source=json \\
    dataset.data_files=assets/tiny/data/train.json dataset.split=train

Qwen2.5 needs its own vocab.json/merges.txt; use synthetic token ids there.

``--num-layers N`` keeps only the first N blocks (per-tensor seeds make them
identical to the full checkpoint's first N). Such a checkpoint loads only into
a model of that depth, i.e. the component builder with the model builder's
arguments, e.g. for Llama 3.2 1B::

    model._component_=torchtune.models.llama3_2.llama3_2 model.num_layers=1 \\
    model.vocab_size=128256 model.num_heads=32 model.num_kv_heads=8 model.embed_dim=2048 \\
    model.max_seq_len=131072 model.intermediate_dim=8192

Quirks worth knowing:
  * tiktoken caches ranks files by the *path string* (under
    ``$TIKTOKEN_CACHE_DIR`` or ``<tmp>/data-gym-cache``) without checking the
    content, so a rebuilt tokenizer at the same path could be served stale.
    This script drops the cache entries for the path spellings it can predict;
    set ``TIKTOKEN_CACHE_DIR=`` (empty) to disable that cache entirely.
  * ``Llama3Tokenizer`` looks up ``<|finetune_right_pad_id|>``, ``<|step_id|>``
    and ``<|image|>`` besides the ids it validates, so all of llama3's 13 named
    special tokens are written.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

# Loading a local JSON file must never try the Hub; set before `datasets` loads.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    # Lets the script run from a plain checkout, without `pip install -e .`.
    sys.path.insert(0, str(_REPO_ROOT))

import regex  # noqa: E402  (tiktoken's own dependency; supports \p{L})
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torchtune.models.llama3 import Llama3Tokenizer, llama3_tokenizer  # noqa: E402
from torchtune.models.llama3._tokenizer import (  # noqa: E402
    CL100K_PATTERN,
    SPECIAL_TOKENS as LLAMA3_NAMED_SPECIAL_TOKENS,
)

from torchtune_offload.tiny_models import TINY_LLAMA_DEFAULTS, tiny_llama  # noqa: E402

# Bump whenever the bytes written for the same arguments change (data tasks,
# tokenizer trainer, init scheme, file layout); existing assets then rebuild.
CONTENT_VERSION = 1

MANIFEST_NAME = "manifest.json"
DEFAULT_TINY_DIR = "assets/tiny"
DATA_FILE = "data/train.json"
TOKENIZER_FILE = "tokenizer/tokenizer.model"
SPECIAL_TOKENS_FILE = "tokenizer/special_tokens.json"
MODEL_DIR = "model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Longest tokenized example (chat headers included) the data may produce; the
# configs use tokenizer.max_seq_len 64 so nothing is ever truncated.
MAX_EXAMPLE_TOKENS = 48
# Small datasets do not contain enough distinct text for the requested merges,
# so the tokenizer always sees at least this many generated examples.
TOKENIZER_MIN_CORPUS = 1000
INIT_STD = 0.02

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _log(msg: str) -> None:
    print(f"[make_tiny_assets] {msg}", flush=True)


# --------------------------------------------------------------------------- #
# Dataset
# --------------------------------------------------------------------------- #

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORDS = (
    "cat", "dog", "sun", "map", "red", "box", "cup", "pen", "hat", "bus",
    "car", "egg", "fox", "jam", "key", "leg", "net", "owl", "pig", "rat",
    "sky", "tea", "van", "web", "zip",
)  # fmt: skip
_CAPITALS = (
    ("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"),
    ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Cuba", "Havana"),
    ("Greece", "Athens"), ("Norway", "Oslo"), ("Poland", "Warsaw"),
    ("Canada", "Ottawa"), ("China", "Beijing"), ("Russia", "Moscow"),
    ("Germany", "Berlin"),
)  # fmt: skip
_OPPOSITES = (
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"),
    ("old", "new"), ("day", "night"), ("wet", "dry"), ("open", "shut"),
    ("left", "right"), ("high", "low"), ("full", "empty"), ("early", "late"),
)  # fmt: skip


def _task_next_letter(*, rng: Random) -> Tuple[str, str]:
    i = rng.randrange(len(_LETTERS) - 1)
    return f"Next letter after {_LETTERS[i]}", _LETTERS[i + 1]


def _task_letter_before(*, rng: Random) -> Tuple[str, str]:
    i = rng.randrange(1, len(_LETTERS))
    return f"Letter before {_LETTERS[i]}", _LETTERS[i - 1]


def _task_reverse(*, rng: Random) -> Tuple[str, str]:
    seq = rng.sample(_LETTERS[:10], rng.randint(3, 5))
    return "Reverse: " + " ".join(seq), " ".join(reversed(seq))


def _task_sort(*, rng: Random) -> Tuple[str, str]:
    seq = rng.sample(_LETTERS[:10], rng.randint(3, 5))
    return "Sort: " + " ".join(seq), " ".join(sorted(seq))


def _task_uppercase(*, rng: Random) -> Tuple[str, str]:
    word = rng.choice(_WORDS)
    return f"Uppercase: {word}", word.upper()


def _task_twice(*, rng: Random) -> Tuple[str, str]:
    word = rng.choice(_WORDS)
    return f"Say twice: {word}", f"{word} {word}"


def _task_capital(*, rng: Random) -> Tuple[str, str]:
    country, city = rng.choice(_CAPITALS)
    return f"Capital of {country}", city


def _task_opposite(*, rng: Random) -> Tuple[str, str]:
    a, b = rng.choice(_OPPOSITES)
    if rng.random() < 0.5:
        a, b = b, a
    return f"Opposite of {a}", b


def _task_add(*, rng: Random) -> Tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"Add {a} and {b}", str(a + b)


def _task_count(*, rng: Random) -> Tuple[str, str]:
    n = rng.randint(1, 6)
    return "Count: " + " ".join([rng.choice(_WORDS)] * n), str(n)


# Order matters for reproducibility: examples cycle through this tuple.
_TASKS: Tuple[Callable[..., Tuple[str, str]], ...] = (
    _task_next_letter,
    _task_letter_before,
    _task_reverse,
    _task_sort,
    _task_uppercase,
    _task_twice,
    _task_capital,
    _task_opposite,
    _task_add,
    _task_count,
)


def make_examples(*, num_examples: int, seed: int) -> List[Dict[str, str]]:
    """Generate the instruction examples.

    Tasks are very regular (fixed templates, tiny answer sets) so that a
    2-layer model visibly lowers its loss within a few dozen optimizer steps.

    Args:
        num_examples: How many examples to produce.
        seed: Seed of the private RNG; the same seed gives the same list.

    Returns:
        A list of ``{"input": ..., "output": ...}`` dicts, balanced across
        tasks and shuffled.
    """
    rng = Random(seed)
    examples = []
    for i in range(num_examples):
        prompt, answer = _TASKS[i % len(_TASKS)](rng=rng)
        examples.append({"input": prompt, "output": answer})
    rng.shuffle(examples)
    return examples


def write_examples(*, examples: Sequence[Mapping[str, str]], path: Path) -> None:
    """Write examples as JSON Lines, which ``datasets``' json loader reads natively.

    Args:
        examples: The records to write.
        path: Destination file.
    """
    lines = [json.dumps(dict(ex), ensure_ascii=False, sort_keys=True) for ex in examples]
    _write_bytes(path=path, data=("\n".join(lines) + "\n").encode("utf-8"))


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #

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
    _write_bytes(path=out_dir / TOKENIZER_FILE, data=("\n".join(lines) + "\n").encode("ascii"))
    special_ids = {name: base_vocab + i for i, name in enumerate(names)}
    # Only "added_tokens" is read by torchtune's parse_hf_tokenizer_json.
    added = [{"id": i, "content": name, "special": True} for name, i in special_ids.items()]
    _write_json(path=out_dir / SPECIAL_TOKENS_FILE, obj={"added_tokens": added})
    _forget_tiktoken_cache(path=out_dir / TOKENIZER_FILE)
    _log(
        f"wrote {out_dir / TOKENIZER_FILE} ({len(ranks)} BPE ranks) and {SPECIAL_TOKENS_FILE} "
        f"(ids {base_vocab}..{vocab_size - 1}); vocab_size={vocab_size}"
    )
    return special_ids


def _forget_tiktoken_cache(*, path: Path) -> None:
    """Delete tiktoken's path-keyed cache entries for ``path`` (see header)."""
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
            _log(f"dropped stale tiktoken cache entry for {spelling}")


def load_tiny_tokenizer(*, out_dir: Path, max_seq_len: Optional[int] = None) -> Llama3Tokenizer:
    """Load the written tokenizer through torchtune's public builder.

    Args:
        out_dir: Asset root written by this script.
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


# --------------------------------------------------------------------------- #
# Checkpoints
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class RealArch:
    """A torchtune model builder plus the HF fields its shapes do not imply."""

    builder: str
    model_type: str
    hf_extra: Mapping[str, Any]


_REAL_ARCHES: Dict[str, RealArch] = {
    "llama3_2_1b": RealArch(
        builder="torchtune.models.llama3_2.llama3_2_1b",
        model_type="LLAMA3_2",
        hf_extra={"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "bos_token_id": 128000, "eos_token_id": 128001},
    ),
    "llama3_2_3b": RealArch(
        builder="torchtune.models.llama3_2.llama3_2_3b",
        model_type="LLAMA3_2",
        hf_extra={"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "bos_token_id": 128000, "eos_token_id": 128001},
    ),
    "qwen2_5_0_5b": RealArch(
        builder="torchtune.models.qwen2_5.qwen2_5_0_5b",
        model_type="QWEN2",
        hf_extra={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                  "bos_token_id": 151643, "eos_token_id": 151645,
                  "use_sliding_window": False, "sliding_window": 32768},
    ),
}  # fmt: skip


def _instantiate_builder(*, dotpath: str) -> Callable[[], torch.nn.Module]:
    module_name, _, fn_name = dotpath.rpartition(".")
    module = __import__(module_name, fromlist=[fn_name])
    return getattr(module, fn_name)


def build_meta_model(*, real_arch: Optional[str], num_layers: Optional[int]) -> torch.nn.Module:
    """Build the target architecture on the meta device (no memory for weights).

    Args:
        real_arch: Key of ``_REAL_ARCHES``, or None for :func:`tiny_llama`.
        num_layers: Keep only the first this-many transformer blocks.

    Returns:
        The model with meta tensors.
    """
    with torch.device("meta"):
        if real_arch is None:
            model = tiny_llama()
        else:
            model = _instantiate_builder(dotpath=_REAL_ARCHES[real_arch].builder)()
    if num_layers is not None:
        model.layers = model.layers[:num_layers]
    return model


def hf_config_for(*, model: torch.nn.Module, real_arch: Optional[str], dtype: torch.dtype,
                  special_ids: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    """Describe ``model`` as a Hugging Face ``config.json``.

    Shapes are read off the built module so they can never disagree with it.

    Args:
        model: A torchtune ``TransformerDecoder`` (meta tensors are fine).
        real_arch: Key of ``_REAL_ARCHES``, or None for the tiny Llama.
        dtype: Dtype the weights are stored in.
        special_ids: The tiny tokenizer's special ids (tiny mode only).

    Returns:
        The config as a plain dict.
    """
    layer = model.layers[0]
    attn = layer.attn
    rope = attn.pos_embeddings
    config: Dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.tok_embeddings.embedding_dim,
        "intermediate_size": layer.mlp.w1.out_features,
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "num_hidden_layers": len(model.layers),
        "vocab_size": model.tok_embeddings.num_embeddings,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": layer.sa_norm.eps,
        "rope_theta": float(rope.base),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": attn.q_proj.bias is not None,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        # torchtune's TiedLinear has no parameter of its own, so no output.weight.
        "tie_word_embeddings": "output.weight" not in model.state_dict(),
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if hasattr(rope, "scale_factor"):  # Llama 3.1+/3.2 frequency scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(rope.scale_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": rope.old_context_len,
        }
    if real_arch is not None:
        config.update(_REAL_ARCHES[real_arch].hf_extra)
    if special_ids is not None:
        config["bos_token_id"] = special_ids["<|begin_of_text|>"]
        config["eos_token_id"] = special_ids["<|end_of_text|>"]
        config["pad_token_id"] = special_ids["<|finetune_right_pad_id|>"]
    return config


def _param_seed(*, seed: int, name: str) -> int:
    # Per-name seeds make each tensor independent of build order and of how
    # many layers exist, so --num-layers 1 reproduces layer 0 of the full model.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(*, name: str, meta: torch.Tensor, num_layers: int, seed: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Create one seeded, initialised parameter for a torchtune state-dict key.

    Args:
        name: torchtune state-dict key, e.g. ``layers.0.attn.q_proj.weight``.
        meta: The meta tensor giving the shape.
        num_layers: Depth of the model, for the residual-projection scaling.
        seed: Base seed.
        dtype: Storage dtype.

    Returns:
        A contiguous CPU tensor.

    Raises:
        ValueError: For a parameter kind this init scheme does not know.
    """
    if name.endswith(".scale"):  # RMSNorm gains start at identity
        return torch.ones(meta.shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(meta.shape, dtype=dtype)
    if not name.endswith(".weight") or meta.dim() != 2:
        raise ValueError(f"no init rule for parameter {name} with shape {tuple(meta.shape)}")
    std = INIT_STD
    if name.endswith(("attn.output_proj.weight", "mlp.w2.weight")):
        # Residual-branch outputs scaled down (GPT-2 style) so depth does not
        # inflate the initial activations; also keeps the initial loss ~ln(V).
        std = INIT_STD / math.sqrt(2 * num_layers)
    gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed=seed, name=name))
    values = torch.empty(meta.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    return values.to(dtype).contiguous()


def write_checkpoint(*, model: torch.nn.Module, config: Mapping[str, Any], model_type: str,
                     seed: int, dtype: torch.dtype, ckpt_dir: Path, init_depth: int) -> None:
    """Materialise seeded weights for ``model`` and write them in HF format.

    Args:
        model: The meta-device model whose state-dict keys and shapes to fill.
        config: The HF config (also written as ``config.json``).
        model_type: torchtune checkpointer model type; selects the key mapping.
        seed: Base seed for :func:`init_tensor`.
        dtype: Storage dtype.
        ckpt_dir: Directory receiving ``config.json`` and ``model.safetensors``.
        init_depth: Untruncated depth of the architecture; sets the residual
            init scale so a ``--num-layers`` cut keeps the full model's tensors.
    """
    tune_sd = {
        name: init_tensor(name=name, meta=meta, num_layers=init_depth, seed=seed, dtype=dtype)
        for name, meta in model.state_dict().items()
    }
    shape_kwargs = dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        dim=config["hidden_size"],
        head_dim=config["head_dim"],
    )
    if model_type == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        hf_sd = qwen2_tune_to_hf(
            tune_sd, tie_word_embeddings=config["tie_word_embeddings"], **shape_kwargs
        )
    else:
        from torchtune.models.convert_weights import tune_to_hf

        hf_sd = tune_to_hf(tune_sd, **shape_kwargs)
    del tune_sd
    # The q/k permutation returns views; safetensors wants owning contiguous tensors.
    hf_sd = {k: v.contiguous() for k, v in sorted(hf_sd.items())}
    n_params = sum(v.numel() for v in hf_sd.values())
    _write_json(path=ckpt_dir / CONFIG_FILE, obj=dict(config))
    weights_path = ckpt_dir / WEIGHTS_FILE
    tmp = weights_path.with_name(weights_path.name + ".tmp")
    save_file(hf_sd, str(tmp), metadata={"format": "pt"})
    # safetensors creates the file owner-only; match the other files' umask mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    tmp.replace(weights_path)
    _log(
        f"wrote {ckpt_dir / WEIGHTS_FILE} ({n_params:,} params, {_HF_DTYPE_NAMES[dtype]}, "
        f"{weights_path.stat().st_size / 2**20:.1f} MiB) and {CONFIG_FILE}; model_type={model_type}"
    )


def load_with_checkpointer(*, ckpt_dir: Path, model_type: str) -> Dict[str, torch.Tensor]:
    """Read a checkpoint back exactly as the recipes do.

    Args:
        ckpt_dir: Directory with ``config.json`` and ``model.safetensors``.
        model_type: torchtune ``ModelType`` name.

    Returns:
        The torchtune-format model state dict.
    """
    from torchtune import training

    with tempfile.TemporaryDirectory(prefix="tiny_assets_ckpt_out_") as out:
        checkpointer = training.FullModelHFCheckpointer(
            checkpoint_dir=str(ckpt_dir),
            checkpoint_files=[WEIGHTS_FILE],
            model_type=model_type,
            output_dir=out,
            recipe_checkpoint=None,
        )
        return checkpointer.load_checkpoint()[training.MODEL_KEY]


# --------------------------------------------------------------------------- #
# Self-checks
# --------------------------------------------------------------------------- #


def check_tiny_assets(*, out_dir: Path, examples: Sequence[Mapping[str, str]]) -> None:
    """Verify the tiny assets with torchtune's loaders; raise on any problem.

    Args:
        out_dir: Asset root written by this script.
        examples: The records that were written.

    Raises:
        RuntimeError: If anything does not load, round-trip or fit.
    """
    from torchtune.data import padded_collate_sft
    from torchtune.datasets import instruct_dataset
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    vocab_size = TINY_LLAMA_DEFAULTS["vocab_size"]
    tok = load_tiny_tokenizer(out_dir=out_dir)
    if tok.vocab_size != vocab_size:
        raise RuntimeError(f"tokenizer vocab {tok.vocab_size} != model vocab {vocab_size}")
    ids = [tok.bos_id, tok.eos_id, tok.pad_id, tok.eot_id, tok.eom_id, tok.start_header_id,
           tok.end_header_id, tok.python_tag, tok.image_id, tok.step_id]
    if max(ids) >= vocab_size:
        raise RuntimeError(f"special ids {ids} not all < vocab_size {vocab_size}")
    for ex in [*examples, {"input": "Ünïcode ✓, tabs\t& digits 12345", "output": ""}]:
        for text in (ex["input"], ex["output"]):
            if tok.decode(tok.encode(text, add_bos=False, add_eos=False)) != text:
                raise RuntimeError(f"tokenizer does not round-trip {text!r}")

    ds = instruct_dataset(tok, source="json", data_files=str(out_dir / DATA_FILE),
                          split="train", train_on_input=False)
    if len(ds) != len(examples):
        raise RuntimeError(f"dataset has {len(ds)} rows, wrote {len(examples)}")
    lengths = [len(ds[i]["tokens"]) for i in range(len(ds))]
    if max(lengths) > MAX_EXAMPLE_TOKENS:
        raise RuntimeError(f"longest example is {max(lengths)} tokens > {MAX_EXAMPLE_TOKENS}")

    state_dict = load_with_checkpointer(ckpt_dir=out_dir / MODEL_DIR, model_type="LLAMA3")
    model = tiny_llama()
    model.load_state_dict(state_dict, strict=True)

    batch = padded_collate_sft([ds[i] for i in range(8)], padding_idx=tok.pad_id)
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    # Same next-token shift as the recipes: position t predicts label t+1.
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=loss_fn.ignore_index)
    with torch.no_grad():
        loss = loss_fn(model(batch["tokens"]), labels).item()
    # A fresh model with small init should be close to uniform over the vocab.
    if not abs(loss - math.log(vocab_size)) < 0.5:
        raise RuntimeError(f"initial loss {loss:.3f} far from ln(V)={math.log(vocab_size):.3f}")
    _log(
        f"self-check ok: {len(ds)} examples, tokens/example {min(lengths)}..{max(lengths)}, "
        f"checkpoint loads strictly into tiny_llama(), initial loss {loss:.3f}"
    )


def check_real_assets(*, out_dir: Path, real_arch: str, num_layers: Optional[int]) -> None:
    """Load the written real-architecture checkpoint into its builder, strictly.

    Args:
        out_dir: Directory holding ``config.json`` and ``model.safetensors``.
        real_arch: Key of ``_REAL_ARCHES``.
        num_layers: The layer truncation used when writing.
    """
    arch = _REAL_ARCHES[real_arch]
    state_dict = load_with_checkpointer(ckpt_dir=out_dir, model_type=arch.model_type)
    model = build_meta_model(real_arch=real_arch, num_layers=num_layers)
    # assign=True swaps the (mmapped) tensors in, so this costs no extra copy.
    model.load_state_dict(state_dict, strict=True, assign=True)
    _log(f"self-check ok: {len(state_dict)} tensors load strictly into {arch.builder}")


# --------------------------------------------------------------------------- #
# Files and manifest
# --------------------------------------------------------------------------- #


def _write_bytes(*, path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # never leave a half-written file under the real name


def _write_json(*, path: Path, obj: Any) -> None:
    _write_bytes(path=path, data=(json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def sha256_file(*, path: Path) -> str:
    """Return the hex SHA-256 of a file, read in chunks.

    Args:
        path: File to hash.

    Returns:
        Hex digest.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_is_current(*, out_dir: Path, stamp: Mapping[str, Any]) -> bool:
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("content_version") != CONTENT_VERSION or manifest.get("args") != stamp:
        return False
    # Size check only: hashing a multi-GB checkpoint on every call is wasteful.
    files = manifest.get("files", {})
    return bool(files) and all(
        (out_dir / rel).is_file() and (out_dir / rel).stat().st_size == info["bytes"]
        for rel, info in files.items()
    )


def _write_manifest(*, out_dir: Path, stamp: Mapping[str, Any], rel_files: Sequence[str]) -> None:
    files = {
        rel: {"bytes": (out_dir / rel).stat().st_size, "sha256": sha256_file(path=out_dir / rel)}
        for rel in sorted(rel_files)
    }
    _write_json(path=out_dir / MANIFEST_NAME, obj={
        "generator": "scripts/make_tiny_assets.py",
        "content_version": CONTENT_VERSION,
        "args": dict(stamp),
        "files": files,
    })
    _log(f"wrote {out_dir / MANIFEST_NAME} (content_version {CONTENT_VERSION})")


# --------------------------------------------------------------------------- #
# Entry points
# --------------------------------------------------------------------------- #


def build_assets(
    *,
    output_dir: Path,
    seed: int = 0,
    num_examples: int = 1000,
    real_arch: Optional[str] = None,
    dtype: Optional[str] = None,
    num_layers: Optional[int] = None,
    force: bool = False,
    check: bool = True,
) -> bool:
    """Build (or confirm up to date) one set of assets.

    Args:
        output_dir: Destination directory.
        seed: Seed for data, tokenizer corpus and weights.
        num_examples: Dataset size (tiny mode).
        real_arch: Key of ``_REAL_ARCHES`` for a real architecture, else None.
        dtype: ``fp32``/``bf16``/``fp16``; None means fp32 tiny, bf16 real.
        num_layers: Truncate a real architecture to this many blocks.
        force: Rebuild even when the manifest says the assets are current.
        check: Run the torchtune-based self-check after writing.

    Returns:
        True if files were written, False if existing assets were current.

    Raises:
        ValueError: On invalid argument values or an unsafe output directory.
    """
    if real_arch is not None and real_arch not in _REAL_ARCHES:
        raise ValueError(f"unknown --real-arch {real_arch!r}; choose from {sorted(_REAL_ARCHES)}")
    if num_layers is not None and real_arch is None:
        raise ValueError("--num-layers only applies with --real-arch (tiny shapes live in "
                         "torchtune_offload/tiny_models.py)")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
    if not 10 <= num_examples <= 100_000:
        raise ValueError(f"--num-examples must be in [10, 100000], got {num_examples}")
    dtype_name = dtype or ("fp32" if real_arch is None else "bf16")
    if dtype_name not in _DTYPES:
        raise ValueError(f"unknown --dtype {dtype_name!r}; choose from {sorted(_DTYPES)}")
    torch_dtype = _DTYPES[dtype_name]

    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} exists and is not a directory")
    if real_arch is not None and num_layers is not None:
        full_depth = len(build_meta_model(real_arch=real_arch, num_layers=None).layers)
        if num_layers > full_depth:
            raise ValueError(f"--num-layers {num_layers} > {real_arch}'s {full_depth} layers")

    if real_arch is None:
        stamp: Dict[str, Any] = {"mode": "tiny", "seed": seed, "num_examples": num_examples,
                                 "dtype": dtype_name, "model": dict(TINY_LLAMA_DEFAULTS)}
    else:
        stamp = {"mode": "real", "real_arch": real_arch, "seed": seed, "dtype": dtype_name,
                 "num_layers": num_layers}
    stamp["torch"] = torch.__version__.split("+")[0]  # weights come from torch's RNG

    if not force and _manifest_is_current(out_dir=output_dir, stamp=stamp):
        _log(f"{output_dir} is up to date (content_version {CONTENT_VERSION}); "
             "nothing to do, pass --force to rebuild")
        return False
    if (output_dir.is_dir() and any(output_dir.iterdir())
            and not (output_dir / MANIFEST_NAME).exists() and not force):
        raise ValueError(f"{output_dir} is non-empty and was not written by this script; "
                         "choose another --output-dir or pass --force")
    output_dir.mkdir(parents=True, exist_ok=True)
    # A file-less manifest marks the directory as ours but never as current, so
    # an interrupted build is redone by the next plain run, not trusted.
    _write_json(path=output_dir / MANIFEST_NAME, obj={"content_version": CONTENT_VERSION,
                                                     "args": dict(stamp), "files": {}})
    _log(f"building {'tiny' if real_arch is None else real_arch} assets in {output_dir}")

    if real_arch is None:
        examples = make_examples(num_examples=num_examples, seed=seed)
        write_examples(examples=examples, path=output_dir / DATA_FILE)
        _log(f"wrote {output_dir / DATA_FILE} ({len(examples)} examples, {len(_TASKS)} tasks)")
        corpus = examples
        if len(examples) < TOKENIZER_MIN_CORPUS:
            corpus = make_examples(num_examples=TOKENIZER_MIN_CORPUS, seed=seed)
        special_ids = write_tokenizer(examples=corpus, vocab_size=TINY_LLAMA_DEFAULTS["vocab_size"],
                                      out_dir=output_dir)
        model = build_meta_model(real_arch=None, num_layers=None)
        config = hf_config_for(
            model=model, real_arch=None, dtype=torch_dtype, special_ids=special_ids
        )
        write_checkpoint(model=model, config=config, model_type="LLAMA3", seed=seed,
                         dtype=torch_dtype, ckpt_dir=output_dir / MODEL_DIR,
                         init_depth=len(model.layers))
        rel_files = [DATA_FILE, TOKENIZER_FILE, SPECIAL_TOKENS_FILE,
                     f"{MODEL_DIR}/{CONFIG_FILE}", f"{MODEL_DIR}/{WEIGHTS_FILE}"]
        if check:
            check_tiny_assets(out_dir=output_dir, examples=examples)
    else:
        arch = _REAL_ARCHES[real_arch]
        model = build_meta_model(real_arch=real_arch, num_layers=None)
        full_depth = len(model.layers)
        if num_layers is not None:
            model.layers = model.layers[:num_layers]
        config = hf_config_for(model=model, real_arch=real_arch, dtype=torch_dtype)
        write_checkpoint(model=model, config=config, model_type=arch.model_type, seed=seed,
                         dtype=torch_dtype, ckpt_dir=output_dir, init_depth=full_depth)
        rel_files = [CONFIG_FILE, WEIGHTS_FILE]
        if check:
            check_real_assets(out_dir=output_dir, real_arch=real_arch, num_layers=num_layers)
        _log(f"use with: checkpointer.checkpoint_dir={output_dir} "
             f"checkpointer.model_type={arch.model_type}")
        if num_layers is not None:
            _log(f"note: only a {num_layers}-layer model loads this (not {arch.builder}); "
                 "see the script header")
    _write_manifest(out_dir=output_dir, stamp=stamp, rel_files=rel_files)
    return True


# One explicit map of every command-line option.
_OPTIONS: Dict[str, Dict[str, Any]] = {
    "--output-dir": dict(type=Path, default=None,
                         help=f"destination (default {DEFAULT_TINY_DIR}, or assets/<arch>_random "
                              "with --real-arch)"),
    "--seed": dict(type=int, default=0,
                   help="seed for data, tokenizer corpus and weights (default 0)"),
    "--num-examples": dict(type=int, default=1000, help="dataset size in tiny mode (default 1000)"),
    "--real-arch": dict(choices=sorted(_REAL_ARCHES), default=None,
                        help="write a random-init checkpoint of this real torchtune architecture "
                             "instead of the tiny assets"),
    "--dtype": dict(choices=sorted(_DTYPES), default=None,
                    help="weight dtype (default fp32 tiny, bf16 with --real-arch)"),
    "--num-layers": dict(type=int, default=None,
                         help="with --real-arch: keep only the first N transformer blocks"),
    "--force": dict(action="store_true", help="rebuild even if the manifest says up to date"),
    "--no-check": dict(action="store_true", help="skip the torchtune self-check after writing"),
}


def parse_args(*, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line arguments from :data:`_OPTIONS`.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The parsed namespace.
    """
    parser = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, spec in _OPTIONS.items():
        parser.add_argument(flag, **spec)
    return parser.parse_args(argv)


def main(*, argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        Process exit code.
    """
    args = parse_args(argv=argv)
    output_dir = args.output_dir
    if output_dir is None:
        default = DEFAULT_TINY_DIR if args.real_arch is None else f"assets/{args.real_arch}_random"
        output_dir = Path(default)
    start = time.perf_counter()
    try:
        build_assets(
            output_dir=output_dir,
            seed=args.seed,
            num_examples=args.num_examples,
            real_arch=args.real_arch,
            dtype=args.dtype,
            num_layers=args.num_layers,
            force=args.force,
            check=not args.no_check,
        )
    except ValueError as exc:
        print(f"make_tiny_assets: error: {exc}", file=sys.stderr)
        return 2
    _log(f"done in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

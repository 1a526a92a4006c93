"""Build tiny, offline, byte-for-byte reproducible assets for the tiny configs.

Usage (from any directory)::

    python -m torchtune_offload.assets                 # -> ~/.cache/torchtune_offload/tiny/
    python -m torchtune_offload.assets --force         # rebuild even if up to date
    python -m torchtune_offload.assets --real-arch llama3_2_1b \\
        --output-dir assets/llama3_2_1b_random         # random-init real architecture
    python -m torchtune_offload.assets --real-arch qwen2_5_0_5b --num-layers 1 \\
        --output-dir /tmp/qwen_1layer                  # same, truncated (for tests)

``python scripts/make_tiny_assets.py`` takes the same options. From Python,
:func:`build_assets` does the same as the command line.

Nothing is downloaded. For the same arguments every run writes the same bytes
on the same machine (the random weights come from torch's CPU generator, whose
vectorised normal sampler may differ between CPU instruction sets).

Tiny mode (default) writes into ``--output-dir``, by default :func:`default_tiny_dir`
(``$XDG_CACHE_HOME/torchtune_offload/tiny``, else ``~/.cache/torchtune_offload/tiny``)::

    data/train.json             instruction data, JSON Lines, columns input/output
    tokenizer/tokenizer.model   byte-level BPE ranks in tiktoken format
    tokenizer/special_tokens.json  Llama3 special-token names -> small ids
    model/config.json           Hugging Face LlamaForCausalLM config
    model/model.safetensors     random-init weights (fp32 unless --dtype)
    manifest.json               content version, arguments, file hashes

and then self-checks them with torchtune's own loaders. The configs name the folder as
:data:`TINY_DIR_IN_CONFIGS` (written ``<tiny>`` here), so they find it from any directory::

    tokenizer:
      _component_: torchtune.models.llama3.llama3_tokenizer
      path: <tiny>/tokenizer/tokenizer.model
      special_tokens_path: <tiny>/tokenizer/special_tokens.json
    dataset:
      _component_: torchtune.datasets.instruct_dataset
      source: json
      data_files: <tiny>/data/train.json
      split: train
    checkpointer:  FullModelHFCheckpointer, checkpoint_dir <tiny>/model,
                   checkpoint_files [model.safetensors], model_type LLAMA3
    model:
      _component_: torchtune_offload.models.tiny_llama

The model shapes come from ``torchtune_offload.models.TINY_LLAMA_DEFAULTS``
so the checkpoint and the builder cannot drift apart; the tokenizer's total
vocabulary (BPE ranks + special tokens) is sized to that ``vocab_size``. The
tiny build takes about a second after the ~10 s torch/torchtune import.

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

    tokenizer.path=$HOME/.cache/torchtune_offload/tiny/tokenizer/tokenizer.model \\
    tokenizer.special_tokens_path=null dataset._component_=torchtune.datasets.instruct_dataset \\
    dataset.source=json dataset.data_files=$HOME/.cache/torchtune_offload/tiny/data/train.json \\
    dataset.split=train

Qwen2.5 needs its own vocab.json/merges.txt; use synthetic token ids there.

``--num-layers N`` keeps only the first N blocks (per-tensor seeds make them
identical to the full checkpoint's first N). Such a checkpoint loads only into
a model of that depth, i.e. the component builder with the model builder's
arguments, e.g. for Llama 3.2 1B::

    model._component_=torchtune.models.llama3_2.llama3_2 model.num_layers=1 \\
    model.vocab_size=128256 model.num_heads=32 model.num_kv_heads=8 model.embed_dim=2048 \\
    model.max_seq_len=131072 model.intermediate_dim=8192

Modules, by what they make (each imports only those listed before it):

- ``files``: the file layout (``DATA_FILE``, ``TOKENIZER_FILE``, ...), the default folder
  (:func:`default_tiny_dir`, :func:`missing_tiny_assets`) and atomic writers.
- ``data``: the ten templated tasks, :func:`make_examples`, :func:`write_examples`.
- ``tokenizer``: byte-level BPE training, :func:`write_tokenizer`,
  :func:`load_tiny_tokenizer`, tiktoken cache handling (its docstring has the quirks).
- ``checkpoints``: :class:`RealArch`, meta-device models, HF configs, seeded
  init, :func:`write_checkpoint`, :func:`load_with_checkpointer`.
- ``checks``: :func:`check_tiny_assets`, :func:`check_real_assets`.
- ``build``: :func:`build_assets`, the manifest, :func:`sha256_file`.
- ``__main__``: the command line (not imported here, so ``python -m`` runs it cleanly).
"""

from torchtune_offload.assets.build import (
    CONTENT_VERSION,
    MANIFEST_NAME,
    build_assets,
    sha256_file,
)
from torchtune_offload.assets.checkpoints import (
    DTYPES,
    INIT_STD,
    REAL_ARCHES,
    RealArch,
    build_meta_model,
    hf_config_for,
    init_tensor,
    load_with_checkpointer,
    write_checkpoint,
)
from torchtune_offload.assets.checks import check_real_assets, check_tiny_assets
from torchtune_offload.assets.data import MAX_EXAMPLE_TOKENS, TASKS, make_examples, write_examples
from torchtune_offload.assets.files import (
    CONFIG_FILE,
    DATA_FILE,
    MODEL_DIR,
    SPECIAL_TOKENS_FILE,
    TINY_DIR_IN_CONFIGS,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    default_tiny_dir,
    missing_tiny_assets,
)
from torchtune_offload.assets.tokenizer import (
    TOKENIZER_MIN_CORPUS,
    load_tiny_tokenizer,
    special_token_names,
    train_byte_bpe,
    write_tokenizer,
)

__all__ = [
    "CONFIG_FILE",
    "CONTENT_VERSION",
    "DATA_FILE",
    "DTYPES",
    "INIT_STD",
    "MANIFEST_NAME",
    "MAX_EXAMPLE_TOKENS",
    "MODEL_DIR",
    "REAL_ARCHES",
    "RealArch",
    "SPECIAL_TOKENS_FILE",
    "TASKS",
    "TINY_DIR_IN_CONFIGS",
    "TOKENIZER_FILE",
    "TOKENIZER_MIN_CORPUS",
    "WEIGHTS_FILE",
    "build_assets",
    "build_meta_model",
    "check_real_assets",
    "check_tiny_assets",
    "default_tiny_dir",
    "hf_config_for",
    "init_tensor",
    "load_tiny_tokenizer",
    "load_with_checkpointer",
    "make_examples",
    "missing_tiny_assets",
    "sha256_file",
    "special_token_names",
    "train_byte_bpe",
    "write_checkpoint",
    "write_examples",
    "write_tokenizer",
]

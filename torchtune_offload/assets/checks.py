"""Self-checks: load freshly written assets with torchtune's own loaders, strictly."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import datasets
import torch
from torchtune.data import padded_collate_sft
from torchtune.datasets import instruct_dataset
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.assets.checkpoints import (
    REAL_ARCHES,
    build_meta_model,
    load_with_checkpointer,
)
from torchtune_offload.assets.data import MAX_EXAMPLE_TOKENS
from torchtune_offload.assets.files import DATA_FILE, MODEL_DIR, log
from torchtune_offload.assets.tokenizer import load_tiny_tokenizer
from torchtune_offload.models import TINY_LLAMA_DEFAULTS, tiny_llama


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    """Keep ``datasets`` off the network while it reads the local JSON file.

    Loading a local JSON file must never try the Hub, yet ``load_dataset("json")``
    sends a download-count request unless offline. ``datasets`` reads
    ``HF_DATASETS_OFFLINE`` only when it is imported, which torchtune (and so
    ``torchtune_offload``) has done before this package runs, so the flag is set
    on its config for the duration instead. An explicit ``HF_DATASETS_OFFLINE``
    in the environment was honoured at import and is left alone.
    """
    if "HF_DATASETS_OFFLINE" in os.environ:
        yield
        return
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def check_tiny_assets(*, out_dir: Path, examples: Sequence[Mapping[str, str]]) -> None:
    """Verify the tiny assets with torchtune's loaders; raise on any problem.

    Args:
        out_dir: Asset root written by :func:`~torchtune_offload.assets.build_assets`.
        examples: The records that were written.

    Raises:
        RuntimeError: If anything does not load, round-trip or fit.
    """
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

    with _datasets_offline():
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
    log(
        f"self-check ok: {len(ds)} examples, tokens/example {min(lengths)}..{max(lengths)}, "
        f"checkpoint loads strictly into tiny_llama(), initial loss {loss:.3f}"
    )


def check_real_assets(*, out_dir: Path, real_arch: str, num_layers: Optional[int]) -> None:
    """Load the written real-architecture checkpoint into its builder, strictly.

    Args:
        out_dir: Directory holding ``config.json`` and ``model.safetensors``.
        real_arch: Key of ``REAL_ARCHES``.
        num_layers: The layer truncation used when writing.
    """
    arch = REAL_ARCHES[real_arch]
    state_dict = load_with_checkpointer(ckpt_dir=out_dir, model_type=arch.model_type)
    model = build_meta_model(real_arch=real_arch, num_layers=num_layers)
    # assign=True swaps the (mmapped) tensors in, so this costs no extra copy.
    model.load_state_dict(state_dict, strict=True, assign=True)
    log(f"self-check ok: {len(state_dict)} tensors load strictly into {arch.builder}")

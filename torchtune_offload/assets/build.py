"""Building one set of assets end to end, and the manifest that makes rebuilds incremental.

``manifest.json`` records :data:`CONTENT_VERSION`, the arguments (with the
torch version, since the weights come from torch's RNG) and every file's size
and SHA-256. A later build with the same arguments does nothing while the
manifest is current; ``force=True`` rebuilds, to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from torchtune_offload.assets.checkpoints import (
    DTYPES,
    REAL_ARCHES,
    build_meta_model,
    hf_config_for,
    write_checkpoint,
)
from torchtune_offload.assets.checks import check_real_assets, check_tiny_assets
from torchtune_offload.assets.data import TASKS, make_examples, write_examples
from torchtune_offload.assets.files import (
    CONFIG_FILE,
    DATA_FILE,
    MODEL_DIR,
    SPECIAL_TOKENS_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    log,
    write_json,
)
from torchtune_offload.assets.tokenizer import TOKENIZER_MIN_CORPUS, write_tokenizer
from torchtune_offload.models import TINY_LLAMA_DEFAULTS

# Bump whenever the bytes written for the same arguments change (data tasks,
# tokenizer trainer, init scheme, file layout); existing assets then rebuild.
CONTENT_VERSION = 1

MANIFEST_NAME = "manifest.json"
# Recorded in every manifest. Kept at the pre-package script's name so that the
# manifest, like every other file, is byte-identical to the one it used to write.
_GENERATOR = "scripts/make_tiny_assets.py"


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
    write_json(path=out_dir / MANIFEST_NAME, obj={
        "generator": _GENERATOR,
        "content_version": CONTENT_VERSION,
        "args": dict(stamp),
        "files": files,
    })
    log(f"wrote {out_dir / MANIFEST_NAME} (content_version {CONTENT_VERSION})")


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
        real_arch: Key of ``REAL_ARCHES`` for a real architecture, else None.
        dtype: ``fp32``/``bf16``/``fp16``; None means fp32 tiny, bf16 real.
        num_layers: Truncate a real architecture to this many blocks.
        force: Rebuild even when the manifest says the assets are current.
        check: Run the torchtune-based self-check after writing.

    Returns:
        True if files were written, False if existing assets were current.

    Raises:
        ValueError: On invalid argument values or an unsafe output directory.
    """
    dtype_name = _check_build_arguments(output_dir=output_dir, num_examples=num_examples, real_arch=real_arch,
                                        dtype=dtype, num_layers=num_layers)
    torch_dtype = DTYPES[dtype_name]
    stamp = _stamp(seed=seed, num_examples=num_examples, real_arch=real_arch, dtype_name=dtype_name,
                   num_layers=num_layers)

    if not force and _manifest_is_current(out_dir=output_dir, stamp=stamp):
        log(f"{output_dir} is up to date (content_version {CONTENT_VERSION}); "
             "nothing to do, pass --force to rebuild")
        return False
    if (output_dir.is_dir() and any(output_dir.iterdir())
            and not (output_dir / MANIFEST_NAME).exists() and not force):
        raise ValueError(f"{output_dir} is non-empty and was not written by this script; "
                         "choose another --output-dir or pass --force")
    output_dir.mkdir(parents=True, exist_ok=True)
    # A file-less manifest marks the directory as ours but never as current, so
    # an interrupted build is redone by the next plain run, not trusted.
    write_json(path=output_dir / MANIFEST_NAME, obj={"content_version": CONTENT_VERSION,
                                                     "args": dict(stamp), "files": {}})
    log(f"building {'tiny' if real_arch is None else real_arch} assets in {output_dir}")

    if real_arch is None:
        rel_files = _write_tiny(output_dir, seed=seed, num_examples=num_examples, dtype=torch_dtype, check=check)
    else:
        rel_files = _write_real(output_dir, real_arch=real_arch, seed=seed, dtype=torch_dtype, num_layers=num_layers,
                                check=check)
    _write_manifest(out_dir=output_dir, stamp=stamp, rel_files=rel_files)
    return True


def _check_build_arguments(*, output_dir: Path, num_examples: int, real_arch: Optional[str], dtype: Optional[str],
                           num_layers: Optional[int]) -> str:
    """Refuses :func:`build_assets`' arguments that cannot build (a ``ValueError`` naming the option)
    before anything is written; returns the dtype's name, the default filled in."""
    if real_arch is not None and real_arch not in REAL_ARCHES:
        raise ValueError(f"unknown --real-arch {real_arch!r}; choose from {sorted(REAL_ARCHES)}")
    if num_layers is not None and real_arch is None:
        raise ValueError("--num-layers only applies with --real-arch (tiny shapes live in "
                         "torchtune_offload/models/tiny.py)")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
    if not 10 <= num_examples <= 100_000:
        raise ValueError(f"--num-examples must be in [10, 100000], got {num_examples}")
    dtype_name = dtype or ("fp32" if real_arch is None else "bf16")
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype_name!r}; choose from {sorted(DTYPES)}")

    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} exists and is not a directory")
    if real_arch is not None and num_layers is not None:
        full_depth = len(build_meta_model(real_arch=real_arch, num_layers=None).layers)
        if num_layers > full_depth:
            raise ValueError(f"--num-layers {num_layers} > {real_arch}'s {full_depth} layers")
    return dtype_name


def _stamp(*, seed: int, num_examples: int, real_arch: Optional[str], dtype_name: str,
           num_layers: Optional[int]) -> Dict[str, Any]:
    """The arguments the manifest records: assets built from the same stamp are the same bytes."""
    if real_arch is None:
        stamp: Dict[str, Any] = {"mode": "tiny", "seed": seed, "num_examples": num_examples,
                                 "dtype": dtype_name, "model": dict(TINY_LLAMA_DEFAULTS)}
    else:
        stamp = {"mode": "real", "real_arch": real_arch, "seed": seed, "dtype": dtype_name,
                 "num_layers": num_layers}
    stamp["torch"] = torch.__version__.split("+")[0]  # weights come from torch's RNG
    return stamp


def _write_tiny(output_dir: Path, *, seed: int, num_examples: int, dtype: torch.dtype, check: bool) -> List[str]:
    """Writes the tiny assets (data, tokenizer, checkpoint), checked where asked; returns their paths."""
    examples = make_examples(num_examples=num_examples, seed=seed)
    write_examples(examples=examples, path=output_dir / DATA_FILE)
    log(f"wrote {output_dir / DATA_FILE} ({len(examples)} examples, {len(TASKS)} tasks)")
    corpus = examples
    if len(examples) < TOKENIZER_MIN_CORPUS:
        corpus = make_examples(num_examples=TOKENIZER_MIN_CORPUS, seed=seed)
    special_ids = write_tokenizer(examples=corpus, vocab_size=TINY_LLAMA_DEFAULTS["vocab_size"],
                                  out_dir=output_dir)
    model = build_meta_model(real_arch=None, num_layers=None)
    config = hf_config_for(
        model=model, real_arch=None, dtype=dtype, special_ids=special_ids
    )
    write_checkpoint(model=model, config=config, model_type="LLAMA3", seed=seed,
                     dtype=dtype, ckpt_dir=output_dir / MODEL_DIR,
                     init_depth=len(model.layers))
    rel_files = [DATA_FILE, TOKENIZER_FILE, SPECIAL_TOKENS_FILE,
                 f"{MODEL_DIR}/{CONFIG_FILE}", f"{MODEL_DIR}/{WEIGHTS_FILE}"]
    if check:
        check_tiny_assets(out_dir=output_dir, examples=examples)
    return rel_files


def _write_real(output_dir: Path, *, real_arch: str, seed: int, dtype: torch.dtype, num_layers: Optional[int],
                check: bool) -> List[str]:
    """Writes a real architecture's checkpoint (its first ``num_layers`` layers where given), checked
    where asked; returns its paths."""
    arch = REAL_ARCHES[real_arch]
    model = build_meta_model(real_arch=real_arch, num_layers=None)
    full_depth = len(model.layers)
    if num_layers is not None:
        model.layers = model.layers[:num_layers]
    config = hf_config_for(model=model, real_arch=real_arch, dtype=dtype)
    write_checkpoint(model=model, config=config, model_type=arch.model_type, seed=seed,
                     dtype=dtype, ckpt_dir=output_dir, init_depth=full_depth)
    rel_files = [CONFIG_FILE, WEIGHTS_FILE]
    if check:
        check_real_assets(out_dir=output_dir, real_arch=real_arch, num_layers=num_layers)
    log(f"use with: checkpointer.checkpoint_dir={output_dir} "
         f"checkpointer.model_type={arch.model_type}")
    if num_layers is not None:
        log(f"note: only a {num_layers}-layer model loads this (not {arch.builder}); "
             "see the torchtune_offload.assets docstring")
    return rel_files

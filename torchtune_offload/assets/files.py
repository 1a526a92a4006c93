"""The asset file layout and the atomic writers every asset module uses.

Paths are relative to an asset root (``--output-dir``); real-architecture mode
writes :data:`CONFIG_FILE` and :data:`WEIGHTS_FILE` directly into the root.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

#: The tiny assets' folder below the user's cache directory. configs/tiny/*.yaml name the same
#: folder through OmegaConf's ``oc.env`` resolver (``TINY_DIR_IN_CONFIGS``), so a tiny config
#: finds the assets from any working directory, in a clone or after ``pip install``.
TINY_CACHE_SUBDIR = "torchtune_offload/tiny"
TINY_DIR_IN_CONFIGS = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/" + TINY_CACHE_SUBDIR
DATA_FILE = "data/train.json"
TOKENIZER_FILE = "tokenizer/tokenizer.model"
SPECIAL_TOKENS_FILE = "tokenizer/special_tokens.json"
MODEL_DIR = "model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def default_tiny_dir() -> Path:
    """Where ``python -m torchtune_offload.assets`` writes the tiny assets by default.

    ``$XDG_CACHE_HOME/torchtune_offload/tiny``, else ``~/.cache/torchtune_offload/tiny``: the
    folder :data:`TINY_DIR_IN_CONFIGS` resolves to, read from the environment at each call.
    """
    # Set but empty counts as set, as in OmegaConf's oc.env, so both name the same folder.
    cache = os.environ["XDG_CACHE_HOME"] if "XDG_CACHE_HOME" in os.environ else str(Path.home() / ".cache")
    return Path(cache) / TINY_CACHE_SUBDIR


def missing_tiny_assets(*, paths: Iterable[str]) -> Optional[str]:
    """What to run when a config reads the default tiny assets before they are built.

    Args:
        paths: the file and folder paths a config names (tokenizer, data, checkpoint).

    Returns:
        A message naming the first missing path inside :func:`default_tiny_dir` and the command
        that builds it, or None when every such path exists (or none lies there).
    """
    root = default_tiny_dir().resolve()
    for path in paths:
        resolved = Path(path).expanduser().resolve()
        if resolved.is_relative_to(root) and not resolved.exists():
            # This interpreter, by its path: the one that has torch where `python` on PATH may not.
            return (f"{path} does not exist: the tiny assets are not built. Build them with "
                    f"`{shlex.quote(sys.executable)} -m torchtune_offload.assets` (it writes {default_tiny_dir()}), "
                    "then run again.")
    return None


def log(msg: str) -> None:
    """Print one progress line with the tool's prefix, flushed at once.

    Args:
        msg: The message.
    """
    print(f"[make_tiny_assets] {msg}", flush=True)


def write_bytes(*, path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling, creating parents.

    Args:
        path: Destination file.
        data: The complete file content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # never leave a half-written file under the real name


def write_json(*, path: Path, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline.

    Args:
        path: Destination file.
        obj: A JSON-serialisable value.
    """
    write_bytes(path=path, data=(json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))

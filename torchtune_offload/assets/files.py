"""The asset file layout and the atomic writers every asset module uses.

Paths are relative to an asset root (``--output-dir``); real-architecture mode
writes :data:`CONFIG_FILE` and :data:`WEIGHTS_FILE` directly into the root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_TINY_DIR = "assets/tiny"
DATA_FILE = "data/train.json"
TOKENIZER_FILE = "tokenizer/tokenizer.model"
SPECIAL_TOKENS_FILE = "tokenizer/special_tokens.json"
MODEL_DIR = "model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


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

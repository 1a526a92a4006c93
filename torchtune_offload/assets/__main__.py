"""Command line: ``python -m torchtune_offload.assets [options]`` (``--help`` lists them).

``scripts/make_tiny_assets.py`` runs the same :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from torchtune_offload import assets
from torchtune_offload.assets.build import build_assets
from torchtune_offload.assets.checkpoints import DTYPES, REAL_ARCHES
from torchtune_offload.assets.files import default_tiny_dir, log

# One explicit map of every command-line option.
_OPTIONS: Dict[str, Dict[str, Any]] = {
    "--output-dir": dict(type=Path, default=None,
                         help="destination (default $XDG_CACHE_HOME/torchtune_offload/tiny, else "
                              "~/.cache/torchtune_offload/tiny, where configs/tiny/*.yaml look; "
                              "assets/<arch>_random with --real-arch)"),
    "--seed": dict(type=int, default=0,
                   help="seed for data, tokenizer corpus and weights (default 0)"),
    "--num-examples": dict(type=int, default=1000, help="dataset size in tiny mode (default 1000)"),
    "--real-arch": dict(choices=sorted(REAL_ARCHES), default=None,
                        help="write a random-init checkpoint of this real torchtune architecture "
                             "instead of the tiny assets"),
    "--dtype": dict(choices=sorted(DTYPES), default=None,
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
        prog="python -m torchtune_offload.assets",
        # The package docstring's summary and usage paragraphs.
        description="\n\n".join(assets.__doc__.split("\n\n")[:3]),
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
        output_dir = default_tiny_dir() if args.real_arch is None else Path(f"assets/{args.real_arch}_random")
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
    log(f"done in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

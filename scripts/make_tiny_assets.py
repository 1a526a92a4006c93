#!/usr/bin/env python
"""Build the tiny offline assets: same as ``python -m torchtune_offload.assets``.

Usage (from the repository root)::

    python -m torchtune_offload.assets                 # -> ~/.cache/torchtune_offload/tiny/
    python -m torchtune_offload.assets --help          # all options
    python scripts/make_tiny_assets.py ...             # the same, kept for old commands

This file only calls the package's command line, which it imports like any
other module: from the installed project, or from a checkout with
``PYTHONPATH=.``. ``python -m torchtune_offload.assets`` run from the
repository root always uses the checkout. The ``torchtune_offload.assets``
docstring describes what is written and how the configs use it.
"""

import sys

from torchtune_offload.assets.__main__ import main

if __name__ == "__main__":
    sys.exit(main())

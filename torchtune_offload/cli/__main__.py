"""``python -m torchtune_offload.cli``: the ``tune-offload`` command without its console script."""

import sys

from torchtune_offload.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Installs everything torchtune-offload needs on a fresh machine, then builds the tiny assets.
#
# Usage (from anywhere):  bash scripts/setup.sh
#
# torch is pinned first: on machines that carry a local CPU wheel of torch 2.13.0 this avoids
# pulling gigabytes of CUDA packages; elsewhere it is the release torchtune 0.6.1 is tested with here.
# The project is installed as a regular package (recipes and configs inside it, the tune-offload
# command on PATH); `pip install -e .` works as well for development.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "[setup] installing torch==2.13.0"
$PY -m pip install -q torch==2.13.0
echo "[setup] installing torchtune-offload with its dev extra (torchtune 0.6.1, torchao <0.16, bitsandbytes, wandb, pytest, pytest-xdist)"
$PY -m pip install -q --upgrade ".[dev]"
rm -rf build
echo "[setup] building the tiny offline assets into \${XDG_CACHE_HOME:-~/.cache}/torchtune_offload/tiny"
$PY -m torchtune_offload.assets

#!/usr/bin/env bash
# Sets up a fresh machine and runs the CPU test suite (GPU tests are skipped without a GPU).
#
# Usage:  bash scripts/test.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec ${PYTHON:-python3} -m pytest -q "$@"

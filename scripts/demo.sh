#!/usr/bin/env bash
# The offline demo: sets up a fresh machine, fine-tunes the tiny model with plain AdamW, then again
# with OffloadOptimizer swapped in on the command line, and prints both loss curves side by side
# with a tok/s and memory summary. Runs on CPU in about a minute.
#
# Usage:  bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
OUT=outputs/demo
rm -rf "$OUT"
COMMON="gradient_accumulation_steps=2 clip_grad_norm=1.0"

echo "[demo] 1/2 plain torch.optim.AdamW"
# The tune-offload command, as the Python that setup.sh installed into runs it (whether or not its
# bin folder is on PATH).
$PY -m torchtune_offload.cli run full_finetune_single_device --config tiny/full \
    output_dir=$OUT/adamw $COMMON

echo "[demo] 2/2 the same run with the optimizer offloaded to the host (one command-line change)"
$PY -m torchtune_offload.cli run full_finetune_single_device --config tiny/full \
    output_dir=$OUT/offload $COMMON \
    optimizer._component_=torchtune_offload.OffloadOptimizer \
    optimizer.optimizer_class=torch.optim.AdamW optimizer.offload_gradients=True optimizer.minimal_size=1024

$PY scripts/compare_runs.py adamw=$OUT/adamw offload=$OUT/offload

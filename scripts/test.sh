#!/usr/bin/env bash
# Sets up a fresh machine and runs the CPU test suite (GPU tests are skipped without a GPU).
#
# Usage:  bash scripts/test.sh [extra pytest arguments]
#
# Then, without extra arguments, the engine's test files run a second time on virtual streams
# (pytest --checked-streams, docs/stream_check.md), so that a missing stream wait fails on the CPU.
#
# The suite runs on two pytest-xdist workers (TEST_WORKERS overrides; 0 runs it in one process).
# Most of its time is real runs in child processes, so two workers take it from about 16 minutes to
# about 10 on a 2-core machine. Whole files go to one worker (--dist loadfile), so module-scoped
# fixtures (the straight runs of the kill tests, the planner's checkpoints) are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
$PY -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
# The engine's tests once more on virtual streams, every tensor access checked for races
# (docs/stream_check.md); skipped when pytest is given its own arguments, or with CHECKED_STREAMS=0.
if [ $# -eq 0 ] && [ "${CHECKED_STREAMS:-1}" != 0 ]; then
  echo "[test] the engine's tests again under --checked-streams"
  $PY -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --checked-streams \
    tests/optim/test_offload_optimizer.py tests/optim/test_overlap.py tests/optim/test_master_weights.py \
    tests/optim/test_staging.py tests/optim/test_update_on_device.py tests/optim/test_adamw8bit.py \
    tests/optim/test_transfer_and_capabilities.py tests/optim/test_host_arena.py tests/optim/test_llama_width.py \
    tests/optim/test_fused_step.py tests/optim/test_host_add.py tests/optim/test_fp8_weights.py
fi

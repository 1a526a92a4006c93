#!/usr/bin/env bash
# Sets up a fresh machine and runs the CPU test suite (GPU tests are skipped without a GPU).
#
# Usage:  bash scripts/test.sh [extra pytest arguments]
#
# The engine's test files also run a second time on virtual streams, every tensor access checked
# for races (pytest --also-checked-streams, docs/stream_check.md), so that a missing stream wait
# fails on the CPU; CHECKED_STREAMS=0 leaves that out.
#
# The suite runs on two pytest-xdist workers (TEST_WORKERS overrides; 0 runs it in one process).
# Most of its time is real runs in child processes, so two workers take it from about 16 minutes to
# about 10 on a 2-core machine. Three did not clearly help: on a 2-core Intel Xeon with AMX
# (2026-11-28), nothing else running, 14:23 of pytest on two workers, then 11:27 and 14:58 on
# three. Python children are forked from a process that has imported torch and torchtune once
# (tests/zygote.py; TEST_ZYGOTE=0 starts each afresh): 12:41 of pytest before, 8:10 after, on the
# 2-core Zen 4. Whole files go to one worker (--dist loadfile), so module-scoped
# fixtures (the straight runs of the kill tests, the planner's checkpoints) are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
# Several workers, each starting recipe processes with torch's OpenMP threads: more threads than cores.
# OpenMP's default lets an idle thread spin for a while before it sleeps, burning a core another
# process needs; passive waiting changes no result (only how idle threads wait). Measured on the 2-core
# Zen 4: 12 min 35 s without, then 11 min 54 s, 13 min 54 s (fresh clone, .ci/run) and 12 min 58 s
# with it: any gain is within this machine's drift.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
checked=(--also-checked-streams); [ "${CHECKED_STREAMS:-1}" = 0 ] && checked=()
$PY -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "${checked[@]}" "$@"

#!/usr/bin/env bash
# The golden-loss replay (tests/recipe/golden_runs.py) on emulated x86-64 CPUs without AVX-512, compared
# bit for bit with tests/recipe/golden_losses.json: what an AVX2-only desktop would log.
#
# Usage:  bash scripts/golden_on_emulated_cpus.sh [QEMU_CPU_MODEL...]     (default: Haswell EPYC-Milan)
#         PYTHON=<venv>/bin/python bash scripts/golden_on_emulated_cpus.sh   (a venv, activated or not)
#
# Needs QEMU's user-mode emulator (Debian: apt-get install qemu-user). Each model runs the whole
# replay in one emulated process (about 5 minutes on 2 cores): cpuid then reports that model, so
# torch, MKL and oneDNN choose their kernels as on such a CPU. C passes built during the replay are
# compiled for the model's instruction set (gcc runs natively: its -march=native is mapped here).
# QEMU computes approximate instructions (rcpps, rsqrtps) exactly, as no real CPU does; a difference
# found here is a lead to follow, not proof (tests/recipe/golden_runs.py says what was found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(Haswell EPYC-Milan)
command -v qemu-x86_64 >/dev/null || { echo "needs qemu-x86_64 (Debian: apt-get install qemu-user)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m torchtune_offload.assets --output-dir "$work/assets" >/dev/null
# The interpreter as $PY names it, not the file a virtual environment's symlink leads to: QEMU runs the
# binary the path leads to, while Python finds its environment (pyvenv.cfg, site-packages) from the
# path it was started by, so the resolved path would be the base interpreter without the venv's packages.
emulated_py=$($PY -c "import sys; print(sys.executable)")
host_prefix=$($PY -c "import sys; print(sys.prefix)")
cases=$($PY -c "from tests.recipe.golden_runs import RUNS, OVERLAPPED, case_id
print(' '.join([case_id(n, False) for n in RUNS] + [case_id(n, True) for n in OVERLAPPED]))")
pinned=$($PY -c "from tests.recipe.golden_runs import PINNED_ENV; print(' '.join(f'{k}={v}' for k, v in PINNED_ENV.items()))")
# gcc as it would build on the emulated CPU.
cat > "$work/cc" <<'CC'
#!/bin/sh
for a in "$@"; do [ "$a" = "-march=native" ] && a="-march=$QEMU_MARCH"; set -- "$@" "$a"; shift; done
exec ${REAL_CC:-gcc} "$@"
CC
chmod +x "$work/cc"
status=0
for model in "${models[@]}"; do
  case $model in EPYC-Milan*) march=znver3 ;; EPYC-Rome*) march=znver2 ;; EPYC*) march=znver1 ;; *) march=haswell ;; esac
  echo "=== $model (C passes built with -march=$march)"
  prefix=$(qemu-x86_64 -cpu "$model" "$emulated_py" -c "import sys; print(sys.prefix)") || prefix="(it did not start)"
  if [ "$prefix" != "$host_prefix" ]; then
    echo "under QEMU $emulated_py runs in $prefix, not in $host_prefix as on this machine: set PYTHON to an interpreter binary or a venv's python" >&2
    status=1; continue
  fi
  env $pinned TIKTOKEN_CACHE_DIR= PYTHONPATH="$PWD" CC="$work/cc" QEMU_MARCH=$march \
    qemu-x86_64 -cpu "$model" "$emulated_py" -m tests.recipe.golden_runs --replay "$work/assets" "$work/$model.json" $cases \
    > "$work/$model.log" 2>&1 || { echo "the replay failed:"; tail -20 "$work/$model.log"; status=1; continue; }
  $PY - "$work/$model.json" <<'CMP' || status=1
import json, sys
from tests.recipe.golden_runs import RECORDING_PATH
golden = json.loads(RECORDING_PATH.read_text())["runs"]
replay = json.loads(open(sys.argv[1]).read())
same = 0
for case, result in replay["runs"].items():
    if "error" in result:
        print(f"{case}: failed\n{result['error'][-1500:]}")
        continue
    want = [{k: float(v) for k, v in row.items()} for row in golden[case.removesuffix("+overlap")]]
    rows = result["rows"]
    first = next((i for i, (a, b) in enumerate(zip(rows, want)) if a != b), None)
    if first is None and len(rows) != len(want):
        first = min(len(rows), len(want))
    same += first is None
    print(f"{case}: " + ("bit-identical" if first is None else f"differs from logged step {first + 1}"))
print(f"torch's kernels: {replay['capability']}; {same} of {len(replay['runs'])} replays bit-identical to the recording")
sys.exit(0 if same == len(replay["runs"]) else 1)
CMP
done
exit $status

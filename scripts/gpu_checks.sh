#!/usr/bin/env bash
# The GPU runs not yet made (docs/gpu_results.md records those made), in one run on a CUDA
# machine with the project's dependencies: each step capped, all of them within one deadline, and what they
# print packed into a few files of OUT_DIR.
#
# Usage (from the repository root): BUDGET_S=540 bash scripts/gpu_checks.sh OUT_DIR [STEP...]
#   launching    scripts/bench/bench_launching_thread.py on the GPU: the narrowed 8B's step with every engine
#                mode against plain AdamW, the hand-off per layer and per parameter side by side, eager then
#                compiled
#   hostwork     scripts/bench/bench_launching_beside_host_work.py on the machine's CPU: the launching thread's
#                micro-batch beside the engine's host addition on every core, on all but one, under OpenMP's
#                default wait policy and OMP_WAIT_POLICY=PASSIVE
#   fsdp2        the engine on FSDP2's shards with one CUDA rank (offload_gradients + overlap, update_on device +
#                overlap) against FSDP2 + AdamW: the hand-off from FSDP2's reduce-scatter stream and the waits
#                before its all-gather, which the CPU's stream checker runs without FSDP2's streams; then the
#                same under TORCH_CUDA_SANITIZER=1
#   8b-b1-passive   8b-b1 (below) with OMP_WAIT_POLICY=PASSIVE: the host passes' OpenMP threads sleep after each
#                pass instead of spinning beside the launching thread
#   8b-b1-compiled  8b-b1 (below) with compile=True: each layer compiled as torchtune compiles it
#   8b-b1-per-parameter, 8b-b1-compiled-per-parameter  8b-b1 and 8b-b1-compiled with optimizer.handoff=parameter:
#                the engine's hand-off per gradient, as before the hand-off per layer, on the same machine
#   8b-a8        8b-b1 with 8 micro-batches a step: whether the host step hides behind a longer window
#   tests        pytest -m gpu, all of it but the overlap stress test, first the files that a 170 s cap did not
#                reach on an H100 (2026-11-27, 2d796b6: 64 tests passed in 178 s; 105 s for 70 at 2fdd865)
#   probe        tune-offload probe: the speed model's machine keys on this machine, and how the GPU step's rate
#                was measured (the batch at which the device rather than the launching thread bounds it)
#   sanitizer    under TORCH_CUDA_SANITIZER=1, the GPU tests not yet seen passing under it, in this order: torchao
#                in the recipe and the bitsandbytes recipe tests (ERROR on an H100 at 2fdd865 and 2d796b6, in
#                their assets' forked child: tests/zygote.py no longer forks on a CUDA machine), then the clipped
#                sets of test_sums_added_on_the_device_equal_the_host_rings_bit_for_bit and its last unclipped one
#   8b-b1        llama3_1 8B at 24 GiB, batch 1 x 2048, accumulation 4, clip 1.0, the sums added on the device
#                (offload_grads_overlap_device_sums): 11 steps, the 5th profiled with Python's calls and summarised
#   8b-b2        the same at batch 2 (the f6cc131 run's batch): whether the per-pass cost grows with the batch
#   1b-profiles  llama3_2 1B at 24 GiB, batch 4: torchao, offload_grads, paged_adamw8bit_in_bwd and
#                offload_grads_overlap, 11 steps each, the 9th profiled and summarised (the calibration's gaps
#                "torchao" and "first offload_gradients path", and the in-backward runs under the ballast, within 20%
#                since the model counts bitsandbytes' synchronizations but still +13%), as many of them, in
#                this order, as have 100 s each after 30 s of set-up (the checkpoint's writing)
#   hoststep     torchao's host step (one fused AdamW per tensor), and the 2-norm over the host gradients that
#                torchao's wrapper and the first offload_gradients path measured before each step, each beside
#                torch's one-optimizer step, all cores
# Without STEP arguments every step runs, in the order launching, hostwork, fsdp2, 8b-b1, 8b-b1-passive,
# 8b-b1-compiled, 8b-a8, 8b-b1-per-parameter, 8b-b1-compiled-per-parameter, probe, sanitizer, tests, 8b-b2,
# 1b-profiles, hoststep.
#
# Each step gets its cap (below) or the time left of BUDGET_S (counted from this script's start, default 540: a
# run of 600 s less the install and a margin), whichever is less, and is skipped, saying so, when less than its
# minimum is left. The work goes to WORK (default /tmp/gpu_checks); OUT_DIR gets seven files at most, written
# again after every step, so that a run killed at its limit still leaves the steps done: checks.log (every
# step's output), profiles.md (each sweep's table and each profile's summary), checks.tgz (what gpu_results.sh
# wrote: logs, tables, the sweeps' folders without their traces) and trace-8b-TAG.json.gz (the trace of each 8B
# batch-1 run made, TAG b1, b1-compiled, b1-per-parameter or b1-compiled-per-parameter, when under 15 MiB).
# A TERM (a timeout around this script) packs what is done too. A profiled sweep's tok/s counts its profiled
# step, which the profiler slows: read its per-step log rows beside the table, not the table alone.
# Environment: BUDGET_S, WORK, PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: BUDGET_S=540 bash scripts/gpu_checks.sh OUT_DIR [STEP...]}; shift
mkdir -p "$out"
budget=${BUDGET_S:-540}
work=${WORK:-/tmp/gpu_checks}
mkdir -p "$work/sweeps"
start=$SECONDS
PY=${PYTHON:-python3}
export PYTHON=$PY
# The launching thread's benchmark and the 8B runs first: the gap they measure (the 8B's passes against the speed
# model) is the largest, and on an H100 at 2d796b6 a cap stopped the 8B profile before its trace was written. The
# tests passed at 2d796b6 as far as they ran; the sanitizer's sets are those not yet seen passing under it.
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(launching hostwork fsdp2 8b-b1 8b-b1-passive 8b-b1-compiled 8b-a8
                                              8b-b1-per-parameter 8b-b1-compiled-per-parameter
                                              probe sanitizer tests 8b-b2 1b-profiles hoststep)
log=$out/checks.log

#: step -> "cap minimum" in seconds. An 8B step writes its random-init checkpoint first (65-108 s, once per
#: machine), loads the model (about 50 s), runs its steps (8-9 s each) and saves one at the end. The profiled
#: step's trace is written when that step ends, so a run stopped during its final save keeps it (and its log
#: rows); with Python's calls recorded its export took more than 70 s (an H100 at 2d796b6: the cap
#: of 335 s stopped it, after 9 steps). The fifth step profiled, not the ninth, leaves it about 35 s more; a
#: sweep runs 11 steps at least (scripts/gpu_results.sh), and a cap that stops it after the trace keeps the trace.
#: A 1B variant loads, runs its 11 steps and saves in more than 96 s (an H100 at 2fdd865 gave torchao's 96 s
#: after the 1B checkpoint's 14 s of writing, and it had not finished): 1b-profiles gives each 100 s.
declare -A CAPS=([launching]="240 120" [hostwork]="90 40" [8b-b1-passive]="430 300" [fsdp2]="150 60" [8b-b1-compiled]="480 330" [8b-a8]="480 360"
                 [8b-b1-per-parameter]="430 300" [8b-b1-compiled-per-parameter]="480 330"
                 [tests]="170 60" [probe]="70 40" [sanitizer]="150 40" [8b-b1]="430 300"
                 [8b-b2]="330 280" [1b-profiles]="430 130" [hoststep]="150 60")
for step in "${steps[@]}"; do
  [ -n "${CAPS[$step]:-}" ] || { echo "unknown step $step (steps: ${!CAPS[*]})" >&2; exit 2; }
done

pack() {  # the files that come back; safe to run twice
  {
    for table in "$work"/*/sweep-*.md; do
      [ -f "$table" ] || continue
      case $table in *-profile.md) continue ;; esac
      printf '\n## %s\n\n' "$(basename "$table" .md)"; cat "$table"
    done
    for summary in "$work"/*/*-profile.md; do
      [ -f "$summary" ] && { printf '\n## %s\n\n' "$(basename "$summary" .md)"; cat "$summary"; }
    done
  } > "$out/profiles.md"
  # The sweeps' folders travel in gpu_results.sh's own tarballs, without their traces.
  tar czf "$out/checks.tgz" --exclude=./sweeps -C "$work" . 2>/dev/null
  local trace tag
  for tag in b1 b1-compiled b1-per-parameter b1-compiled-per-parameter; do
    trace=$(ls -t "$work"/sweeps/sweep-8B-24-$tag/*/profiling_outputs/*/*.pt.trace.json.gz 2>/dev/null | head -1)
    if [ -n "$trace" ] && [ "$(stat -c %s "$trace")" -lt $((15 * 1024 * 1024)) ]; then
      cp "$trace" "$out/trace-8b-$tag.json.gz"
    fi
  done
}
child=
trap 'echo "stopped (TERM) after $((SECONDS - start)) s" >> "$log"; [ -n "$child" ] && kill "$child" 2>/dev/null
      wait; pack; exit 143' TERM INT

# The command of a step, into the array cmd; $1: the step, $2: its seconds.
command_of() {
  local seconds=$2
  # gpu_results.sh's sweep, 11 steps, the 9th profiled with Python's calls: the 8B trace of an H100 at
  # 2fdd865 showed the passes bound by the threads launching their kernels, but not which Python those
  # threads ran between their ops.
  local sweep=(env STEPS=11 PROFILE_STEP=9 PROFILE_STACK=1 PYTHON="$PY" SWEEP_ROOT="$work/sweeps")
  local sweep_8b=("${sweep[@]}" PROFILE_STEP=5)
  local device_sums=(VARIANTS=offload_grads_overlap_device_sums ACCUMULATION=4 OVERRIDES=clip_grad_norm=1.0
                     VARIANT_TIMEOUT_S=$((seconds - 45)))
  case $1 in
    launching)
      cmd=(bash -c '"$0" scripts/bench/bench_launching_thread.py --device cuda --model 8B --rounds 5 --steps 3 \
                      --per-parameter --json "$1/launching-eager.json" || exit
                    "$0" scripts/bench/bench_launching_thread.py --device cuda --model 8B --rounds 5 --steps 3 \
                      --per-parameter --compiled --json "$1/launching-compiled.json"' "$PY" "$work") ;;
    hostwork) cmd=("$PY" scripts/bench/bench_launching_beside_host_work.py) ;;
    8b-b1-passive) cmd=("${sweep_8b[@]}" OMP_WAIT_POLICY=PASSIVE BATCH_SIZE=1 TAG=b1-passive "${device_sums[@]}"
                        bash scripts/gpu_results.sh "$work/8b-b1-passive" sweep:8B:24) ;;
    8b-b1-compiled) cmd=("${sweep_8b[@]}" BATCH_SIZE=1 TAG=b1-compiled "${device_sums[@]}"
                         OVERRIDES="clip_grad_norm=1.0 compile=True" bash scripts/gpu_results.sh "$work/8b-b1-compiled" sweep:8B:24) ;;
    8b-b1-per-parameter) cmd=("${sweep_8b[@]}" BATCH_SIZE=1 TAG=b1-per-parameter "${device_sums[@]}"
                              OVERRIDES="clip_grad_norm=1.0 optimizer.handoff=parameter"
                              bash scripts/gpu_results.sh "$work/8b-b1-per-parameter" sweep:8B:24) ;;
    8b-b1-compiled-per-parameter) cmd=("${sweep_8b[@]}" BATCH_SIZE=1 TAG=b1-compiled-per-parameter "${device_sums[@]}"
                                       OVERRIDES="clip_grad_norm=1.0 compile=True optimizer.handoff=parameter"
                                       bash scripts/gpu_results.sh "$work/8b-b1-compiled-per-parameter" sweep:8B:24) ;;
    8b-a8) cmd=("${sweep_8b[@]}" BATCH_SIZE=1 TAG=a8 "${device_sums[@]}" ACCUMULATION=8
                bash scripts/gpu_results.sh "$work/8b-a8" sweep:8B:24) ;;
    tests)
      # pytest orders what it collects by folder and file, whatever the order of its arguments: the tests not
      # reached last time run in a pytest of their own first, then the rest without them.
      local first=(tests/recipe/test_recipes_gpu.py tests/plan/test_speed.py tests/optim/test_llama_width.py
                   tests/recipe/test_divergence.py)
      local device_update=tests/optim/test_gpu_offload.py::test_device_update_matches_plain_adamw_bit_for_bit
      local rest=(--deselect "$device_update") file
      for file in "${first[@]}"; do rest+=(--ignore "$file"); done
      cmd=(bash -c '"$0" -m pytest -v -m gpu -p no:cacheprovider -rsfE -k "not stress" "${@:1:5}"
                    "$0" -m pytest -v -m gpu -p no:cacheprovider -rsfE --durations=10 -k "not stress" "${@:6}" tests' \
           "$PY" "${first[@]}" "$device_update" "${rest[@]}") ;;
    fsdp2)
      local sharded=tests/distributed/test_sharded_offload.py::test_the_engine_on_one_cuda_ranks_shards_trains_as_fsdp2_with_adamw
      cmd=(bash -c '"$0" -m pytest -v -m gpu -p no:cacheprovider -rsfE "$1" &&
                    TORCH_CUDA_SANITIZER=1 "$0" -m pytest -v -x -m gpu -p no:cacheprovider -rsfE "$1"' "$PY" "$sharded") ;;
    probe)
      # Its figures go to the log.
      cmd=("$PY" -m torchtune_offload.cli probe) ;;
    sanitizer)
      # pytest runs the tests in the order given: the recipe tests first (their assets are now built by a
      # fresh interpreter, which the sanitizer slows), then the device-sum sets not yet seen passing under it:
      # the clipped ones (ids "0.5-...") and the last unclipped one (the others passed), about 10 s each on
      # an H100. -x: a failure's report comes back before the cap.
      cmd=(env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -v -x -m gpu -p no:cacheprovider -rsfE
           -k "not None-dtype or None-dtype2-fp32-tiny-True"
           tests/recipe/test_recipes_gpu.py::test_torchao_in_the_recipe_matches_plain_adamw_on_gpu
           tests/recipe/test_recipes_gpu.py::test_bitsandbytes_paged_optimizers_learn_on_gpu
           tests/optim/test_gpu_offload.py::test_sums_added_on_the_device_equal_the_host_rings_bit_for_bit) ;;
    8b-b1) cmd=("${sweep_8b[@]}" BATCH_SIZE=1 TAG=b1 "${device_sums[@]}"
                bash scripts/gpu_results.sh "$work/8b-b1" sweep:8B:24) ;;
    8b-b2) cmd=("${sweep_8b[@]}" BATCH_SIZE=2 TAG=b2 "${device_sums[@]}"
                bash scripts/gpu_results.sh "$work/8b-b2" sweep:8B:24) ;;
    1b-profiles)
      # 100 s a variant after 30 s of set-up, the largest gaps first; each capped, so that one that
      # hangs leaves the others their time.
      local variants=(torchao offload_grads paged_adamw8bit_in_bwd offload_grads_overlap)
      local n=$(((seconds - 30) / 100)); [ "$n" -gt 4 ] && n=4
      local chosen; chosen=$(IFS=,; echo "${variants[*]:0:n}")
      cmd=("${sweep[@]}" BATCH_SIZE=4 TAG=1b VARIANTS="$chosen" VARIANT_TIMEOUT_S=$(((seconds - 30) / n))
           bash scripts/gpu_results.sh "$work/1b-profiles" sweep:1B:24) ;;
    hoststep)
      # Two rows, each beside the same baseline: a run of the script per row.
      cmd=(bash -c 'for row in "one optimizer per tensor" "not a step"; do
                      "$0" scripts/bench/bench_host_step.py --params 1.2e9 --steps 10 \
                        --baseline "torch fused AdamW, bf16" --rows "$row" || exit; done' "$PY") ;;
  esac
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)" 2>&1; } >> "$log"
for step in "${steps[@]}"; do
  read -r cap minimum <<< "${CAPS[$step]}"
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$minimum" ]; then
    echo "=== $step: skipped, $left s left of BUDGET_S=$budget (it needs $minimum s)" >> "$log"
    continue
  fi
  [ "$left" -gt "$cap" ] && left=$cap
  echo "=== $step $(date -u +%H:%M:%S), at most $left s" >> "$log"
  command_of "$step" "$left"
  # In the background, so that a TERM reaches this script's trap at once (the trap stops the step).
  timeout -k 10 "$left" "${cmd[@]}" >> "$log" 2>&1 &
  child=$!
  wait "$child"
  echo "=== $step: exit $? after $((SECONDS - start)) s in all" >> "$log"
  child=
  pack
done
pack
tail -40 "$log"

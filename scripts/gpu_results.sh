#!/usr/bin/env bash
# The runs behind docs/gpu_results.md, in stages, on a CUDA machine with the project's dependencies.
#
# Usage (from the repository root): bash scripts/gpu_results.sh OUT_DIR STAGE...
#   tests           nvidia-smi, then `pytest -m gpu` (log: OUT_DIR/gpu-tests.log), then the same tests under
#                   PyTorch's CUDA stream sanitizer, TORCH_CUDA_SANITIZER=1, which reports a kernel that reads or
#                   writes a tensor another stream may still be using (log: OUT_DIR/gpu-tests-sanitizer.log);
#                   each run is stopped after TESTS_TIMEOUT_S / SANITIZER_TIMEOUT_S seconds
#   demo            scripts/gradient_math_demo.py on the GPU (log: OUT_DIR/grad-math.log)
#   sweep:MODEL:GIB the optimizer sweep of MODEL (1B or 3B: llama3_2; 8B: llama3_1) from a random-init checkpoint on
#                   synthetic data; GIB: GPU memory left free by a ballast, or "all" for the whole GPU
#                   (table and logs: OUT_DIR/sweep-MODEL-GIB.tgz, without profiler traces; table also OUT_DIR/sweep-MODEL-GIB.md, each
#                   variant's log also OUT_DIR/sweep-MODEL-GIB-VARIANT.log)
#   pinned:MODEL    pinned host bytes against tensor bytes for MODEL (as for sweep), per offload optimizer
#                   (table: OUT_DIR/pinned-MODEL.md)
#   hoststep        the host step on all of the machine's CPU cores: torch's fused bf16 AdamW against the fused
#                   8-bit pass (bench_host_step.py), and the pass's cost per core and on all cores
#                   (bench_adamw8bit_kernel.py), and the pass as built for AVX2 beside torch's AVX2 kernels
#                   (tables: OUT_DIR/hoststep.md)
# Environment: STEPS (default 20), BATCH_SIZE (default 4), ACCUMULATION (micro-batches per step, default 1; the
#   synthetic dataset is sized for STEPS steps of them), VARIANTS (default: all), VARIANT_TIMEOUT_S (default 240),
#   OVERRIDES (config overrides appended to the sweep's, e.g. "clip_grad_norm=1.0"),
#   SWEEP_ROOT (where the sweeps' folders go, default /tmp),
#   TAG (appended to the sweep's output names, so that two sweeps of one model and limit keep both tables),
#   PROFILE_STEP (a sweep profiles this step of each variant, counted from 1, with every thread recorded
#   (docs/benchmarks.md, "Profiling a step"), and summarises it: OUT_DIR/sweep-MODEL-GIB-VARIANT-profile.md;
#   PROFILE_THREADS=main records the training thread only; PROFILE_STACK=1 records Python's calls too
#   (profiler.with_stack), so that the summary names the Python function a thread was in between ops),
#   TESTS_TIMEOUT_S (default 1800), SANITIZER_TIMEOUT_S (default 3600),
#   PYTHON (the interpreter with the project's dependencies; default python3).
set -uo pipefail
PY=${PYTHON:-python3}
out=$1; shift
mkdir -p "$out"
steps=${STEPS:-20}
variant_timeout=${VARIANT_TIMEOUT_S:-240}
batch=${BATCH_SIZE:-4}
accumulation=${ACCUMULATION:-1}
sweeps=${SWEEP_ROOT:-/tmp}
tests_timeout=${TESTS_TIMEOUT_S:-1800}
sanitizer_timeout=${SANITIZER_TIMEOUT_S:-3600}
# Where `python -m torchtune_offload.assets` writes the tiny assets (torchtune_offload/assets/files.py).
TINY=${XDG_CACHE_HOME:-$HOME/.cache}/torchtune_offload/tiny

gpu_tests() {  # pytest -m gpu, stopped after $1 seconds (the log says so)
  timeout "$1" $PY -m pytest -q -m gpu -p no:cacheprovider tests -rs
  local rc=$?
  [ "$rc" = 124 ] && echo "stopped after $1 s (timeout)"
  return "$rc"
}

family() { [ "$1" = 8B ] && echo llama3_1 || echo llama3_2; }

checkpoint() {  # a random-init checkpoint of model $1, written once per machine
  local dir=/tmp/$(family "$1")_${1,,}_random
  [ -f "$dir/model.safetensors" ] || $PY -m torchtune_offload.assets --real-arch "$(family "$1")_${1,,}" \
    --output-dir "$dir" --no-check >&2
  echo "$dir"
}

# The sweep refuses fewer than 11 steps (one warm-up, ten measured): say so before writing an 8B checkpoint.
if [[ " $* " == *" sweep:"* ]] && [ "$steps" -lt 11 ]; then
  echo "STEPS=$steps: a sweep needs at least 11 (one warm-up step, then at least 10 measured)" >&2; exit 2
fi
# A profiled step follows a warm-up step of the profiler's own: the 2nd step at the earliest.
profile=()
if [ -n "${PROFILE_STEP:-}" ]; then
  if ! [[ "$PROFILE_STEP" =~ ^[1-9][0-9]*$ ]] || [ "$PROFILE_STEP" -lt 2 ] || [ "$PROFILE_STEP" -gt "$steps" ]; then
    echo "PROFILE_STEP=$PROFILE_STEP: give a step from 2 to STEPS=$steps (the step before it warms the profiler up)" >&2
    exit 2
  fi
  profile=(profiler.enabled=True profiler.record_shapes=False "profiler.wait_steps=$((PROFILE_STEP - 2))"
           profiler.warmup_steps=1 profiler.active_steps=1 profiler.num_cycles=1)
  [ "${PROFILE_THREADS:-all}" = main ] && profile+=(profiler.all_threads=False)
  [ "${PROFILE_STACK:-0}" = 1 ] && profile+=(profiler.with_stack=True)
fi

copy_logs() {  # each variant's log of sweep $1 beside the tarball: a failure's traceback comes back even where
  # the tarball cannot, or the sweep was stopped; so do its metric rows (host_step_s, grad_copy_s...), which a
  # stopped sweep's table never gets
  local log
  for log in "$sweeps/$1"/*/run.log; do [ -f "$log" ] && cp "$log" "$out/$1-$(basename "$(dirname "$log")").log"; done
  for log in "$sweeps/$1"/*/logs/log_*.txt; do
    [ -f "$log" ] && cp "$log" "$out/$1-$(basename "$(dirname "$(dirname "$log")")")-metrics.txt"
  done
}

summarise_profiles() {  # each profiled variant of sweep $1: the summary of its trace, beside its log
  local dir variant
  for dir in "$sweeps/$1"/*/profiling_outputs; do
    [ -d "$dir" ] || continue
    variant=$(basename "$(dirname "$dir")")
    $PY scripts/profile_summary.py "$dir" > "$out/$1-$variant-profile.md" 2>&1
  done
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    tests)
      $PY -m torchtune_offload.assets >/dev/null
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
        gpu_tests "$tests_timeout"; } 2>&1 | tee "$out/gpu-tests.log" | tail -25
      TORCH_CUDA_SANITIZER=1 gpu_tests "$sanitizer_timeout" 2>&1 | tee "$out/gpu-tests-sanitizer.log" | tail -25 ;;
    demo)
      $PY -m torchtune_offload.assets >/dev/null
      $PY scripts/gradient_math_demo.py --device cuda --output-dir /tmp/grad_math > "$out/grad-math.log" 2>&1
      tail -12 "$out/grad-math.log" ;;
    sweep:*)
      IFS=: read -r _ model gib <<< "$stage"
      $PY -m torchtune_offload.assets >/dev/null
      ckpt=$(checkpoint "$model")
      name=sweep-$model-$gib${TAG:+-$TAG}
      limit=(); [ "$gib" = all ] || limit=(--gpu-memory-gib "$gib")
      # In the background, so that a TERM (a `timeout` around this script) still brings the logs back.
      $PY scripts/benchmark_sweep.py --config "configs/$(family "$model")/${model}_full_paged_adamw.yaml" \
        --steps "$steps" --output-dir "$sweeps/$name" --timeout-s "$variant_timeout" "${limit[@]}" \
        ${VARIANTS:+--variants "$VARIANTS"} -- \
        checkpointer.checkpoint_dir="$ckpt" "checkpointer.checkpoint_files=[model.safetensors]" \
        checkpointer.output_dir=/tmp/sweep_checkpoints \
        tokenizer.path="$TINY/tokenizer/tokenizer.model" \
        tokenizer.special_tokens_path="$TINY/tokenizer/special_tokens.json" \
        dataset._component_=torchtune_offload.data.synthetic_dataset dataset.seq_len=2048 \
        dataset.num_samples=$((batch * accumulation * steps + 8)) batch_size=$batch \
        gradient_accumulation_steps=$accumulation clip_grad_norm=null \
        dtype=bf16 enable_activation_checkpointing=True ${OVERRIDES:-} "${profile[@]}" &
      sweep_pid=$!
      trap 'copy_logs "$name"; kill -- "$sweep_pid" 2>/dev/null; summarise_profiles "$name"; exit 143' TERM INT
      wait "$sweep_pid"
      trap - TERM INT
      copy_logs "$name"
      summarise_profiles "$name"
      cp "$sweeps/$name/results.md" "$out/$name.md"
      tar czf "$out/$name.tgz" --exclude='*.pt.trace.json*' -C "$sweeps" "$name" ;;
    pinned:*)
      model=${stage#pinned:}; fam=$(family "$model")
      $PY scripts/bench/pinned_memory_report.py --model "torchtune.models.$fam.${fam}_${model,,}" \
        > "$out/pinned-$model.md" 2>&1
      tail -8 "$out/pinned-$model.md" ;;
    hoststep)
      { $PY scripts/bench/bench_host_step.py --params 400e6 --steps 10 --baseline "torch fused AdamW, bf16" \
          --rows "fused C pass"
        $PY scripts/bench/bench_adamw8bit_kernel.py --params 100e6
        $PY scripts/bench/bench_adamw8bit_kernel.py --params 400e6 --threads "$(nproc)" --no-instructions
        ATEN_CPU_CAPABILITY=avx2 $PY scripts/bench/bench_adamw8bit_kernel.py --params 400e6 --threads "$(nproc)" --builds
      } > "$out/hoststep.md" 2>&1
      cat "$out/hoststep.md" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done

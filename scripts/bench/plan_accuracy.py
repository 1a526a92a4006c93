"""The memory planner's predictions against measurement, for a ``device=cpu`` run of a config.

Usage (from the repository root):

    python scripts/bench/plan_accuracy.py --config configs/tiny/full.yaml [key=value ...] [--steps 3]

Three fresh processes, so that none inherits another's memory:

1. the planner (``python -m torchtune_offload.plan --variants config --json ...``): the predicted
   peak host memory of the run, and the traced peak of its training step;
2. the recipe (``tune run``, ``device=cpu``, ``--steps`` steps): the measured peak RSS, the largest
   ``host_rss_peak`` it logs;
3. one training step of the same model, built for real with random weights: the RSS growth from
   before the model is built to the peak of a forward and backward (sampled every millisecond),
   the measured counterpart of the traced step; glibc's mmap threshold is fixed first at 64 KiB
   (``OffloadOptimizer`` fixes it at 1 MiB in a run), so that freed blocks leave RSS. A throwaway
   copy of the model takes one step first and is deleted: the runtime's one-time allocations
   (worker threads and their malloc arenas, kernel caches; about 11 MB here) are then outside the
   measured step, as they are outside the trace, which counts tensors. They stay in the process
   and in its RSS, which the host figure measures.

Prints a markdown table with the relative errors.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchtune_offload.bench.arguments import positive_int
from torchtune_offload.plan.planner import load_config

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3

# Child 3: one real forward and backward, RSS sampled from a thread.
_STEP = """
import os, sys, threading, time, psutil, torch
from omegaconf import OmegaConf
from torchtune_offload.recipe import check_recipe_config, instantiate_model, build_loss
from torchtune_offload.plan.planner import load_config
from torchtune_offload.plan.step_traces import mark_lora, sequence_length
from dataclasses import replace
cfg = load_config(sys.argv[1], sys.argv[4:])
recipe, seq = sys.argv[2], sequence_length(cfg, int(sys.argv[3]) if sys.argv[3] != "-" else None)
settings = replace(check_recipe_config(cfg, recipe=recipe), compile=False)
proc = psutil.Process(os.getpid())
# glibc otherwise raises its mmap threshold as large blocks are freed and keeps later freed blocks
# resident: RSS would then count memory the step no longer holds. A fixed threshold (as
# OffloadOptimizer sets in a run) makes RSS follow what is allocated.
from torchtune_offload.optim.host_allocator import release_freed_host_memory
# 64 KiB, not the 1 MiB a run uses: a small model's tensors are mostly below 1 MiB, and glibc's heap
# kept 3 MB of the tiny model's freed blocks (a 9 MB step measured 12 MB; 9 MB at 64 KiB).
release_freed_host_memory(64 << 10)
x = torch.randn(64, 64, requires_grad=True)  # PyTorch's CPU runtime started, as in the planner
torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]).sum().backward()
peak, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.001)
def step(micro_batches):
    model = instantiate_model(cfg.model, settings)
    if recipe == "lora":
        mark_lora(model)
    loss_fn = build_loss(cfg.loss, model, settings, verbose=False)
    # As the configured optimizer does: offload_gradients frees each gradient once backward has produced it.
    if settings.optimizer.offload_gradients:
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    vocab = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)][0].num_embeddings
    for _ in range(micro_batches):
        tokens = torch.randint(0, vocab, (settings.batch_size, seq))
        labels = torch.randint(0, vocab, (settings.batch_size, seq))
        logits = model(tokens)
        if not isinstance(logits, list):
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        loss = loss_fn(logits, labels)
        del logits  # as the recipe's loop: the logits go before backward
        loss.backward()
        del loss
step(1)  # the throwaway copy: the runtime's one-time allocations happen here
import ctypes, ctypes.util, gc
gc.collect()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)  # its freed blocks leave RSS, not reused unseen
before = proc.memory_info().rss
thread = threading.Thread(target=sample, daemon=True); thread.start()
step(min(settings.gradient_accumulation_steps, 2))
stop.set(); thread.join()
print("STEP_BYTES", max(peak[0], proc.memory_info().rss) - before)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--recipe", choices=["full", "lora"], default=None)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--seq-len", type=positive_int, default=None)
    args = p.parse_args()
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file (give a config's path)")
    overrides = [*args.overrides, "device=cpu"]
    recipe = args.recipe or ("lora" if "lora" in Path(args.config).name else "full")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        plan_json = Path(tmp) / "plan.json"
        plan_cmd = [sys.executable, "-m", "torchtune_offload.plan", "--config", args.config, "--recipe", recipe,
                    "--variants", "config", "--no-fine-tunes", "--json", str(plan_json), *overrides,
                    *(["--seq-len", str(args.seq_len)] if args.seq_len is not None else [])]
        seconds = {"planner": time.perf_counter()}
        planned = subprocess.run(plan_cmd, cwd=REPO, capture_output=True, text=True)
        if planned.returncode != 0 and not plan_json.exists():  # the planner's own words, not a bare exit status
            sys.exit(f"the planner failed (exit {planned.returncode}):\n{planned.stderr.strip()[-3000:]}")
        seconds["planner"] = time.perf_counter() - seconds["planner"]
        plan = json.loads(plan_json.read_text())["plans"][0]
        if plan["problem"]:
            sys.exit(f"the planner refused the config: {plan['problem']}")
        recipe_file = {"full": "full_finetune_single_device", "lora": "lora_finetune_single_device"}[recipe]
        # torchtune's tune as this interpreter runs it: a `tune` on PATH may be another Python's, or missing.
        seconds["run"] = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "torchtune._cli.tune", "run", f"recipes/{recipe_file}.py",
                              "--config", args.config, *overrides, f"output_dir={out}",
                              f"max_steps_per_epoch={args.steps}", "epochs=1",
                              "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                              f"metric_logger.log_dir={out}/logs", "log_peak_memory_stats=True"],
                             cwd=REPO, capture_output=True, text=True)
        seconds["run"] = time.perf_counter() - seconds["run"]
        if run.returncode != 0:
            sys.exit(f"the run failed:\n{run.stderr[-3000:]}")
        from torchtune_offload.recipe import read_disk_log

        measured_host = max(row["host_rss_peak"] for row in read_disk_log(out)) * GIB
        seconds["step"] = time.perf_counter()
        step = subprocess.run([sys.executable, "-c", _STEP, args.config, recipe, str(args.seq_len or "-"),
                               *overrides], cwd=REPO, capture_output=True, text=True, check=True)
        seconds["step"] = time.perf_counter() - seconds["step"]
        measured_step = int(step.stdout.split("STEP_BYTES")[-1])
    predicted_host, predicted_step = plan["host_bytes"], plan["device_bytes"]
    cfg = load_config(args.config, overrides)
    print(f"{args.config} {' '.join(args.overrides)} (device=cpu, {cfg.dtype}, batch {cfg.batch_size}, "
          f"{args.steps} steps)\n")
    print("| figure | predicted GiB | measured GiB | error |")
    print("|---|---:|---:|---:|")
    for label, pred, meas in (("peak host memory (RSS)", predicted_host, measured_host),
                              ("training step (weights, gradients, activations)", predicted_step, measured_step)):
        print(f"| {label} | {pred / GIB:.3f} | {meas / GIB:.3f} | {100 * (pred - meas) / meas:+.1f}% |")
    print("\nseconds: " + ", ".join(f"{name} {s:.1f}" for name, s in seconds.items()))


if __name__ == "__main__":
    main()

"""Every trace the planner makes for the given configs, extrapolated from 4 and 5 layers and traced whole.

Usage (from the repository root):

    python scripts/plan_layers_check.py [configs/llama3_1/8B_qlora_offload.yaml ...]   # default: configs/*/*.yaml

Plans each config as ``python -m torchtune_offload.plan`` does (every variant of the sweep, then
the full, LoRA and QLoRA fine-tunes), and traces each distinct step twice: as the planner does
(a deep decoder's first 4 and 5 layers, extrapolated: ``plan/trace.py``) and whole. Prints one
line per step, ``SAME`` where the peak and its split by kind agree to the byte, ``DIFF`` where
not, and a config the planner cannot plan with its error. A step the plan takes from another's
trace (the same step without its optimizer, ``StepTrace.without_optimizer``) is checked against
its own whole trace. Exits 1 on any ``DIFF``. Whole traces
of 7-8B models take 5-35 s each on 2 cores: all shipped configs take about half an hour.
"""

import glob
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from torchtune_offload.plan import trace
from torchtune_offload.plan.__main__ import _recipe_of
import torchtune_offload.plan.planner as planner
import torchtune_offload.plan.step_traces as step_traces


def step_key(cfg, settings, options) -> str:
    """The key of the step ``trace_training_step(cfg, settings, **options)`` traces: what shapes its trace.

    The planner shares a trace between the variants of one config only; across configs, the steps
    that shape a trace (batch, length, dtype, ...) are keyed here too.
    """
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if options.get("make_optimizer") else None
    micro_batches = 1 if options.get("free_gradients") else min(settings.gradient_accumulation_steps, 2)
    loss = str(OmegaConf.select(cfg, "loss"))
    return json.dumps([OmegaConf.to_container(cfg.model, resolve=True), optimizer, loss, settings.batch_size,
                       options["seq_len"], str(settings.dtype), settings.enable_activation_checkpointing,
                       micro_batches, options.get("free_gradients"), options.get("fp8_weights"),
                       options.get("mark_trainable") is None, str(settings.device)], sort_keys=True)


def traced_whole(cfg, settings, **options):
    """``trace.trace_training_step`` with every layer traced, none extrapolated."""
    layers, trace.REDUCED_LAYERS = trace.REDUCED_LAYERS, (10**9, 10**9)  # more than any model: whole
    try:
        return trace.trace_training_step(cfg, settings, **options)
    finally:
        trace.REDUCED_LAYERS = layers


def main(paths) -> int:
    checked, differ = {}, []

    def both_ways(cfg, settings, **options):
        key = step_key(cfg, settings, options)
        if key not in checked:
            start = time.perf_counter()
            planned = trace.trace_training_step(cfg, settings, **options)
            middle = time.perf_counter()
            whole = traced_whole(cfg, settings, **options)
            compare(key, planned, whole, cfg=cfg, settings=settings, options=options,
                    step=bool(options.get("make_optimizer")),
                    seconds=(middle - start, time.perf_counter() - middle))
            checked[key] = planned
            if planned.without_optimizer is not None:
                # The plan takes the step without the optimizer from this trace: traced whole without it,
                # and counted as a step of its own.
                middle = time.perf_counter()
                whole = traced_whole(cfg, settings, **{**options, "make_optimizer": None})
                compare(key + " without its optimizer", planned.without_optimizer, whole, cfg=cfg, settings=settings,
                        options=options, step="derived without it", seconds=(0.0, time.perf_counter() - middle))
                checked[key + " without its optimizer"] = planned.without_optimizer
        return checked[key]

    def compare(key, planned, whole, *, cfg, settings, options, step, seconds):
        same = (planned.peak_bytes, planned.by_kind) == (whole.peak_bytes, whole.by_kind)
        if not same:
            differ.append(key)
        print(f"{'SAME' if same else 'DIFF'} {cfg.model._component_}, traced layers "
              f"{planned.traced_layers or 'all'}, free_gradients={options.get('free_gradients')}, optimizer "
              f"step={step}, fp8_weights={options.get('fp8_weights')}, batch "
              f"{settings.batch_size} x {options['seq_len']}: {planned.peak_bytes} and {whole.peak_bytes} bytes "
              f"({seconds[0]:.1f} s and {seconds[1]:.1f} s)", flush=True)

    # Where the plan's steps call the tracer (one process: the planner's parallel tracing is the CLI's).
    step_traces.trace_training_step = both_ways
    for path in paths:
        recipe = _recipe_of(Path(path))
        print(f"== {path} ({recipe})", flush=True)
        try:
            traces = {}
            plans = [planner.plan_variant(path, [], name, recipe=recipe, seq_len=None, baseline=0, traces=traces)
                     for name in planner.default_variants()]
            if recipe in ("full", "lora"):
                planner.plan_fine_tunes(path, [], plans[0], seq_len=None, baseline=0, traces=traces)
        except Exception as err:  # a config the planner itself cannot plan: said, and the others go on
            print(f"cannot plan {path}: {type(err).__name__}: {trace.one_line(err)}", flush=True)
    print(f"{len(checked)} steps, {len(differ)} differ")
    if not checked:
        print("no step was traced through the check: the planner no longer calls the tracer it replaces", flush=True)
    return 1 if differ or not checked else 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    if any(arg.startswith("-") for arg in sys.argv[1:]):
        sys.exit(f"plan_layers_check.py takes config paths only, no options: {sys.argv[1:]}")
    missing = [arg for arg in sys.argv[1:] if not Path(arg).is_file()]
    if missing:
        sys.exit(f"plan_layers_check.py: no such config file: {', '.join(missing)}")
    sys.exit(main(sys.argv[1:] or sorted(glob.glob("configs/*/*.yaml"))))

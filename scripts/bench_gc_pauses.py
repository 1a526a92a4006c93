"""Python's garbage collector during training steps: as it is, with what setup made frozen (what the
recipes' training loop does, ``torchtune_offload.recipe.train_loop``), and switched off.

Usage: python scripts/bench_gc_pauses.py [--models 8B] [--steps 12]

Each model is a real architecture narrowed to a width of 64 (``torchtune_offload.models.narrow``),
in bf16 with activation checkpointing on every layer, stepped by ``OffloadOptimizer`` with
``offload_gradients``, ``overlap`` and the sums added on the device (the CPU machine's device is
its host), 4 micro-batches of 1 x 64 tokens and clipping a step: the host's work of a step of the
8B configuration whose passes ran slow on the H100 (docs/gpu_results.md), with the arithmetic made
small. Each mode runs 2 warm-up steps, then ``--steps`` steps timed, one mode after the other in one
process (the frozen mode unfreezes when it ends). The frozen mode freezes after its warm-up, so the
optimizer's states are frozen too; the recipes freeze before their first step, and leave the
states the first step makes to the collector. ``gc.callbacks`` time every collection. Prints a
markdown table naming the CPU: per mode the median step, the collections of each generation and
the seconds inside them per step, the longest collection, and the objects the collector tracks
(frozen ones are not).
"""

import gc
import statistics
import time
from typing import Dict, List

import torch

from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.models.narrow import NARROW_MODELS, checkpointed_llama, models_and_steps, one_sequence

#: The narrowed models' width, the tokens of a micro-batch, micro-batches a step, warm-up steps.
WIDTH, TOKENS, MICRO_BATCHES, WARMUP = 64, 64, 4, 2
#: The modes, in the order they run.
MODES = ("as it is", "frozen after warm-up", "switched off")


class CollectionTimer:
    """Times every collection of Python's garbage collector while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds: Dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count: Dict[int, int] = {0: 0, 1: 0, 2: 0}
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        self.seconds[info["generation"]] += took
        self.count[info["generation"]] += 1
        self.longest = max(self.longest, took)


def measure(name: str, *, steps: int) -> List[Dict[str, float]]:
    """One row per mode of :data:`MODES` for ``name``'s narrowed architecture."""
    model = checkpointed_llama(name, width=WIDTH, max_seq_len=TOKENS)
    opt = OffloadOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=1e-5, offload_gradients=True,
                           minimal_size=0, overlap=True, grad_sum_on="device")
    opt.register_forward_waits(model)
    tokens = one_sequence(TOKENS)

    def step() -> float:
        start = time.perf_counter()
        for _ in range(MICRO_BATCHES):
            model(tokens).float().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    rows = []
    try:
        for mode in MODES:
            for _ in range(WARMUP):
                step()
            if mode == MODES[1]:
                gc.collect()
                gc.freeze()
            elif mode == MODES[2]:
                gc.disable()
            timer = CollectionTimer()
            gc.callbacks.append(timer)
            try:
                times = [step() for _ in range(steps)]
                tracked = len(gc.get_objects())
            finally:
                gc.callbacks.remove(timer)
                gc.unfreeze()
                gc.enable()
            rows.append({"mode": mode, "step": statistics.median(times), "tracked": tracked,
                         "longest": timer.longest, **{f"n{g}": timer.count[g] / steps for g in range(3)},
                         **{f"s{g}": timer.seconds[g] / steps for g in range(3)}})
    finally:
        opt.close()
    return rows


def main() -> None:
    models, steps = models_and_steps(__doc__, models="8B", steps=12, steps_help=f"timed steps a mode, after {WARMUP} "
                                                                                "warm-up")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; width {WIDTH}, bf16, "
          f"activation checkpointing, {MICRO_BATCHES} micro-batches of 1 x {TOKENS} tokens a step, clipped; "
          f"{steps} steps a mode\n")
    print("| model | collector | median step, s | collections a step (gen 0 / 1 / 2) | "
          "s in collections a step (gen 0 / 1 / 2) | longest collection, s | objects tracked, not frozen |")
    print("|---|---|---:|---|---|---:|---:|")
    for name in models:
        for r in measure(name, steps=steps):
            print(f"| {NARROW_MODELS[name][0]} | {r['mode']} | {r['step']:.3f} | "
                  f"{r['n0']:.1f} / {r['n1']:.2f} / {r['n2']:.2f} | "
                  f"{r['s0']:.4f} / {r['s1']:.4f} / {r['s2']:.4f} | {r['longest']:.4f} | {r['tracked']} |")


if __name__ == "__main__":
    main()

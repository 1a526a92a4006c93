"""The host's own cost of a forward and a backward of a real architecture, with its arithmetic made
negligible: the floor a thread that launches every op eagerly cannot go under.

Usage: python scripts/bench_eager_dispatch.py [--models 1B,8B] [--steps 8]

Each model is built as torchtune builds it (its layers and tied embeddings) but narrowed to a
width of 64 (``torchtune_offload.models.narrow``), in bf16, with activation checkpointing on every layer as the
recipes set it, and trained on one sequence of 16 tokens: what is left of a pass is the dispatch of
its ops (and, for the backward, the checkpointed forward again). On a GPU the launches add to it.
Prints a markdown table naming the CPU: median seconds of a forward and of a backward, after 2
warm-up steps.
"""

import statistics
from typing import Dict

import torch

from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.models.narrow import (NARROW_MODELS, checkpointed_llama, models_and_steps, one_sequence,
                                             pass_seconds)

#: The narrowed models' width, the tokens of a step, and the steps left out of the medians.
WIDTH, TOKENS, WARMUP = 64, 16, 2


def measure(name: str, *, steps: int) -> Dict[str, float]:
    """Median seconds of a forward and of a backward of ``name``'s narrowed architecture."""
    model = checkpointed_llama(name, width=WIDTH, max_seq_len=TOKENS)
    forward, backward = pass_seconds(model, one_sequence(TOKENS), steps=steps + WARMUP)
    return {"forward": statistics.median(forward[WARMUP:]), "backward": statistics.median(backward[WARMUP:])}


def main() -> None:
    models, steps = models_and_steps(__doc__, models="1B,8B", steps=8, steps_help=f"timed steps after {WARMUP} warm-up")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; width 64, bf16, activation "
          f"checkpointing, 1 x {TOKENS} tokens; medians of {steps} steps\n")
    print("| model | forward, s | backward, s |")
    print("|---|---:|---:|")
    for name in models:
        m = measure(name, steps=steps)
        print(f"| {NARROW_MODELS[name][0]} | {m['forward']:.4f} | {m['backward']:.4f} |")


if __name__ == "__main__":
    main()

"""Host memory of each offload policy for Llama 3.2 1B / 3B and Llama 3.1 8B, computed on meta tensors.

Usage: python scripts/bench/host_memory_table.py [--process-gib 3.5]

Prints a markdown table: host bytes per parameter and the total for each model when training on a
GPU in bf16 (on CUDA the engine's buffers are pinned at their size, one block per purpose, torchao's each
rounded up to a power of two by torch's pinned allocator), and whether the total plus the process's
own memory fits a 32, 64 and 128 GB machine.
"""

import argparse

import torch
from torchtune.models.llama3_1 import llama3_1_8b
from torchtune.models.llama3_2 import llama3_2_1b, llama3_2_3b

from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.bench.arguments import non_negative_number
from torchtune_offload.optim.host_memory import plan_host_memory

GIB = 1024**3
MODELS = {"llama3_2 1B": llama3_2_1b, "llama3_2 3B": llama3_2_3b, "llama3_1 8B": llama3_1_8b}
ADAMW = "torch.optim.AdamW"
#: name -> (optimizer class, its options, gradient accumulation steps)
POLICIES = {
    "OffloadOptimizer, AdamW (bf16 states)": (OffloadOptimizer, dict(optimizer_class=ADAMW), 1),
    "OffloadOptimizer, AdamW, offload_gradients + accumulation":
        (OffloadOptimizer, dict(optimizer_class=ADAMW, offload_gradients=True), 4),
    "OffloadOptimizer, AdamW, master_dtype fp32 (fp32 masters and states)":
        (OffloadOptimizer, dict(optimizer_class=ADAMW, master_dtype="fp32"), 1),
    "OffloadOptimizer, bitsandbytes AdamW8bit": (OffloadOptimizer, dict(optimizer_class="bitsandbytes.optim.AdamW8bit"), 1),
    "OffloadOptimizer, torchtune_offload AdamW8bit, offload_gradients":
        (OffloadOptimizer, dict(optimizer_class="torchtune_offload.AdamW8bit", offload_gradients=True), 1),
    "torchao CPUOffloadOptimizer, AdamW": (CPUOffloadOptimizer, dict(optimizer_class=ADAMW), 1),
    "OffloadOptimizer, AdamW, update_on=device (states only; weights and gradients on the device)":
        (OffloadOptimizer, dict(optimizer_class=ADAMW, update_on="device"), 1),
}
MACHINES_GB = (32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--process-gib", type=non_negative_number, default=3.5,
                        help="host memory of the process besides the optimizer (default 3.5: the RSS of a "
                             "1B run without offload on the H100, docs/gpu_results.md)")
    args = parser.parse_args()
    header = "| policy | " + " | ".join(f"{m}: B/param, GiB" for m in MODELS) + " | " + " | ".join(
        f"fits {gb} GB" for gb in MACHINES_GB) + " |"
    print(header)
    print("|---|" + "---:|" * len(MODELS) + ":---:|" * len(MACHINES_GB))
    models = {}
    for name, builder in MODELS.items():
        with torch.device("meta"):
            models[name] = builder().to(torch.bfloat16)
    for policy, (cls, options, accum) in POLICIES.items():
        cells, fits = [], {gb: [] for gb in MACHINES_GB}
        for name, model in models.items():
            params = list(model.named_parameters())
            plan = plan_host_memory(cls, params, device=torch.device("cuda"), gradient_accumulation_steps=accum,
                                    options=dict(options))
            numel = sum(p.numel() for _, p in params)
            cells.append(f"{plan.total / numel:.2f}, {plan.total / GIB:.1f}")
            for gb in MACHINES_GB:
                if plan.total / GIB + args.process_gib <= gb * 1e9 / GIB:
                    fits[gb].append(name.split()[-1])
        print(f"| {policy} | " + " | ".join(cells) + " | " + " | ".join(
            ", ".join(fits[gb]) or "none" for gb in MACHINES_GB) + " |")


if __name__ == "__main__":
    main()

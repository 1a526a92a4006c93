"""Host memory the engine adds per rank on FSDP2's shards: the plan against each rank's RSS growth.

Usage: python scripts/bench/fsdp_offload_rss.py [--ranks 2] [--layers 12] [--width 2048] [--steps 2]
       [--offload-gradients --accumulation 2]

Shards a bf16 model of ``--layers`` square bias-free linears (each an FSDP2 unit) over ``--ranks``
gloo ranks on this CPU and builds ``ShardedOffloadOptimizer`` (the engine on each rank's shards,
torch's AdamW with bf16 states; with ``--offload-gradients`` also ``offload_gradients`` and ``overlap``,
``--accumulation`` micro-batches a step) in each. Every rank trains ``--steps`` steps, drops the gradients, and
reports its RSS growth from just before the optimizer is built to after the last step, beside the
host memory the recipes' pre-flight plans for one rank's engine (``OffloadOptimizer.plan_host_memory``
over that rank's shards, as ``recipe/checks/fit.py`` counts it). On a CPU the FSDP2 "device" is this
host too: its shards and gradients are in RSS before the optimizer is built, and the gradients are
dropped before measuring. Prints a markdown table naming the CPU.
"""

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench.arguments import positive_int
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.distributed.sharded_offload import ShardedOffloadOptimizer


def _rank(rank: int, ranks: int, store: str, args: argparse.Namespace, out: str) -> None:
    """One rank: shard, measure the engine's RSS growth, write the figures to ``out``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]).bfloat16()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    options = dict(offload_gradients=True, overlap=True) if args.offload_gradients else {}
    opt = ShardedOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-4, **options)
    opt.register_forward_waits(model)
    for _ in range(args.steps):
        for micro_batch in range(args.accumulation):
            if micro_batch == args.accumulation - 1:
                opt.expect_final_backward(clipping=False)
            model(torch.randn(2, args.width, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the model's gradients are FSDP2's, not the optimizer's
    opt.synchronize()
    gc.collect()
    grown = process.memory_info().rss - before
    shards = [(name, p.to_local().detach().to("meta").requires_grad_()) for name, p in model.named_parameters()]
    plan = OffloadOptimizer.plan_host_memory(shards, "torch.optim.AdamW", device="cpu", lr=1e-4,
                                             gradient_accumulation_steps=args.accumulation, **options)
    local = sum(p.numel() for _, p in shards)
    Path(out).write_text(json.dumps({"rank": rank, "numel": local, "plan": plan.total, "grown": grown,
                                     "report": opt.memory_report().host_bytes}))
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--layers", type=positive_int, default=12, help="square linears (default 12)")
    parser.add_argument("--width", type=positive_int, default=2048, help="their width (default 2048)")
    parser.add_argument("--steps", type=positive_int, default=2, help="training steps before measuring (default 2)")
    parser.add_argument("--accumulation", type=positive_int, default=1, help="micro-batches a step (default 1)")
    parser.add_argument("--offload-gradients", action="store_true",
                        help="offload_gradients and overlap: the gradient shards to the host as FSDP2 hands them over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.ranks)]
        procs = [_start(r, args, tmp, outs[r]) for r in range(args.ranks)]
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            parser.exit(1, f"a rank failed (exit codes {[proc.exitcode for proc in procs]})\n")
        rows = [json.loads(Path(o).read_text()) for o in outs]
    total = args.layers * args.width * args.width
    print(f"{cpu_name()}, torch {torch.__version__}, gloo; {total / 1e6:.1f}M bf16 parameters in {args.layers} "
          f"linears of {args.width} x {args.width} over {args.ranks} ranks, torch AdamW (bf16 states)"
          f"{', offload_gradients and overlap' if args.offload_gradients else ''}, {args.steps} steps of "
          f"{args.accumulation} micro-batch(es); RSS growth from before the optimizer is built to after the last step "
          "(gradients dropped), per rank\n")
    print("| rank | shard parameters | planned host bytes | memory_report host bytes | RSS growth | growth / plan |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rank']} | {r['numel']} | {r['plan']} | {r['report']} | {r['grown']} "
              f"| {r['grown'] / r['plan']:.3f} |")


def _start(rank: int, args: argparse.Namespace, tmp: str, out: str) -> mp.Process:
    """A fresh process for one rank (spawned: no memory another run freed blurs its growth)."""
    proc = mp.get_context("spawn").Process(target=_rank,
                                           args=(rank, args.ranks, os.path.join(tmp, "store"), args, out))
    proc.start()
    return proc


if __name__ == "__main__":
    main()

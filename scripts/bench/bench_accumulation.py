"""Host cost of a non-final micro-batch with ``offload_gradients``, before and after the fused
addition, side by side in one run, against the host AdamW step on the same parameters.

Usage (from the repository root, on a CPU-only machine):

    python scripts/bench/bench_accumulation.py [--params 100e6] [--grad-sum-dtype fp32] [--master-dtype fp32]
                                               [--optimizer adamw8bit] [--repeats 10] [--warmup 2] [--threads N]
                                               [--before torch|portable]

The parameters are bf16 tensors of Llama 3.2 3B layer shapes (attention 3072x3072 and 1024x3072,
MLP 8192x3072), as many as reach --params (the last one cut to fit), trained by one
``OffloadOptimizer(offload_gradients=True, minimal_size=0)`` with the host step an accelerator's
host runs (torch's fused CPU AdamW; with fp32 masters the engine's fused C pass; with
``--optimizer adamw8bit`` this project's AdamW8bit pass, 8-bit host states, without fp32 masters).

Each repetition runs a window as the engine sees it: a first micro-batch (copied into the host
sums, not timed), then one non-final micro-batch with each staging path, in turns (each going
first every other repetition), then the host step. A micro-batch is the engine's backward hook on
every parameter, called directly with a fixed gradient (no forward or backward compute), and the
staging ring drained, so that every addition it started is counted. On a CPU-only machine each
gradient's copy to the host is a real copy on the training thread (on an accelerator the DMA engine
makes it), while the ring's own thread adds the chunks already copied. "Host work" is the time of
the additions themselves, timed on the ring's thread (``StagingRing.added_seconds``), with this CPU's
copies running beside them; "alone" times the same additions of the same chunks with no copy beside
them, as on an accelerator host, where the DMA engine copies and the cores only add. (Host work used
to be the micro-batch less its copy, which stopped measuring the additions once they moved off the
training thread and overlapped the copies.)

Paths: ``before``, torch's ``add_`` of each staged chunk into its sum (the engine before the fused
addition), or with ``--before portable`` the fused addition built without AVX512_BF16's rounding
(the engine before that rounding; only on a CPU that has it); ``after``, ``host_add.add_`` (the
engine now). Prints a markdown table with the CPU and
torch's thread count: medians over --repeats, seconds per 100M parameters, bytes per parameter the
work needs, and the ratio of each micro-batch's host work to the host AdamW step.
"""

import argparse
import functools
import statistics
import time
from typing import Dict, List, Optional

import torch

from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench.arguments import positive_int, positive_number
from torchtune_offload.bench.machine import cpu_flags, cpu_name
from torchtune_offload.optim import host_add
from torchtune_offload.optim.fused_step import build_library
from torchtune_offload.optim.staging import StagingRing

#: Llama 3.2 3B's layer: q, k, v, o, gate, up, down (100.7M parameters).
LAYER = [(3072, 3072), (1024, 3072), (1024, 3072), (3072, 3072), (8192, 3072), (8192, 3072), (3072, 8192)]
#: The command-line options: name -> (type, default, help).
OPTIONS: Dict[str, tuple] = {
    "params": (positive_number, 100e6, "parameters in all (the last tensor is cut to fit)"),
    "grad_sum_dtype": (str, None, "fp32 for fp32 gradient sums (default: the parameters' bf16)"),
    "master_dtype": (str, None, "fp32 for fp32 master weights (default: none, bf16 steps)"),
    "optimizer": (str, "adamw", "the host step: adamw (torch's AdamW, or with fp32 masters the fused pass) or "
                                "adamw8bit (torchtune_offload.AdamW8bit, 8-bit states; not with fp32 masters)"),
    "repeats": (positive_int, 10, "measured repetitions after warm-up"),
    "warmup": (int, 2, "repetitions left out of the medians"),
    "threads": (positive_int, None, "torch's intra-op threads (default: torch's choice, all cores)"),
    "before": (str, "torch", "the path to compare with: torch (torch's add_) or portable (the fused addition built "
                             "without AVX512_BF16's rounding, on a CPU that has it)"),
}
#: --before: what the "before" ring adds with.
BEFORE = {"torch": "torch's add_", "portable": "the fused addition without AVX512_BF16's rounding (-mno-avx512bf16)"}
PATHS = ("before", "after")
BYTES = {torch.bfloat16: 2, torch.float32: 4}
#: The host step's optimizer for each --optimizer, with its options.
OPTIMIZERS = {"adamw": ("torch.optim.AdamW", {"fused": True}), "adamw8bit": ("torchtune_offload.AdamW8bit", {})}
#: AdamW8bit's pass per parameter: the bf16 weight read and written (4), the bf16 gradient (2), the
#: 8-bit moments read and written (4), their blocks' scales (0.06): docs/adamw8bit.md.
ADAMW8BIT_BYTES = 10.06


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, (kind, default, text) in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)
    args = p.parse_args()
    for key in ("grad_sum_dtype", "master_dtype"):
        if getattr(args, key) not in (None, "fp32"):
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: use fp32, or leave it out")
    if args.optimizer not in OPTIMIZERS:
        p.error(f"--optimizer={args.optimizer}: use one of {', '.join(OPTIMIZERS)}")
    if args.optimizer == "adamw8bit" and args.master_dtype is not None:
        p.error("--optimizer=adamw8bit with --master-dtype fp32: this script counts AdamW8bit's bytes on bf16 "
                "weights only; leave one of them out")
    if args.before not in BEFORE:
        p.error(f"--before={args.before}: use one of {', '.join(BEFORE)}")
    if args.before == "portable" and "avx512_bf16" not in cpu_flags():
        p.error("--before=portable: this CPU has no AVX512_BF16, so the engine's build is the portable loop "
                "already; use --before torch")
    if args.repeats < 1 or args.warmup < 0 or args.params < 1:
        p.error("--repeats must be at least 1, --warmup at least 0, --params at least 1")
    return args


def shapes(target: float) -> List[tuple]:
    out: List[tuple] = []
    total = 0
    while total < target:
        rows, cols = LAYER[len(out) % len(LAYER)]
        rows = min(rows, -(-int(target - total) // cols))
        out.append((rows, cols))
        total += rows * cols
    return out


def median(values: List[float]) -> float:
    return statistics.median(values)


def host_bytes(*, sum_dtype: torch.dtype, master: bool, eight_bit: bool) -> Dict[str, float]:
    """Bytes per parameter each piece of work must move (reads and writes), gradients in bf16."""
    s, g = BYTES[sum_dtype], 2
    # The step narrows a sum wider than the stepped bf16 copy first (read s, write 2); then torch's
    # fused AdamW reads and writes bf16 weights and moments and reads the gradient, AdamW8bit its
    # pass's bytes, or the engine's C pass the fp32 master and moments and writes the bf16 copy.
    narrow = 0 if s == 2 else s + 2
    if master:
        step = 3 * 8 + s + 2
    elif eight_bit:
        step = narrow + ADAMW8BIT_BYTES
    else:
        step = narrow + 3 * 4 + 2
    return {"copy": 2 * g, "add": g + 2 * s, "step": step}


def staging_rings(opt: OffloadOptimizer, *, before: str) -> Dict[str, StagingRing]:
    """The staging ring of each path (``PATHS``) for ``opt``'s parameters.

    Args:
        opt: the optimizer, with ``offload_gradients=True``.
        before: ``--before``, a key of ``BEFORE``.

    Returns:
        The rings by path.
    """
    largest = max(s.host_grad.numel() * s.host_grad.element_size() for s in opt._slots)
    # The engine builds its own ring (the fused addition); the "before" ring adds with torch's add_,
    # or with the fused addition built without AVX512_BF16.
    rings = {"after": opt._grads.staging,
             "before": StagingRing(opt._transfer, largest_bytes=largest, fused_add=False)}
    if before == "portable":
        portable = host_add.bind_kernels(build_library(host_add.SOURCE, flags=("-mno-avx512bf16",)))
        rings["before"]._add = functools.partial(host_add.add_, library=portable)
    return rings


def additions_alone(ring: StagingRing, *, opt: OffloadOptimizer, staged: List[torch.Tensor]) -> float:
    """The ring's additions of one micro-batch, chunk by chunk into the sums, with no copy beside them.

    Args:
        ring: the ring whose addition is timed.
        opt: the optimizer whose host sums are added into.
        staged: each parameter's gradient as its chunks hold it once copied, flat.

    Returns:
        The seconds the additions took.
    """
    start = time.perf_counter()
    for slot, src in zip(opt._slots, staged):
        dst = slot.host_grad.view(-1)
        per_chunk = ring.chunk_bytes // src.element_size()
        for i in range(0, src.numel(), per_chunk):
            ring._add(dst[i:i + per_chunk], src[i:i + per_chunk])
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dims = shapes(args.params)
    params = [torch.nn.Parameter(torch.randn(d, generator=gen).to(torch.bfloat16)) for d in dims]
    grads = [(torch.randn(d, generator=gen) * 1e-3).to(torch.bfloat16) for d in dims]
    num = sum(p.numel() for p in params)
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    opt = OffloadOptimizer([(f"p{i}", p) for i, p in enumerate(params)], optimizer_class, lr=1e-5,
                           offload_gradients=True, minimal_size=0, grad_sum_dtype=args.grad_sum_dtype,
                           master_dtype=args.master_dtype, **options)
    rings = staging_rings(opt, before=args.before)

    def micro_batch() -> None:
        for p, g in zip(params, grads):
            p.grad = g
            opt.on_gradient(p)  # the backward hook, as autograd calls it
        opt._staging.drain()

    # What each micro-batch's chunks hold once copied: the additions alone read these.
    staged = [g.reshape(-1) for g in grads]

    def timed(path: Optional[str]) -> Dict[str, float]:
        if path is not None:
            opt._grads.staging = rings[path]
        opt._transfer.copy_seconds()  # starts the copy counters from zero
        added = opt._grads.staging.added_seconds
        start = time.perf_counter()
        micro_batch()
        seconds = time.perf_counter() - start
        result = {"total": seconds, "copy": opt._transfer.copy_seconds()["grad"],
                  "add": opt._grads.staging.added_seconds - added}
        if path is not None:
            result["alone"] = additions_alone(rings[path], opt=opt, staged=staged)
        return result

    runs: Dict[str, List[Dict[str, float]]] = {path: [] for path in PATHS}
    steps: List[float] = []
    for rep in range(args.warmup + args.repeats):
        opt.zero_grad()
        timed(None)  # the window's first micro-batch: copied into the sums
        results = {path: timed(path) for path in (PATHS if rep % 2 == 0 else PATHS[::-1])}
        opt.step()
        if rep >= args.warmup:
            for path, result in results.items():
                runs[path].append(result)
            steps.append(opt.step_timings()["host_step_s"])
    opt.close()
    report(runs, steps, args=args, sum_dtype=opt._slots[0].host_grad.dtype, dims=dims, num=num,
           optimizer_class=optimizer_class)


def report(runs: Dict[str, List[Dict[str, float]]], steps: List[float], *, args: argparse.Namespace,
           sum_dtype: torch.dtype, dims: List[tuple], num: int, optimizer_class: str) -> None:
    """Prints the table of both paths' timings (medians of ``runs``) beside the host step's (``steps``)."""
    need = host_bytes(sum_dtype=sum_dtype, master=args.master_dtype is not None,
                      eight_bit=args.optimizer == "adamw8bit")
    step_s = median(steps)
    per_100m = 1e8 / num
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; torch {torch.__version__}")
    print(f"{num / 1e6:.1f}M bf16 parameters in {len(dims)} tensors; gradient sums {str(sum_dtype)[6:]}; "
          f"master weights {args.master_dtype or 'none'}; host step {optimizer_class}; "
          f"medians of {args.repeats} repetitions "
          f"after {args.warmup} warm-up, paths in turns")
    print(f"before: {BEFORE[args.before]}; after: the engine's fused addition")
    print()
    print("| work | s | s per 100M params | bytes/param | GB/s | host work / host step |")
    print("|---|---|---|---|---|---|")
    rows = []
    for path in PATHS:
        total = median([r["total"] for r in runs[path]])
        copy = median([r["copy"] for r in runs[path]])
        host = median([r["add"] for r in runs[path]])
        rows.append((f"{path}: micro-batch on a CPU-only machine", total, need["copy"] + need["add"], None))
        rows.append((f"{path}: the copies, training thread (DMA on an accelerator)", copy, need["copy"], None))
        rows.append((f"{path}: host work, the additions (ring thread)", host, need["add"], host / step_s))
        alone = median([r["alone"] for r in runs[path]])
        rows.append((f"{path}: the additions alone (as on an accelerator)", alone, need["add"], alone / step_s))
    rows.append(("host AdamW step", step_s, need["step"], 1.0))
    for name, seconds, nbytes, ratio in rows:
        rate = nbytes * num / seconds / 1e9 if seconds > 0 else float("inf")
        print(f"| {name} | {seconds:.4f} | {seconds * per_100m:.4f} | {nbytes:g} | {rate:.1f} | "
              + ("" if ratio is None else f"{ratio:.2f}") + " |")
    before = median([r["add"] for r in runs["before"]])
    after = median([r["add"] for r in runs["after"]])
    alone = median([r["alone"] for r in runs["after"]])
    print()
    print(f"Host work of a non-final micro-batch: before {before:.4f} s, after {after:.4f} s "
          f"({before / after:.2f}x); {after / step_s:.2f} of the host AdamW step ({step_s:.4f} s) beside this "
          f"CPU's copies, {alone / step_s:.2f} alone ({alone:.4f} s)")


if __name__ == "__main__":
    main()

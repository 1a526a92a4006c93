"""Host optimizer-step throughput of each precision policy, side by side with torch's fused AdamW.

Usage: python scripts/bench/bench_host_step.py [--params 200e6] [--steps 10] [--threads N] [--rows TEXT]
                                               [--baseline "torch fused AdamW, bf16"]

Tensors are Llama 3.2 1B-shaped layers (attention 2048x2048 and 512x2048, MLP 8192x2048, norms),
repeated until --params is reached, with random gradients. Each row times one whole host step over
all of them (median of --steps after two warm-up steps, which include any compilation) and reports
millions of parameters per second. The engine's rows time exactly the per-parameter step the
offload engine runs on the host (`SlotStepper.step_slot`), without the copies to and from a
device. The "clipped" rows step as a clipped window does (factor 1.0, which clipping multiplies by
whenever the norm is within bounds): each gradient scaled in place and then stepped, or the factor
handed to the step (the C passes apply it as they read the gradient). Prints a markdown table
naming the CPU and the thread count.

A shared or virtual machine's speed drifts by tens of percent within a minute, so each row's steps
alternate with steps of torch's fused fp32 AdamW, and the ratio column compares the two medians of
the same minute (each going first in turn); the first row is that baseline's median over the whole
run. The baseline's tensors stay allocated throughout: the machine needs memory for two rows.
"""

import argparse
import statistics
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.bench.arguments import positive_int, positive_number
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.optim.grad_norm import total_norm

LAYER = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192),
         (2048,), (2048,)]


def shapes(target: float) -> List[tuple]:
    out = []
    while sum(torch.Size(s).numel() for s in out) < target:
        out.extend(LAYER)
    return out


def threads_and_shapes(args: argparse.Namespace) -> Tuple[List[tuple], int]:
    """Sets torch's threads from ``--threads`` (where given); the tensor shapes for ``--params``,
    and their elements in all."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dims = shapes(args.params)
    return dims, sum(torch.Size(s).numel() for s in dims)


def params_of(dims: List[tuple], dtype: torch.dtype) -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in dims:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def _seconds(step: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def time_alternating(step: Callable[[], None], baseline: Callable[[], None], steps: int) -> Tuple[float, float]:
    """Median seconds of ``step`` and of ``baseline``, their steps taken in turn after two warm-up steps each."""
    for _ in range(2):
        step()
        baseline()
    times, base_times = [], []
    for i in range(steps):
        # Each goes first in turn: the one after may find the other's threads still spinning.
        if i % 2:
            times.append(_seconds(step))
            base_times.append(_seconds(baseline))
        else:
            base_times.append(_seconds(baseline))
            times.append(_seconds(step))
    return statistics.median(times), statistics.median(base_times)


def torch_fused(dims, dtype):
    params = params_of(dims, dtype)
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    return opt.step


def torch_fused_per_tensor(dims, dtype):
    """torch's fused AdamW as torchao's ``CPUOffloadOptimizer`` runs it on the host: one optimizer
    per tensor, stepped one after the other (the speed model prices its step at the one-optimizer
    rate, ``host_adamw_bf16_mparams``)."""
    opts = [torch.optim.AdamW([p], lr=1e-5, weight_decay=0.01, fused=True) for p in params_of(dims, dtype)]

    def step():
        for opt in opts:
            opt.step()

    return step


def serial_host_norm(dims, dtype):
    """Not a step: the total 2-norm of the gradients over their host copies, one tensor after the
    other, as torchao's wrapper and the first offload_gradients path measured the norm the recipe
    logs, before each step (both now measure it on the device during backward)."""
    grads = [p.grad for p in params_of(dims, dtype)]
    return lambda: total_norm(grads, device="cpu")


#: The clipping factor of the "clipped" rows: what torch's clip_grad_norm_ multiplies by when the
#: norm is within max_norm (it always multiplies); 1.0 keeps the gradients as they are from step to step.
CLIP_FACTOR = torch.tensor(1.0)


def engine(dims, dtype, *, optimizer_class="torch.optim.AdamW", clip: Optional[str] = None,
           convert_fresh: bool = False, **options):
    """The engine's per-slot host step; ``clip``: None, "mul" (each gradient scaled in place, then
    stepped: the overlapped engine before the factor went into the passes, and the torch path still)
    or "pass" (the factor handed to the step, as the overlapped engine now does). ``convert_fresh``:
    gradients converted into a new tensor each step, as the engine did before it kept a buffer."""
    params = params_of(dims, dtype)
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    kwargs = {"fused": True} if optimizer_class == "torch.optim.AdamW" else {}
    # offload_gradients: the host gradient buffers are the sums it lands (grad_sum_dtype needs it).
    opt = OffloadOptimizer([(f"p{i}", p) for i, p in enumerate(params)], optimizer_class, minimal_size=0,
                           offload_gradients=True, lr=1e-5, weight_decay=0.01, **kwargs, **options)
    for slot, g in zip(opt._slots, grads):
        slot.host_grad.copy_(g)
    if convert_fresh:
        opt._stepper._converted.clear()

    def step():
        for slot in opt._slots:
            # With masters the rounded result overwrites the gradient buffer, as in training.
            if clip == "mul":
                slot.host_grad.mul_(CLIP_FACTOR)
            opt._stepper.step_slot(slot, slot.host_grad, grad_scale=CLIP_FACTOR if clip == "pass" else None)

    return step


def plain(dims, dtype, optimizer_class, **options):
    params = params_of(dims, dtype)
    opt = optimizer_class(params, lr=1e-5, weight_decay=0.01, **options)
    return opt.step


def bitsandbytes_adamw8bit(dims, dtype):
    import bitsandbytes  # optional: the comparison row only

    return plain(dims, dtype, bitsandbytes.optim.AdamW8bit)


def torchao_adamw8bit(dims, dtype):
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit  # optional: the comparison row only

    return plain(dims, dtype, TorchaoAdamW8bit)


def deepspeed_cpu_adam(dims, dtype) -> Optional[Callable[[], None]]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional: only where DeepSpeed installs

    params = params_of(dims, dtype)
    opt = DeepSpeedCPUAdam(params, lr=1e-5, weight_decay=0.01, adamw_mode=True)
    return opt.step


ROWS = {
    "torch fused AdamW, fp32": lambda d: torch_fused(d, torch.float32),
    "torch fused AdamW, bf16": lambda d: torch_fused(d, torch.bfloat16),
    "torch fused AdamW, bf16, one optimizer per tensor (torchao CPUOffloadOptimizer's host step)":
        lambda d: torch_fused_per_tensor(d, torch.bfloat16),
    "not a step: the 2-norm of the bf16 gradients on the host (the logged norm, as torchao's wrapper measured it)":
        lambda d: serial_host_norm(d, torch.bfloat16),
    "engine, fp32 (default policy)": lambda d: engine(d, torch.float32),
    "engine, bf16 (default policy)": lambda d: engine(d, torch.bfloat16),
    "engine, fp32 master / bf16 device, fused pass": lambda d: engine(d, torch.bfloat16, master_dtype="fp32"),
    "engine, fp32 master / bf16 device, unfused": lambda d: engine(d, torch.bfloat16, master_dtype="fp32",
                                                                  fused_master_step=False),
    "engine, fp32 master / bf16 device, unfused, widened into a new tensor each step (before)": lambda d: engine(
        d, torch.bfloat16, master_dtype="fp32", fused_master_step=False, convert_fresh=True),
    "engine, fp32 master / bf16 device, torchtune_offload AdamW8bit states": lambda d: engine(
        d, torch.bfloat16, master_dtype="fp32", optimizer_class="torchtune_offload.AdamW8bit"),
    "engine, fp32 master / bf16 device, torchtune_offload AdamW8bit states, widened into a new tensor each step "
    "(before)": lambda d: engine(d, torch.bfloat16, master_dtype="fp32", optimizer_class="torchtune_offload.AdamW8bit",
                                 convert_fresh=True),
    "engine, bf16, bitsandbytes AdamW8bit states": lambda d: engine(d, torch.bfloat16,
                                                                   optimizer_class="bitsandbytes.optim.AdamW8bit"),
    "DeepSpeed CPUAdam, fp32": lambda d: deepspeed_cpu_adam(d, torch.float32),
    "DeepSpeed CPUAdam, bf16": lambda d: deepspeed_cpu_adam(d, torch.bfloat16),
    "torchtune_offload AdamW8bit, bf16 (fused C pass)": lambda d: plain(d, torch.bfloat16, AdamW8bit),
    "torchtune_offload AdamW8bit, bf16 (pure-torch reference)": lambda d: plain(d, torch.bfloat16, AdamW8bit,
                                                                                  fused=False),
    "engine, bf16, torchtune_offload AdamW8bit states": lambda d: engine(d, torch.bfloat16,
                                                                      optimizer_class="torchtune_offload.AdamW8bit"),
    "engine, bf16 (default policy), clipped (scaled, then stepped)": lambda d: engine(d, torch.bfloat16, clip="mul"),
    "engine, fp32 master / bf16 device, fused pass, clipped: scaled, then stepped": lambda d: engine(
        d, torch.bfloat16, master_dtype="fp32", clip="mul"),
    "engine, fp32 master / bf16 device, fused pass, clipped: factor in the pass": lambda d: engine(
        d, torch.bfloat16, master_dtype="fp32", clip="pass"),
    "engine, bf16, torchtune_offload AdamW8bit states, clipped: scaled, then stepped": lambda d: engine(
        d, torch.bfloat16, optimizer_class="torchtune_offload.AdamW8bit", clip="mul"),
    "engine, bf16, torchtune_offload AdamW8bit states, clipped: factor in the pass": lambda d: engine(
        d, torch.bfloat16, optimizer_class="torchtune_offload.AdamW8bit", clip="pass"),
    "engine, bf16, fp32 gradient sums, rounded into a kept buffer": lambda d: engine(d, torch.bfloat16,
                                                                                    grad_sum_dtype="fp32"),
    "engine, bf16, fp32 gradient sums, rounded into a new tensor each step (before)": lambda d: engine(
        d, torch.bfloat16, grad_sum_dtype="fp32", convert_fresh=True),
    "bitsandbytes AdamW8bit (CPU backend), bf16": lambda d: bitsandbytes_adamw8bit(d, torch.bfloat16),
    "torchao AdamW8bit (CPU), bf16": lambda d: torchao_adamw8bit(d, torch.bfloat16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=positive_number, default=200e6, help="parameters to step (default 200e6)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per row, after 2 warm-up (default 10)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", default="", help="only the rows whose name contains this text (default: all)")
    parser.add_argument("--baseline", default="torch fused AdamW, fp32", choices=["torch fused AdamW, fp32",
                        "torch fused AdamW, bf16"], help="the row every other row alternates with (default fp32)")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    if not any(args.rows in name for name in ROWS if name != args.baseline):
        parser.error(f"--rows {args.rows!r}: no row's name contains it; the rows: {'; '.join(ROWS)}")
    dims, numel = threads_and_shapes(args)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{numel / 1e6:.1f}M parameters in {len(dims)} Llama-shaped tensors; median of {args.steps} steps\n")
    baseline_name = args.baseline
    print(f"| host step | Mparam/s | vs {baseline_name.replace('AdamW, ', '')} |")
    print("|---|---:|---:|")
    baseline = ROWS[baseline_name](dims)
    baseline_times, lines = [], []
    for name, build in ROWS.items():
        if name == baseline_name or args.rows not in name:
            continue
        try:
            step = build(dims)
            seconds, base_seconds = time_alternating(step, baseline, args.steps)
        except Exception as err:  # a row whose library is missing or fails here is reported, not fatal
            lines.append(f"| {name} | n/a: {type(err).__name__}: {str(err).splitlines()[0][:80]} | |")
            print(f"{name}: n/a", file=sys.stderr, flush=True)
            continue
        finally:
            step = None
        baseline_times.append(base_seconds)
        lines.append(f"| {name} | {numel / seconds / 1e6:.0f} | {base_seconds / seconds:.2f}x |")
        print(f"{name}: {numel / seconds / 1e6:.0f} Mparam/s", file=sys.stderr, flush=True)
    base_rate = numel / statistics.median(baseline_times) / 1e6 if baseline_times else float("nan")
    print(f"| {baseline_name} | {base_rate:.0f} | 1.00x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

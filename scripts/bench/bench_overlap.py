"""Step time of OffloadOptimizer with its host step serial and overlapped, side by side in one run.

Usage (from the repository root):

    python scripts/bench/bench_overlap.py --model torchtune.models.llama3_2.llama3_2_1b --device cuda \\
        --batch-size 2 --seq-len 2048 --steps 12 --grad-accum 1 --clip 1.0 --offload-gradients

    # a mid-size Llama on a CPU-only machine (the CPU emulation of the same pipeline):
    python scripts/bench/bench_overlap.py --model torchtune.models.llama3_2.llama3_2 \\
        --model-kwargs '{"vocab_size": 32000, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
                         "embed_dim": 1024, "max_seq_len": 512, "intermediate_dim": 4096}' \\
        --device cpu --dtype fp32 --batch-size 1 --seq-len 256 --steps 6

The model is built with random weights (no download) and trained on random tokens the way the
recipes train (the loss divided by the window's tokens before backward, the window's last backward
announced to the optimizer, clip, step). Both runs start from the same weights and see the same
tokens. Prints a markdown table: median step time after warm-up, and the optimizer's own figures
(``offload_wait_s``, ``host_step_s``, copy times, the hidden share of the host step), plus the
largest difference between the two runs' losses (0 when the overlap is exact).
"""

import argparse
import json
import platform
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F
from torchtune import training
from torchtune.config._utils import _get_component_from_path
from torchtune.modules import TransformerSelfAttentionLayer

from torchtune_offload import OffloadOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ["offload_wait_s", "host_step_s", "grad_copy_s", "param_copy_s", "host_step_hidden"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="dotted path of a torchtune model builder")
    p.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the builder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=None, help="max grad norm (default: no clipping)")
    p.add_argument("--offload-gradients", action="store_true")
    p.add_argument("--master-dtype", choices=["fp32"], default=None)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--lr", type=float, default=1e-5)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.grad_accum < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--grad-accum and --batch-size must be at least 1, --seq-len at least 2")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    builder = _get_component_from_path(args.model)
    with training.set_default_dtype(DTYPES[args.dtype]), torch.device(args.device):
        model = builder(**json.loads(args.model_kwargs))
    # torch's default N(0, 1) embedding, tied to the output in Llama 3.2, gives logits in the
    # hundreds; a trained model's scale makes the losses read as usual.
    torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
    if args.activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    return model


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def run(model, initial: Dict[str, torch.Tensor], data: List[torch.Tensor], args, *, overlap: bool) -> Dict:
    model.load_state_dict(initial)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=args.lr, weight_decay=0.01,
                           offload_gradients=args.offload_gradients, master_dtype=args.master_dtype,
                           overlap=overlap)
    opt.register_forward_waits(model)
    device = torch.device(args.device)
    times, losses, timings = [], [], []
    try:
        for step in range(args.steps):
            window = data[step * args.grad_accum : (step + 1) * args.grad_accum]
            num_tokens = sum(t[:, 1:].numel() for t in window)
            synchronize(device)
            start = time.perf_counter()
            total = torch.zeros((), device=device)
            for i, tokens in enumerate(window):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
                total += loss.detach()
                if i == len(window) - 1:
                    opt.expect_final_backward(clipping=args.clip is not None)
                (loss / num_tokens).backward()
            if args.clip is not None:
                opt.clip_grad_norm_(args.clip)
            opt.step()
            opt.zero_grad()
            losses.append(float(total) / num_tokens)  # waits for the compute stream, not the host steps
            times.append(time.perf_counter() - start)
            timings.append(opt.step_timings())
            print(f"  overlap={overlap} step {step + 1}/{args.steps}: {times[-1]:.3f} s, loss {losses[-1]:.4f}",
                  flush=True)
    finally:
        opt.close()
    kept = timings[args.warmup :]
    figures = {c: statistics.median(t.get(c, 0.0) for t in kept) for c in COLUMNS}
    return {"step_s": statistics.median(times[args.warmup :]), "losses": losses, **figures}


def main() -> None:
    args = parse_args()
    model = build_model(args)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g).to(args.device)
            for _ in range(args.steps * args.grad_accum)]
    params = sum(p.numel() for p in model.parameters())
    device = torch.device(args.device)
    name = (torch.get_device_module(device).get_device_name(device) if device.type != "cpu"
            else platform.processor() or platform.machine())
    print(f"{args.model} ({params / 1e6:.1f}M parameters) on {device} ({name}); host threads "
          f"{torch.get_num_threads()}; {args.dtype}, batch {args.batch_size} x {args.seq_len}, "
          f"accumulation {args.grad_accum}, clip {args.clip}, offload_gradients {args.offload_gradients}, "
          f"master_dtype {args.master_dtype}, activation checkpointing {args.activation_checkpointing}",
          flush=True)
    results = {overlap: run(model, initial, data, args, overlap=overlap) for overlap in (False, True)}
    print(f"\nMedians over steps {args.warmup + 1}-{args.steps}:\n")
    print("| overlap | step s | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * (len(COLUMNS) + 1))
    for overlap, r in results.items():
        print(f"| {'on' if overlap else 'off'} | {r['step_s']:.3f} | "
              + " | ".join(f"{r[c]:.3f}" for c in COLUMNS) + " |")
    diff = max(abs(a - b) for a, b in zip(results[False]["losses"], results[True]["losses"]))
    speedup = results[False]["step_s"] / results[True]["step_s"]
    print(f"\nOverlap step time: {speedup:.2f}x the serial one's speed; largest loss difference {diff:.3g}.")
    # host_step_hidden counts the training thread's waits, which the two modes spend in different
    # places (the overlapped one also waits for gradients to land); step times compare like with like.
    serial_host = results[False]["host_step_s"]
    if serial_host > 0:
        saved = results[False]["step_s"] - results[True]["step_s"]
        print(f"Step time saved: {saved:.3f} s, {saved / serial_host:.0%} of the serial host step ({serial_host:.3f} s).")


if __name__ == "__main__":
    main()

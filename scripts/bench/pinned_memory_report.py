"""Pinned host bytes against tensor bytes for a real architecture, for each offload optimizer.

Usage (from the repository root):

    python scripts/bench/pinned_memory_report.py [--model torchtune.models.llama3_2.llama3_2_1b] [--device cuda]

The model is built on the meta device and given uninitialised memory on ``--device`` in bf16 (no
checkpoint is needed). Each optimizer then allocates its host buffers, and the table gives, per
optimizer: the bytes of the host buffers' tensors, what its ``memory_report()`` says it holds pinned
and in all, and the process's RSS growth while it was built. On CUDA page-locking makes every
buffer resident at once; elsewhere a buffer becomes resident when first written (the parameter
copies at once, gradient buffers at the first backward), so there RSS growth is lower. On CUDA
``OffloadOptimizer`` pins one exactly sized block per purpose (parameter copies, gradient buffers,
device-dtype copies) and torchao's optimizer one power-of-two-rounded allocation per buffer; on a
CPU nothing is pinned and torchao's optimizer does not run.

RSS may miss page-locked memory the driver maps into the process lazily (a rounded block's untouched
tail), so two more columns measure it otherwise: the growth of torch's pinned allocator
(``torch.cuda.host_memory_stats()``, block sizes as requested from CUDA; our in-place locking does
not go through it) and the drop of the machine's available memory (``MemAvailable``, noisy by the
page cache; keep the machine quiet).
"""

import argparse
import gc

import psutil
import torch
from torchtune.config._utils import _get_component_from_path

from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer

GIB = 1024**3


def build_model(builder: str, device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = _get_component_from_path(builder)().to(torch.bfloat16)
    return model.to_empty(device=device)


def pinned_allocator_bytes(device: torch.device):
    """Bytes torch's pinned allocator holds (its blocks, at their rounded sizes), or None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def tensor_bytes(optimizer) -> int:
    """Bytes of the tensors the optimizer keeps as host buffers (copies, gradients, outputs)."""
    if isinstance(optimizer, OffloadOptimizer):
        tensors = [t for s in optimizer._slots if s.offloaded for t in s.host_buffers]
    else:
        tensors = [t for h in optimizer.param_d2h_map.values() for t in (h, h.grad)]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="torchtune.models.llama3_2.llama3_2_1b", help="a torchtune model builder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_model(args.model, device)
    numel = sum(p.numel() for p in model.parameters())
    process = psutil.Process()
    candidates = {
        "OffloadOptimizer": lambda: OffloadOptimizer(model.named_parameters(), offload_gradients=True, lr=1e-5),
        "OffloadOptimizer, master_dtype fp32": lambda: OffloadOptimizer(
            model.named_parameters(), offload_gradients=True, master_dtype="fp32", lr=1e-5),
        "torchao CPUOffloadOptimizer": lambda: CPUOffloadOptimizer(model.named_parameters(), offload_gradients=True,
                                                                   lr=1e-5),
    }
    print(f"{args.model}, {numel / 1e6:.1f}M parameters in bf16 on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); GiB\n")
    print("| optimizer | buffer tensors | pinned (report) | pinned / tensors | host (report) | RSS growth "
          "| torch pinned allocator growth | available memory drop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, build in candidates.items():
        gc.collect()
        before, allocator_before, available_before = (process.memory_info().rss, pinned_allocator_bytes(device),
                                                      psutil.virtual_memory().available)
        try:
            optimizer = build()
        except Exception as err:  # torchao's optimizer refuses a CPU device
            print(f"| {name} | n/a: {type(err).__name__}: {str(err).splitlines()[0][:80]} | | | | | | |", flush=True)
            continue
        grown = process.memory_info().rss - before
        dropped = available_before - psutil.virtual_memory().available
        allocator = pinned_allocator_bytes(device)
        allocator_grown = "-" if allocator is None else f"{(allocator - allocator_before) / GIB:.3f}"
        report = optimizer.memory_report()
        tensors = tensor_bytes(optimizer)
        ratio = f"{report.pinned_bytes / tensors:.4f}" if report.pinned_bytes else "-"
        print(f"| {name} | {tensors / GIB:.3f} | {report.pinned_bytes / GIB:.3f} | {ratio} | "
              f"{report.host_bytes / GIB:.3f} | {grown / GIB:.3f} | {allocator_grown} | {dropped / GIB:.3f} |",
              flush=True)
        if hasattr(optimizer, "close"):
            optimizer.close()
        del optimizer


if __name__ == "__main__":
    main()

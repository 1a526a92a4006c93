"""``tune-offload probe [--output machine.json]``: measures the speed model's machine keys here.

Host keys everywhere (memory copy, torch's fused bf16 AdamW, this project's AdamW8bit and its
fused fp32-master pass over every core); GPU keys (the bf16 FLOP rate of a small Llama's training
step, pinned PCIe copies both ways, the time per synchronization of a bitsandbytes optimizer's
step) only where CUDA is present. Elsewhere the result names the GPU keys to take from a preset
(:func:`torchtune_offload.plan.speed.preset_names`).
"""

import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torchtune import modules, training
from torchtune.models.llama3 import llama3

from torchtune_offload.optim import fused_step
from torchtune_offload.optim.adamw8bit import AdamW8bit
from torchtune_offload.optim.optimizer_class import resolve_optimizer
from torchtune_offload.plan.speed import MACHINE_KEYS, bitsandbytes_syncs_per_step, preset_names

GPU_KEYS = ("gpu_bf16_tflops", "pcie_h2d_gbs", "pcie_d2h_gbs", "device_sync_us")
#: Sizes of a full probe: well past the caches, and done in well under a minute on a desktop.
FULL_SIZES = {"copy_bytes": 1 << 30, "step_params": 1 << 26, "pcie_bytes": 1 << 30}
#: The Llama 3 whose training step :func:`step_tflops` times: 4 layers of the 1B's width, its
#: batch of 2 x 2048 tokens; about 0.3B matmul weights, 3 GiB of device memory.
STEP_MODEL = {"num_layers": 4, "width": 2048, "batch": 2, "seq_len": 2048, "vocab": 32768}
#: The parameters whose bitsandbytes step :func:`sync_call_us` times: each update a few
#: microseconds of GPU work, and past the 100,000 elements from which bitsandbytes pages a state
#: (``Optimizer8bit.get_state_buffer``), so each call prefetches its paged states as the real
#: models' do.
SYNC_PROBE = {"tensors": 64, "numel": 1 << 17}
#: Resolved by name where used, as a config names it: every tune-offload verb imports this module,
#: and bitsandbytes takes about a second to import (and warns without CUDA), for a CUDA-only key.
SYNC_PROBE_OPTIMIZER = "bitsandbytes.optim.PagedAdamW8bit"


def _best_seconds(fn: Callable[[], None], *, repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up (first-use costs kept out)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def master_step(params: int) -> Callable[[], None]:
    """One step of the engine's fp32-master AdamW over ``params`` elements, as its host step runs it
    (``slot_step.SlotStepper.step_slot``): the fused pass (fp32 master and moments, a bf16 gradient,
    the bf16 weight written), or where the pass cannot be built here, torch's fused fp32 AdamW on
    the widened gradient and the weight rounded after it.

    Args:
        params: the elements of the one parameter it steps.

    Returns:
        A function that takes one step each call.
    """
    master = torch.randn(params, dtype=torch.float32)
    optimizer = torch.optim.AdamW([master], lr=1e-4, weight_decay=0.01, fused=True)
    grad = torch.randn(params, dtype=torch.bfloat16)
    out = torch.empty(params, dtype=torch.bfloat16)

    def step() -> None:
        if not fused_step.fused_adamw_step(optimizer, grad, out):
            master.grad = grad.float()
            optimizer.step()
            out.copy_(master)

    return step


def probe_host(*, copy_bytes: int, step_params: int, repeats: int = 3) -> Dict[str, float]:
    """The host keys: copy bandwidth (read plus written), the three AdamW steps' rates, the cores."""
    src = torch.ones(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = _best_seconds(lambda: dst.copy_(src), repeats=repeats)
    src = dst = None  # freed before the steps allocate theirs
    rates = {}
    for key, make in (("host_adamw_bf16_mparams", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                      ("host_adamw8bit_mparams", lambda ps: AdamW8bit(ps, lr=1e-4))):
        p = torch.nn.Parameter(torch.randn(step_params, dtype=torch.bfloat16))
        p.grad = torch.randn_like(p)
        optimizer = make([p])
        rates[key] = step_params / _best_seconds(optimizer.step, repeats=repeats) / 1e6
        del optimizer, p
    rates["host_adamw_master_mparams"] = step_params / _best_seconds(master_step(step_params), repeats=repeats) / 1e6
    return {"host_copy_gbs": 2 * copy_bytes / copy / 1e9, **rates, "host_cores": float(host_cores())}


def step_tflops(*, device: torch.device, num_layers: int, width: int, batch: int, seq_len: int, vocab: int,
                repeats: int = 3) -> float:
    """The bf16 FLOP rate of a training step as the speed model counts it (8 x matmul weights x
    tokens, activation checkpointing on), from a small torchtune Llama 3 on ``device``: forward,
    loss, backward. The model's attention, norms and loss cost what a real step's do, which a bare
    matmul's rate would leave out."""
    with training.set_default_dtype(torch.bfloat16):
        model = llama3(vocab_size=vocab, num_layers=num_layers, num_heads=max(1, width // 128),
                       num_kv_heads=max(1, width // 512), embed_dim=width, intermediate_dim=int(width * 3.5),
                       max_seq_len=seq_len).to(device)
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    tokens = torch.randint(0, vocab, (batch, seq_len), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def train_step() -> None:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    seconds = _best_seconds(train_step, repeats=repeats, sync=sync)
    # The token embedding is a lookup, not a matmul.
    weights = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    return 8 * weights * batch * seq_len / seconds / 1e12


def sync_call_us(*, device: torch.device, tensors: int, numel: int, repeats: int = 3) -> float:
    """The launching thread's microseconds per synchronization of a bitsandbytes optimizer.

    Times a ``PagedAdamW8bit`` step over ``tensors`` bf16 parameters of ``numel`` elements on
    ``device`` and divides it by the step's synchronizations (after each parameter's update, and
    once more at its end: :func:`~torchtune_offload.plan.speed.bitsandbytes_syncs_per_step`). Each
    update is a few microseconds of GPU work, so the step is the calls' Python, their launches and
    the synchronizations' round trips: what the GPU waits for after each synchronization in a real
    step (speed model: ``device_sync_us``).

    Args:
        device: where the parameters live (CUDA for the key; the CPU in tests).
        tensors: how many parameters the step updates.
        numel: the elements of each.
        repeats: timed steps after one warm-up (which makes the states); the fastest counts.

    Returns:
        Microseconds per synchronization.
    """
    params = [torch.nn.Parameter(torch.randn(numel, dtype=torch.bfloat16, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = resolve_optimizer(SYNC_PROBE_OPTIMIZER, key="SYNC_PROBE_OPTIMIZER")(params, lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = _best_seconds(optimizer.step, repeats=repeats, sync=sync)  # the first step makes the states
    return seconds / bitsandbytes_syncs_per_step(tensors=tensors, paged=True, in_backward=False) * 1e6


def probe_gpu(*, pcie_bytes: int, step: Dict[str, int], repeats: int = 3,
              sync_probe: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """The GPU keys on CUDA device 0: :func:`step_tflops`, pinned copies each way, and
    :func:`sync_call_us`."""
    device = torch.device("cuda")
    sync = torch.cuda.synchronize
    tflops = step_tflops(device=device, repeats=repeats, **step)
    sync_us = sync_call_us(device=device, repeats=repeats, **{**SYNC_PROBE, **(sync_probe or {})})
    host = torch.empty(pcie_bytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(pcie_bytes, dtype=torch.uint8, device=device)
    h2d = _best_seconds(lambda: gpu.copy_(host, non_blocking=True), repeats=repeats, sync=sync)
    d2h = _best_seconds(lambda: host.copy_(gpu, non_blocking=True), repeats=repeats, sync=sync)
    return {"gpu_bf16_tflops": tflops, "pcie_h2d_gbs": pcie_bytes / h2d / 1e9, "pcie_d2h_gbs": pcie_bytes / d2h / 1e9,
            "device_sync_us": sync_us}


def probe(*, sizes: Optional[Dict[str, int]] = None,
          step_model: Optional[Dict[str, int]] = None) -> Tuple[Dict[str, float], List[str]]:
    """Measures what this machine can.

    Returns:
        ``(keys, missing)``: the measured keys, and the GPU keys this machine cannot measure.
    """
    sizes = {**FULL_SIZES, **(sizes or {})}
    measured = probe_host(copy_bytes=sizes["copy_bytes"], step_params=sizes["step_params"])
    missing: List[str] = []
    if torch.cuda.is_available():
        measured.update(probe_gpu(pcie_bytes=sizes["pcie_bytes"], step={**STEP_MODEL, **(step_model or {})}))
    else:
        missing = list(GPU_KEYS)
    return {k: round(measured[k], 1) for k in MACHINE_KEYS if k in measured}, missing


def run_probe(output: Optional[Path], *, sizes: Optional[Dict[str, int]] = None) -> str:
    """Probes, writes ``output`` (when given and every key was measured, else the measured keys with
    the missing ones named) and returns the report to print."""
    measured, missing = probe(sizes=sizes)
    lines = [f"{k} = {v}" for k, v in measured.items()]
    if missing:
        lines.append(f"No CUDA device here: take {', '.join(missing)} from a preset "
                     f"({', '.join(preset_names())}; their figures: torchtune_offload/plan/machines.json) "
                     "and add them to the file before --machine reads it.")
    if output is not None:
        output.write_text(json.dumps(measured, indent=1) + "\n")
        lines.append(f"wrote {output}" + (f" (without {', '.join(missing)})" if missing else ""))
    return "\n".join(line for line in lines if line)

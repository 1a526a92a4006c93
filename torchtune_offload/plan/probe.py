"""``tune-offload probe [--output machine.json] [--gpu-from PRESET]``: measures the speed model's
machine keys here.

Host keys everywhere (memory copy, torch's fused bf16 AdamW, this project's AdamW8bit and its
fused fp32-master pass over every core); GPU keys (the bf16 FLOP rate of a small Llama's training
step, pinned PCIe copies both ways, the time per synchronization of a bitsandbytes optimizer's
step, and the GPU's memory, which the planner takes as its device budget) only where CUDA is
present. Elsewhere the result names the GPU keys to take from a preset
(:func:`torchtune_offload.plan.speed.preset_names`), or takes them from the one ``--gpu-from`` names.
"""

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torchtune import modules, training
from torchtune.models.llama3 import llama3

from torchtune_offload.models.narrow import checkpointed_llama, one_sequence
from torchtune_offload.optim import OffloadOptimizer, fused_step
from torchtune_offload.optim.adamw8bit import AdamW8bit
from torchtune_offload.optim.optimizer_class import resolve_optimizer
from torchtune_offload.plan.launch import COUNT_TOKENS, COUNT_WIDTH, count_ops, micro_batch
from torchtune_offload.plan.speed import (DEVICE_MEMORY_KEY, MACHINE_KEYS, bitsandbytes_syncs_per_step, load_machine,
                                          preset_about, preset_names)

GPU_KEYS = ("gpu_bf16_tflops", "pcie_h2d_gbs", "pcie_d2h_gbs", "device_sync_us", "launch_us_per_op", "handoff_us")
#: The narrowed architecture (``models.narrow``) whose passes :func:`launch_costs` times: llama3_1
#: 8B's 32 layers and tensors at width 64, so that the launching thread, not the arithmetic, is the pass.
LAUNCH_PROBE = {"model": "8B", "repeats": 7}
#: Sizes of a full probe: well past the caches, and done in well under a minute on a desktop.
FULL_SIZES = {"copy_bytes": 1 << 30, "step_params": 1 << 26, "pcie_bytes": 1 << 30}
#: The Llama 3 whose training step :func:`step_tflops` times: 4 layers of the 1B's width, batches of
#: 2048-token sequences; about 0.3B matmul weights, 3 GiB of device memory at batch 2, about 8 at 8.
STEP_MODEL = {"num_layers": 4, "width": 2048, "batches": (2, 4, 8), "seq_len": 2048, "vocab": 32768}
#: A step whose device finished within this factor of its launching thread's last launch was bound by
#: the launching thread (the device waited for the CPU), not by the device's arithmetic.
LAUNCH_BOUND_FACTOR = 1.25
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


class StepRate(NamedTuple):
    """What :func:`step_tflops` measured: the rate, the batch it came from, and whether even that batch
    was bound by the launching thread (then the rate is a lower bound for the device's)."""

    tflops: float
    batch: int
    launch_s: float
    wall_s: float

    @property
    def launch_bound(self) -> bool:
        """Whether the device finished within :data:`LAUNCH_BOUND_FACTOR` of the last launch."""
        return self.wall_s < LAUNCH_BOUND_FACTOR * self.launch_s


def first_device_bound(time_batch: Callable[[int], Tuple[float, float]], *, batches: Sequence[int],
                       flops_per_sample: float) -> StepRate:
    """The step's rate at the first of ``batches`` that the device, not the launching thread, bounds.

    A small step on a fast GPU measures the CPU that launches its kernels; each larger batch gives
    every kernel more work for the same launches. The batches are tried in order until one is
    device-bound; one that runs out of device memory ends the search with the previous batch's rate.

    Args:
        time_batch: ``batch -> (launch_s, wall_s)``: the step's seconds until its last launch
            returned, and until the device finished it.
        batches: the batches to try, smallest first.
        flops_per_sample: FLOPs of one sample's step as the speed model counts them.

    Returns:
        The :class:`StepRate` of the last batch measured.
    """
    rate: Optional[StepRate] = None
    for batch in batches:
        try:
            launch_s, wall_s = time_batch(batch)
        except torch.OutOfMemoryError:
            if rate is None:
                raise
            break
        rate = StepRate(flops_per_sample * batch / wall_s / 1e12, batch, launch_s, wall_s)
        if not rate.launch_bound:
            break
    if rate is None:
        raise ValueError("first_device_bound: batches is empty; give at least one batch to time")
    return rate


def step_tflops(*, device: torch.device, num_layers: int, width: int, batches: Sequence[int], seq_len: int,
                vocab: int, repeats: int = 3) -> StepRate:
    """The bf16 FLOP rate of a training step as the speed model counts it (8 x matmul weights x
    tokens, activation checkpointing on), from a small torchtune Llama 3 on ``device``: forward,
    loss, backward. The model's attention, norms and loss cost what a real step's do, which a bare
    matmul's rate would leave out. Each of ``batches`` is timed in turn until the device bounds the
    step (:func:`first_device_bound`): at batch 2 the H100 machine's probe read a third of the rate
    its recorded runs reached (docs/planner.md)."""
    with training.set_default_dtype(torch.bfloat16):
        model = llama3(vocab_size=vocab, num_layers=num_layers, num_heads=max(1, width // 128),
                       num_kv_heads=max(1, width // 512), embed_dim=width, intermediate_dim=int(width * 3.5),
                       max_seq_len=seq_len).to(device)
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def time_batch(batch: int) -> Tuple[float, float]:
        tokens = torch.randint(0, vocab, (batch, seq_len), device=device)

        def train_step() -> float:
            start = time.perf_counter()
            logits = model(tokens)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
            return time.perf_counter() - start

        train_step()  # first-use costs (kernels chosen, memory reserved) kept out
        sync()
        best = (float("inf"), float("inf"))
        for _ in range(repeats):
            start = time.perf_counter()
            launch_s = train_step()
            sync()
            best = min(best, (time.perf_counter() - start, launch_s))
        model.zero_grad(set_to_none=True)
        return best[1], best[0]

    # The token embedding is a lookup, not a matmul.
    weights = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    return first_device_bound(time_batch, batches=batches, flops_per_sample=8 * weights * seq_len)


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


class LaunchCosts(NamedTuple):
    """What :func:`launch_costs` measured."""

    #: The launching thread's microseconds per aten operator of the passes.
    us_per_op: float
    #: Its microseconds per hand-off of the engine, beyond the model's operators (at least 0.1).
    handoff_us: float
    #: The operators of one plain micro-batch, and the engine's hand-offs in one backward.
    ops: int
    handoffs: int


def launch_costs(*, device: torch.device, model: str, repeats: int) -> LaunchCosts:
    """The launching thread's cost per operator and per engine hand-off, on ``device``.

    The narrowed ``model`` (``models.narrow``; its arithmetic negligible) runs micro-batches
    (:func:`~torchtune_offload.plan.launch.micro_batch`) timed until ``backward()`` returns, before
    the device is synchronized: the launching thread's seconds. Plain micro-batches, over the
    operators one dispatches (counted in a run of its own, as the planner counts them), give the cost
    per operator; micro-batches of a copy under this project's engine (``offload_gradients``, the
    sums of later micro-batches on the device, as the 8B configs run), their extra seconds over the
    engine's hand-offs, the cost per hand-off. The two take turns, ``repeats`` times each; the
    medians count.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain = checkpointed_llama(model, width=COUNT_WIDTH, max_seq_len=COUNT_TOKENS).to(device)
    hooked = checkpointed_llama(model, width=COUNT_WIDTH, max_seq_len=COUNT_TOKENS).to(device)
    engine = OffloadOptimizer(list(hooked.named_parameters()), minimal_size=0, lr=1e-5, offload_gradients=True,
                              grad_sum_on="device")
    tokens = one_sequence(COUNT_TOKENS).to(device)

    def timed(net: torch.nn.Module) -> float:
        sync()
        start = time.perf_counter()
        micro_batch(net, tokens)
        seconds = time.perf_counter() - start
        sync()
        return seconds

    def step_engine() -> None:
        engine.step()
        engine.zero_grad()

    try:
        for net in (plain, hooked):  # first-use costs kept out
            timed(net)
        plain.zero_grad(set_to_none=True)
        step_engine()
        ops = count_ops(lambda: micro_batch(plain, tokens))
        plain.zero_grad(set_to_none=True)
        before = engine.handoff_count()
        plain_s, engine_s = [], []
        for _ in range(repeats):
            plain_s.append(timed(plain))
            plain.zero_grad(set_to_none=True)
            engine_s.append(timed(hooked))
            step_engine()
        handoffs = (engine.handoff_count() - before) // repeats
    finally:
        engine.close()
    us_per_op = statistics.median(plain_s) / ops * 1e6
    extra = statistics.median(engine_s) - statistics.median(plain_s)
    return LaunchCosts(us_per_op, max(0.1, extra / max(1, handoffs) * 1e6), ops, handoffs)


def step_note(rate: StepRate, *, seq_len: int) -> str:
    """The report's line on how :func:`step_tflops` got its rate."""
    note = (f"gpu_bf16_tflops: a training step of batch {rate.batch} x {seq_len}, its launching thread "
            f"{rate.launch_s:.3f} s of its {rate.wall_s:.3f} s")
    if rate.launch_bound:
        note += (": the device waited for the CPU even at this batch, so the rate is a lower bound for the "
                 "device's; take gpu_bf16_tflops from a measured run or a preset (docs/planner.md)")
    return note


def probe_gpu(*, pcie_bytes: int, step: Dict[str, Any], repeats: int = 3,
              sync_probe: Optional[Dict[str, int]] = None) -> Tuple[Dict[str, float], List[str]]:
    """The GPU keys on CUDA device 0: :func:`step_tflops`, pinned copies each way, and
    :func:`sync_call_us`.

    Returns:
        ``(keys, notes)``: the keys, and the lines that say how the step's rate was measured.
    """
    device = torch.device("cuda")
    sync = torch.cuda.synchronize
    launch = launch_costs(device=device, **LAUNCH_PROBE)
    rate = step_tflops(device=device, repeats=repeats, **step)
    torch.cuda.empty_cache()  # the step's batches gave back before the copies reserve theirs
    sync_us = sync_call_us(device=device, repeats=repeats, **{**SYNC_PROBE, **(sync_probe or {})})
    host = torch.empty(pcie_bytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(pcie_bytes, dtype=torch.uint8, device=device)
    h2d = _best_seconds(lambda: gpu.copy_(host, non_blocking=True), repeats=repeats, sync=sync)
    d2h = _best_seconds(lambda: host.copy_(gpu, non_blocking=True), repeats=repeats, sync=sync)
    keys = {"gpu_bf16_tflops": rate.tflops, "pcie_h2d_gbs": pcie_bytes / h2d / 1e9,
            "pcie_d2h_gbs": pcie_bytes / d2h / 1e9, "device_sync_us": sync_us,
            "launch_us_per_op": launch.us_per_op, "handoff_us": launch.handoff_us}
    return keys, [step_note(rate, seq_len=step["seq_len"]), launch_note(launch, model=LAUNCH_PROBE["model"])]


def launch_note(launch: LaunchCosts, *, model: str) -> str:
    """The report's line on how :func:`launch_costs` got its figures."""
    return (f"launch_us_per_op, handoff_us: the narrowed {model}'s micro-batch, {launch.ops} operators, and under the "
            f"engine {launch.handoffs} hand-offs a backward")


class Probed(NamedTuple):
    """What :func:`probe` measured."""

    #: The machine keys measured here, rounded to a tenth.
    keys: Dict[str, float]
    #: The GPU keys this machine cannot measure (no CUDA).
    missing: List[str]
    #: Lines on how a figure was measured, for the report.
    notes: List[str]


def probe(*, sizes: Optional[Dict[str, int]] = None, step_model: Optional[Dict[str, Any]] = None) -> Probed:
    """Measures what this machine can (:class:`Probed`)."""
    sizes = {**FULL_SIZES, **(sizes or {})}
    measured = probe_host(copy_bytes=sizes["copy_bytes"], step_params=sizes["step_params"])
    missing: List[str] = []
    notes: List[str] = []
    if torch.cuda.is_available():
        gpu_keys, notes = probe_gpu(pcie_bytes=sizes["pcie_bytes"], step={**STEP_MODEL, **(step_model or {})})
        measured.update(gpu_keys)
        # Rounded down below, as the budget it becomes must not exceed the device.
        measured[DEVICE_MEMORY_KEY] = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        missing = list(GPU_KEYS)
    keys = {k: round(measured[k], 1) for k in MACHINE_KEYS if k in measured}
    if DEVICE_MEMORY_KEY in measured:
        keys[DEVICE_MEMORY_KEY] = math.floor(measured[DEVICE_MEMORY_KEY] * 10) / 10
    return Probed(keys, missing, notes)


def run_probe(output: Optional[Path], *, sizes: Optional[Dict[str, int]] = None,
              gpu_from: Optional[str] = None) -> str:
    """Probes, writes ``output`` (when given) and returns the report to print.

    Args:
        output: the machine file to write: every key measured, else the measured ones with the
            missing ones named (or taken from ``gpu_from``).
        sizes: the probes' sizes (tests make them small), else :data:`FULL_SIZES`.
        gpu_from: a preset whose figures fill in the keys this machine cannot measure (no CUDA
            device), so that the file is a whole machine for ``--machine``. It never replaces a
            measured key (to use another figure for one, edit the file); the report names each
            key it filled in, or says that it was not needed.

    Returns:
        The report: one line a key, then the notes, what was filled in or is missing, and the file.

    Raises:
        ValueError: ``gpu_from`` is not a preset, naming the presets (before anything is measured).
    """
    if gpu_from is not None and gpu_from not in preset_names():
        raise ValueError(f"--gpu-from {gpu_from}: not a preset; the presets are {', '.join(preset_names())}")
    measured, missing, notes = probe(sizes=sizes)
    lines = [f"{k} = {v}" for k, v in measured.items()] + notes
    if missing and gpu_from is not None:
        preset = load_machine(gpu_from).as_dict()
        filled = missing + [k for k in (DEVICE_MEMORY_KEY,) if k in preset]  # optional: where the preset has it
        lines += [f"{k} = {preset[k]} (from the preset {gpu_from})" for k in filled]
        if preset_about(gpu_from).get("estimate"):
            lines.append(f"The preset {gpu_from}'s figures are estimates, not measurements (their sources: "
                         "docs/planner.md#presets).")
        # In the keys' order, as a file the probe measured whole is written.
        measured = {k: measured[k] if k in measured else preset[k] for k in [*MACHINE_KEYS, DEVICE_MEMORY_KEY]
                    if k in measured or k in preset}
        missing = []
    elif missing:
        lines.append(f"No CUDA device here: take {', '.join(missing)} from a preset "
                     f"({', '.join(preset_names())}; their figures: torchtune_offload/plan/machines.json), with "
                     "--gpu-from <preset> or by hand, before --machine reads the file.")
    elif gpu_from is not None:
        lines.append(f"--gpu-from {gpu_from}: not used, every key was measured here.")
    if output is not None:
        output.write_text(json.dumps(measured, indent=1) + "\n")
        lines.append(f"wrote {output}" + (f" (without {', '.join(missing)})" if missing else ""))
    return "\n".join(line for line in lines if line)

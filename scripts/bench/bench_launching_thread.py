"""The launching thread's cost of each engine mode against plain AdamW, side by side in one run.

Usage: python scripts/bench/bench_launching_thread.py [--model 8B] [--rounds 5] [--steps 4] [--accum 4]
       [--modes KEY,KEY...] [--compiled] [--per-parameter] [--threads 1] [--cpu-defaults]
       [--device cpu|cuda] [--json FILE]

The model is a real architecture (``torchtune_offload.models.narrow``: llama3_1 8B's 32 layers and
parameter tensors by default) narrowed to width 64, in bf16, with activation checkpointing on every
layer as the recipes set it: its arithmetic is negligible, so a step's time is what the thread that
launches the ops spends, the floor of a micro-batch on a GPU that keeps pace with its launches.
Every mode trains its own copy of the model (same weights) on the same micro-batches of 1 x 16
tokens, ``--accum`` micro-batches a step, clipping at 1.0 as the recipes clip, ``minimal_size=0``
so every parameter is the engine's.

The modes are interleaved: each of ``--rounds`` rounds runs ``--steps`` timed steps of every mode,
one mode after the other, so a drift of the machine touches all of them alike; a mode's ratio is the
median over rounds of its median step time over plain AdamW's in the same round. With
``--compiled`` every mode's layers are compiled as torchtune's ``compile: True`` compiles them
(``training.compile_model``), and the ratios are to compiled plain AdamW. With ``--device cuda`` the
models train on the GPU (each step ends with a synchronization), where the launching thread's work
is what keeps the GPU waiting.

Torch's operators run on one intra-op thread unless ``--threads`` says otherwise: at width 64 an
operator's own work takes microseconds, and with more threads every operator that goes parallel
(matrix products, inductor's kernels) also pays OpenMP's start and join of its team, work that a GPU
does on the device, not on the launching thread, and that hides the engine's work in a longer step
(docs/benchmarks.md gives both).

The optimizers are built as the recipes build them on a GPU machine, where the launching thread's
work matters: plain AdamW takes torch's multi-tensor loop (``foreach``, torch's default for CUDA
tensors), and the engine's host steps of torch's AdamW take torch's fused CPU kernel (what
OffloadOptimizer chooses on an accelerator; torchao's wrapper chooses it everywhere). On a CPU-only
machine torch and the engine default to the single-tensor loop instead (the engine so that its
emulation keeps plain AdamW's bits): ``--cpu-defaults`` builds them so, which times a dozen Python-
dispatched operators a parameter in plain AdamW's step and in the engine's host-step thread, whose
interpreter lock the launching thread then waits for.

Per step it reports seconds (for FP8 device weights also the seconds its design's functions take,
:data:`DESIGN_FUNCTIONS`, timed in further steps, with the ratio to plain AdamW's plus them), the
aten ops the training thread dispatches (from a profile of one more step: the ops no other aten op
called, on that thread alone, so that the engine's worker threads are not counted and a compiled
graph counts as no op), of them those FP8 device weights' design needs (found by the profile's
Python calls) with the ratio to plain AdamW's ops plus them, the engine's hook calls in backward
(one per gradient, each only counted) and its hand-offs (one per transformer layer or bucket of
other parameters a micro-batch; with ``--per-parameter`` also each hooked mode with
``handoff="parameter"``, one per gradient, side by side). Prints a markdown table naming the CPU.
"""

import argparse
import contextlib
import copy
import functools
import gc
import json
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torchtune import training

from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.bench.trace_summary import called_by_aten
from torchtune_offload.models.narrow import NARROW_MODELS, VOCAB_SIZE, checkpointed_llama, chosen_models
from torchtune_offload.optim import fp8_weights
from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.optim.optimizer_class import split_options
from torchtune_offload.recipe.chosen_optimizer import OptimizerKind
from torchtune_offload.recipe.run_optimizer import HoldingOptimizer, RunOptimizer

WIDTH, TOKENS, WARMUP, CLIP, LR = 64, 16, 2, 1.0, 1e-5

#: Each engine mode by its ``--modes`` key: its row's name and OffloadOptimizer's options (the base
#: is torch's AdamW unless named).
ENGINE_MODES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "host-ring": ("offload_gradients (host ring)", dict(offload_gradients=True)),
    "device-sums": ("offload_gradients, device sums", dict(offload_gradients=True, grad_sum_on="device")),
    "overlap": ("offload_gradients, overlap", dict(offload_gradients=True, overlap=True)),
    "overlap-device-sums": ("offload_gradients, overlap, device sums",
                            dict(offload_gradients=True, overlap=True, grad_sum_on="device")),
    "overlap-only": ("overlap (gradients on the device)", dict(overlap=True)),
    "offload-only": ("offload (gradients on the device)", dict()),
    # Every tensor of the real 8B has at least AdamW8bit's min_8bit_size (4096) elements and takes its
    # 8-bit pass; narrowed, the norms and key/value projections would take the fp32-moment path instead.
    "8bit": ("AdamW8bit base, offload_gradients", dict(optimizer_class=AdamW8bit, offload_gradients=True,
                                                       min_8bit_size=0)),
    "fp32-masters": ("fp32 masters, offload_gradients", dict(offload_gradients=True, master_dtype="fp32")),
    "fp8": ("device_weights: fp8, offload_gradients", dict(offload_gradients=True, device_weights="fp8")),
    "update-on-device": ("update_on: device, overlap", dict(update_on="device", overlap=True)),
}
PLAIN = "plain AdamW"
#: The functions whose ops a mode's design needs beyond plain AdamW's, counted and timed apart as they
#: run, each by where it is looked up when called and its name: FP8 device weights' quantization of
#: each held weight after its host step (``DeviceWeights._quantize``: the scales, the values, the
#: scales in the weight's dtype) and the widening of its image before each use (``dequantize``: the
#: cast and the product; three a micro-batch with activation checkpointing, none where a compiled
#: layer widens inside its graph). The third item says whether a compiled layer traces the function
#: into its graph: its seconds are then not timed apart (a wrapped global would make dynamo recompile).
DESIGN_FUNCTIONS: Tuple[Tuple[Any, str, bool], ...] = ((fp8_weights.DeviceWeights, "_quantize", False),
                                                       (fp8_weights, "dequantize", True))
#: A profiled Python call of one of :data:`DESIGN_FUNCTIONS`.
DESIGN_CALL = re.compile(r"fp8_weights\.py\(\d+\): (%s)$" % "|".join(name for _, name, _ in DESIGN_FUNCTIONS))
#: The profiled range of the counted step, which names the training thread in the profile.
STEP_RANGE = "bench_launching_thread: step"
#: torchao's wrapper's ``--modes`` key and row name.
TORCHAO, TORCHAO_NAME = "torchao", "torchao's CPUOffloadOptimizer"
#: The suffix of a mode run with ``handoff="parameter"`` (``--per-parameter``): what the
#: hand-off per layer and bucket is measured against.
PER_PARAMETER = ", hand-off per parameter"


def _hooked(options: Dict[str, Any]) -> bool:
    """Whether the engine takes gradients from backward hooks in this mode."""
    own, _ = split_options(OffloadOptimizer.__init__, {k: v for k, v in options.items() if k != "optimizer_class"})
    return OffloadOptions.parse(**own).hands_off_in_backward


class Trainee:
    """One mode's model, optimizer (as the recipes adapt it) and step."""

    def __init__(self, key: str, base: torch.nn.Module, *, accum: int, compiled: bool, device: torch.device,
                 cpu_defaults: bool = False) -> None:
        self.name = row_name(key)
        self.device = device
        self.model = copy.deepcopy(base).to(device)
        if compiled:
            training.compile_model(self.model, verbose=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        as_on_gpu = _as_on_gpu(device, cpu_defaults)
        if key == PLAIN:
            loop = {"foreach": True} if as_on_gpu else {}
            self.run = RunOptimizer(torch.optim.AdamW(params, lr=LR, **loop), params=params, clip_grad_norm=CLIP,
                                    kind=OptimizerKind.PLAIN)
        elif key == TORCHAO:
            from torchao.optim import CPUOffloadOptimizer  # optional: where torchao's offloader runs

            self.run = RunOptimizer(CPUOffloadOptimizer(params, torch.optim.AdamW, lr=LR), params=params,
                                    clip_grad_norm=CLIP, kind=OptimizerKind.TORCHAO_OFFLOAD)
        else:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]  # as the recipes pass them
            options = ENGINE_MODES[key.removesuffix(PER_PARAMETER)][1]
            kernel = {"fused": True} if as_on_gpu and "optimizer_class" not in options else {}  # torch's AdamW
            handoff = "parameter" if key.endswith(PER_PARAMETER) else "group"
            engine = OffloadOptimizer(named, minimal_size=0, lr=LR, handoff=handoff, **options, **kernel)
            self.run = HoldingOptimizer(engine, model=self.model, clip_grad_norm=CLIP)
        #: Whether the mode's design needs ops of :data:`DESIGN_FUNCTIONS` (FP8 device weights).
        options = ENGINE_MODES.get(key.removesuffix(PER_PARAMETER), ("", {}))[1]
        self.design_ops = options.get("device_weights") is not None
        self.accum = accum
        self.compiled = compiled
        gen = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, VOCAB_SIZE, (1, TOKENS + 1), generator=gen).to(device) for _ in range(accum)]

    def step(self) -> None:
        for i, batch in enumerate(self.batches):
            if i == self.accum - 1:
                self.run.before_final_backward()
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()) / self.accum
            loss.backward()
        self.run.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def handoffs(self) -> Optional[Tuple[int, int]]:
        """The engine's hand-offs in backward so far and its hook calls (None for the other optimizers)."""
        engine = self.run.optimizer
        if not isinstance(engine, OffloadOptimizer):
            return None
        return engine.handoff_count(), engine.hook_call_count()

    def close(self) -> None:
        self.run.synchronize()
        self.run.close()


def _threads(count: int) -> str:
    return f"{count} intra-op thread" + ("s" if count != 1 else "")


def _as_on_gpu(device: torch.device, cpu_defaults: bool) -> bool:
    """Whether the CPU run builds the optimizers as on a GPU machine (see the module's docstring)."""
    return device.type == "cpu" and not cpu_defaults


def _built_as(device: torch.device, cpu_defaults: bool) -> str:
    """How the optimizers are built, as the table's header says it."""
    if _as_on_gpu(device, cpu_defaults):
        return "as on a GPU machine (plain AdamW foreach, the engine's host AdamW fused)"
    return "as torch builds them" if device.type == "cuda" else "with the CPU's defaults (single-tensor loops)"


def row_name(key: str) -> str:
    """The table's name of a ``--modes`` key (or of plain AdamW, or a key with :data:`PER_PARAMETER`)."""
    if key == PLAIN:
        return PLAIN
    if key == TORCHAO:
        return TORCHAO_NAME
    return ENGINE_MODES[key.removesuffix(PER_PARAMETER)][0] + (PER_PARAMETER if key.endswith(PER_PARAMETER) else "")


def build(keys: List[str], *, model: str, accum: int, compiled: bool, device: torch.device,
          cpu_defaults: bool = False) -> Dict[str, Any]:
    """Each mode's :class:`Trainee` by its row name, or the reason it does not run here."""
    base = checkpointed_llama(model, width=WIDTH, max_seq_len=TOKENS)
    out: Dict[str, Any] = {}
    for key in keys:
        name = row_name(key)
        try:
            out[name] = Trainee(key, base, accum=accum, compiled=compiled, device=device, cpu_defaults=cpu_defaults)
            for _ in range(WARMUP):  # compiles, allocates the engine's buffers
                out[name].step()
            out[name].run.synchronize()
        except Exception as err:  # noqa: BLE001 - a mode that cannot run here is reported, not fatal
            out[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return out


def timed_steps(trainee: Trainee, steps: int) -> List[float]:
    gc.collect()  # the other modes' garbage first, so that no mode pays for another's
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainee.step()
        seconds.append(time.perf_counter() - start)
    trainee.run.synchronize()
    return seconds


def _in_design_function(event: Any) -> bool:
    """Whether a profiled op ran inside one of :data:`DESIGN_FUNCTIONS` (from the profile's Python calls)."""
    parent = event.cpu_parent
    while parent is not None:
        if DESIGN_CALL.search(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def counted_step(trainee: Trainee) -> Dict[str, Optional[int]]:
    """One step's aten ops dispatched by this (the training) thread, from a profile of it (a
    compiled graph's kernels are no aten op; a dispatch mode would make dynamo run the graph's ops
    one by one), those of them its design needs (:data:`DESIGN_FUNCTIONS`, found by the profile's
    Python calls; None for a mode without them), and the engine's hand-offs and hook calls."""
    before = trainee.handoffs()
    with profile(activities=[ProfilerActivity.CPU], with_stack=trainee.design_ops) as prof:
        with record_function(STEP_RANGE):
            trainee.step()
    trainee.run.synchronize()
    after = trainee.handoffs()
    events = prof.events()
    training = next(e.thread for e in events if e.name == STEP_RANGE)
    counted = [e for e in events if e.thread == training and e.name.startswith("aten::") and not called_by_aten(e)]
    design = sum(map(_in_design_function, counted)) if trainee.design_ops else None
    handoffs, hook_calls = (None, None) if before is None else (after[0] - before[0], after[1] - before[1])
    return {"ops": len(counted), "design_ops": design, "handoffs": handoffs, "hook_calls": hook_calls}


@contextlib.contextmanager
def _design_functions_timed(spans: List[float], *, compiled: bool) -> Iterator[None]:
    """Wraps :data:`DESIGN_FUNCTIONS` (with compiled layers, those called outside the graphs) so that
    each call's seconds, on whichever thread it runs, are appended to ``spans``."""
    def timed(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spans.append(time.perf_counter() - start)
        return wrapper

    originals = [(owner, name, getattr(owner, name)) for owner, name, traced in DESIGN_FUNCTIONS
                 if not (compiled and traced)]
    for owner, name, function in originals:
        setattr(owner, name, timed(function))
    try:
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


def design_seconds(trainee: Trainee, steps: int) -> Optional[float]:
    """The median over ``steps`` more steps of the seconds a step spends inside :data:`DESIGN_FUNCTIONS`
    (None for a mode without them; with compiled layers the widenings inside the graphs are not counted)."""
    if not trainee.design_ops:
        return None
    spans: List[float] = []
    per_step = []
    with _design_functions_timed(spans, compiled=trainee.compiled):
        for _ in range(steps):
            spans.clear()
            trainee.step()
            trainee.run.synchronize()  # the quantizations of this step's host steps too
            per_step.append(sum(spans))
    return statistics.median(per_step)


def measure(trainees: Dict[str, Any], *, rounds: int, steps: int, log: Callable[[str], None]) -> Dict[str, Dict]:
    runnable = {n: t for n, t in trainees.items() if isinstance(t, Trainee)}
    # Every mode's model, optimizer and compiled graphs stay alive in this one process: frozen, so that
    # a collection during a mode's steps walks only the objects made since, as in a process training
    # one model, and not every other mode's too (a full walk of all of them took 0.2 s here).
    gc.collect()
    gc.freeze()
    per_round: Dict[str, List[float]] = {n: [] for n in runnable}
    ratios: Dict[str, List[float]] = {n: [] for n in runnable}
    for r in range(rounds):
        for name, trainee in runnable.items():
            per_round[name].append(statistics.median(timed_steps(trainee, steps)))
        for name in runnable:
            ratios[name].append(per_round[name][-1] / per_round[PLAIN][-1])
        log(f"round {r + 1} of {rounds}: " + ", ".join(f"{n} {per_round[n][-1]:.3f} s" for n in runnable))
    counts = {name: counted_step(trainee) for name, trainee in runnable.items()}
    design = {name: design_seconds(trainee, steps) for name, trainee in runnable.items()}
    return {name: {"seconds": statistics.median(per_round[name]), "ratio": statistics.median(ratios[name]),
                   "ratios": ratios[name], "design_seconds": design[name], **counts[name]} for name in runnable}


def table(results: Dict[str, Dict], skipped: Dict[str, str], *, header: str) -> str:
    plain_ops, plain_seconds = results[PLAIN]["ops"], results[PLAIN]["seconds"]
    lines = [header, "", "| mode | s/step | x plain (median of rounds) | of them design s | x (plain + design s) | "
             "aten ops/step | x plain | of them design ops | x (plain + design ops) | engine hook calls/step | "
             "engine hand-offs/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        handoffs = "|" if r["handoffs"] is None else f"{r['hook_calls']} | {r['handoffs']}"
        design, design_s = r["design_ops"], r["design_seconds"]
        time_apart = ("| |" if design_s is None
                      else f"{design_s:.3f} | {r['seconds'] / (plain_seconds + design_s):.2f} |")
        apart = "| |" if design is None else f"{design} | {r['ops'] / (plain_ops + design):.2f} |"
        lines.append(f"| {name} | {r['seconds']:.3f} | {r['ratio']:.2f} | {time_apart} {r['ops']} | "
                     f"{r['ops'] / plain_ops:.2f} | {apart} {handoffs} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | does not run here: {why} | | | | | | | | | |")
    if any(r["design_ops"] is not None for r in results.values()):
        lines += ["", "Design ops and s: what FP8 device weights' design needs, counted and timed as it runs: "
                      "each held weight's quantization after its host step (DeviceWeights._quantize) and each "
                      "widening of its image (dequantize: three a micro-batch with activation checkpointing; inside "
                      "a compiled layer it is part of the graph, neither counted nor timed apart)."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8B", help="one of " + ", ".join(NARROW_MODELS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each mode per round (default 4)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated, of {', '.join([*ENGINE_MODES, TORCHAO])} (default: all); "
                        "plain AdamW always runs")
    parser.add_argument("--compiled", action="store_true", help="compile every layer, as compile: True does")
    parser.add_argument("--per-parameter", action="store_true",
                        help="also run each engine mode whose backward hooks work with the hand-off per parameter")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (default 1: see the module's docstring)")
    parser.add_argument("--cpu-defaults", action="store_true",
                        help="build the optimizers as torch and the engine do on a CPU-only machine (see above)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models train (default cpu)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        chosen_models(args.model)
    except ValueError as err:
        parser.error(str(err))
    if args.device == "cuda" and args.cpu_defaults:
        parser.error("--cpu-defaults: only with --device cpu (on a GPU the optimizers are built as there)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    for key in ("rounds", "steps", "accum", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be at least 1")
    keys = [*ENGINE_MODES, TORCHAO] if args.modes is None else args.modes.split(",")
    unknown = [k for k in keys if k not in ENGINE_MODES and k != TORCHAO]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join([*ENGINE_MODES, TORCHAO])}")
    if args.per_parameter:
        keys += [k + PER_PARAMETER for k in keys if k in ENGINE_MODES and _hooked(ENGINE_MODES[k][1])]
    keys = [PLAIN, *keys]
    torch.set_num_threads(args.threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(f"building {len(keys)} modes ({'compiled' if args.compiled else 'eager'}) ...")
    device = torch.device(args.device)
    trainees = build(keys, model=args.model, accum=args.accum, compiled=args.compiled, device=device,
                     cpu_defaults=args.cpu_defaults)
    if not isinstance(trainees[PLAIN], Trainee):
        sys.exit(f"plain AdamW does not run: {trainees[PLAIN]}")
    skipped = {n: t for n, t in trainees.items() if not isinstance(t, Trainee)}
    try:
        results = measure(trainees, rounds=args.rounds, steps=args.steps, log=log)
    finally:
        for t in trainees.values():
            if isinstance(t, Trainee):
                t.close()
    where = torch.cuda.get_device_name(device) + ", " if device.type == "cuda" else ""
    header = (f"{where}{cpu_name()}, {_threads(torch.get_num_threads())}, torch {torch.__version__}; "
              f"{NARROW_MODELS[args.model][0]} at width {WIDTH}, bf16, activation checkpointing, "
              f"{'compiled layers' if args.compiled else 'eager'}; {args.accum} micro-batches of 1 x {TOKENS} "
              f"tokens a step, clip {CLIP}; optimizers {_built_as(device, args.cpu_defaults)}; "
              f"{args.rounds} interleaved rounds of {args.steps} steps after {WARMUP} warm-up")
    print(table(results, skipped, header=header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "results": results, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()

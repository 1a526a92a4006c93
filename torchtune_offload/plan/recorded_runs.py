"""The recorded H100 runs the speed model is calibrated against, read from ``gpu_runs.json``.

Each :class:`RecordedRun` is one run of that file (the runs docs/gpu_results.md shows): its measured
tok/s (from its step's seconds where the run gives those), its date, commit and device, and the work
of its step. A run the model misses by more than :data:`TOLERANCE` names its cause in ``gap``.
``python -m torchtune_offload.plan.recorded_runs`` prints the calibration table of docs/planner.md;
with ``--tables``, the tables of docs/gpu_results.md (``plan/gpu_tables.py``).
"""

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchtune_offload.plan.gpu_tables import (MODELS, gpu_memory, load, run_name, run_rows, tables, tokens_per_second,
                                               with_tables)
from torchtune_offload.plan.launch import narrowed_ops_per_micro_batch
from torchtune_offload.plan.speed import Speed, StepWork, bitsandbytes_syncs_per_step, load_machine, predict

#: How far a prediction may be from the measured tok/s, as a share of the measured.
TOLERANCE = 0.20
#: Parameters of the models of the runs (torchtune's builders; the page gives 1.24B, 3.21B, 8.03B).
LLAMA3_2_1B = 1_235_814_400
LLAMA3_2_3B = 3_212_749_824
LLAMA3_1_8B = 8_030_261_248
#: Their parameter tensors (the 1B and 3B tie the output to the embedding): what a bitsandbytes
#: optimizer steps one at a time, synchronizing the device after each.
TENSORS = {LLAMA3_2_1B: 146, LLAMA3_2_3B: 254, LLAMA3_1_8B: 291}
#: Their keys in ``models.narrow.NARROW_MODELS``, whose operators a micro-batch dispatches (``plan/launch.py``).
NARROW = {LLAMA3_2_1B: "1B", LLAMA3_2_3B: "3B", LLAMA3_1_8B: "8B"}
#: The models' keys in gpu_runs.json.
PARAMS = {"llama3_2_1b": LLAMA3_2_1B, "llama3_2_3b": LLAMA3_2_3B, "llama3_1_8b": LLAMA3_1_8B}
GIB = 1024**3


@dataclass(frozen=True)
class Gap:
    """A known gap between the model and a run: a short label, its cause, and which steps are of
    the kind it was seen on (``applies``; None where no step planned today is: a path since
    replaced, a machine's own variation, or a kind :class:`StepWork` does not tell apart)."""

    label: str
    cause: str
    applies: Optional[Callable[[StepWork], bool]] = field(default=None, compare=False)


def _accumulates_through_the_host_ring(work: StepWork) -> bool:
    return work.sums_later_micro_batches and not work.sums_on_device


def _accumulates_on_the_device(work: StepWork) -> bool:
    return work.sums_later_micro_batches and work.sums_on_device


_GAP_TORCHAO = Gap("torchao",
    "torchao's CPUOffloadOptimizer: the model counts copies, its host step at torch's fused rate and the "
    "GPU one after the other; the runs were slower still, by about one more host step (0.21-0.33 s a step at "
    "1B against a host step of 0.22 s, 0.88-0.91 s at 3B against 0.57 s). The cause, from a rate measured on "
    "that host: the wrapper measured the norm the recipe logs over torchao's host copies before each step, "
    "and torch's 2-norm of a bf16 tensor runs on one core, 6.8 GB/s on the H100's host (the profiled 8B step "
    "of 2fdd865): 2 bytes a parameter, 0.36 s at 1B and 0.95 s at 3B, the size of the gaps (on a 2-core "
    "machine the same pass ran at 4.7-5.0x the host step's rate, which hid that it does not spread over "
    "cores). The wrapper measures the norm on the device during backward now; no GPU run has timed it. Not "
    "its stepping one optimizer per tensor: torch's fused bf16 AdamW stepped so runs at 0.86-0.94x of one "
    "optimizer over the same tensors (scripts/bench/bench_host_step.py, 2-core Zen 4), and the engine's "
    "serial path, which steps per parameter too, runs at the model's figure",
    applies=lambda work: work.update == "torchao")
_GAP_FIRST_GRADS = Gap("first offload_gradients path",
    "the offload_gradients path of db96fea cost 0.3-0.9 s a step more than offload, growing with the "
    "parameters (not profiled); the overlap variants that replaced it run at the model's figure "
    "(offload_grads_overlap, 03d3a7b). It measured the logged norm over the host gradients before each "
    "step, as torchao's wrapper did: torch's one-core bf16 2-norm, 0.36 s at 1B and 0.95 s at 3B at the "
    "6.8 GB/s measured on that host (see torchao), the size of the gap")
_GAP_MICRO = Gap("per-micro-batch host cost",
    "with offload_gradients and accumulation through the host's staging ring every micro-batch cost about "
    "a host step (2.0 s per micro-batch at 8B, 0.40-0.45 s at 1B batch 2). Measured on the 8B at batch 1 "
    "with the ring timed (ed2357a): the backward hooks waited 1.43 s a step inside the "
    "ring, 0.48 s for each later micro-batch, because its additions took 0.87 s a micro-batch (48 GB of "
    "the cores' own traffic; 64 GB with the DMA engine's writes into the pinned chunks beside them, 74 GB/s "
    "against the probe's 82.5: consistent with the host's memory speed) against the pass's 0.42 s of GPU "
    "work; the model "
    "counts those bytes and hides what the GPU's work covers (1.18 s a step left over, against 1.43 s "
    "measured). grad_sum_on=device removes the wait (883 against 747 tok/s). The rest is the passes' own "
    "cost and the host 2-norms of the sums at the window's end, one after another on one core (both "
    "profiled under 'accumulation with the sums on the device'; the host ring's sums are measured side by "
    "side on every core now, with the same bits: 0.61-0.73 of the time on 2 cores; no GPU run has timed "
    "it); the 1B runs and the f6cc131 8B run added on the training thread (on a thread of its own now)",
    applies=_accumulates_through_the_host_ring)
_GAP_PASSES = Gap("accumulation with the sums on the device",
    "with grad_sum_on=device the backward hooks never waited (3-8 ms a step) and the host's cores added "
    "nothing, yet the 8B at batch 1 ran 8.4-9.3 s a step against the model's 3.5. Profiled (2fdd865, "
    "974 tok/s): the passes are bound by the thread that launches their kernels, not by the GPU "
    "(kernels start 1-2 microseconds after launch): a forward took 0.41-0.54 s for 0.067 s of GPU work, a "
    "backward 0.64-0.95 s for 0.20 s, 0.12-0.33 s of it the engine's gradient hooks; the model counts the "
    "GPU's 0.42 s a pass, about 3.5 s a step less than the four passes took. Neither the model's eager "
    "dispatch (0.13-0.16 s a pass for the 8B architecture on the 2-core CPU) "
    "nor its op count (the 1B runs, with about the same matmul work and ops a layer at batch 4, kept pace with the GPU) explains it: each op cost "
    "the launching thread 2-3 times what the 1B runs allow, for a reason the trace does not record "
    "(gpu_results.md, the profiled step). A lead, measured on the CPU only: the passes ran "
    "beside about 50 GB/s of copies each way through host memory, and on the 2-core CPU another core's "
    "copying slowed the launching thread 1.3-1.7x (what the two cores share besides the memory is not "
    "known, and no GPU run has measured the launching thread beside the DMA's copies). The engine's own "
    "host passes run on torch's intra-op threads, every core by default: on the same CPU its host addition "
    "on every core slowed the narrowed 8B's micro-batch 1.20-1.38x with OpenMP's default wait policy "
    "(threads spin after each pass), 1.00-1.18x with `OMP_WAIT_POLICY=PASSIVE` and 0.95-1.07x on all "
    "cores but one (`scripts/bench/bench_launching_beside_host_work.py`, 2026-12-07, fc3d904 and a1c86a5, four runs "
    "on a 2-core Xeon; it runs on the GPU machine's CPU too, where no run has measured it). And the "
    "window's end waited "
    "1.93 s for the landing thread's host 2-norms of the sums (torch's bf16 2-norm runs on one core: 16 GB at "
    "6.8 GB/s), which the model does not count; the ring measures them on the device now, which no GPU run "
    "has timed. The allocator is ruled out (no "
    "retries or driver allocations after step 1), and so is an ordering (tests/optim/test_stream_check.py). "
    "The model counts the launching thread: 14,132 operators and 291 hooks a micro-batch at the preset's 9.3 and "
    "189 microseconds make 0.19 s, under the GPU's 0.42 s, so it predicts these runs 2.4-2.6x faster than they "
    "ran; a launch_us_per_op that met them (110-130 microseconds) would predict the recorded 1B runs at batch 2 "
    "at under half the tok/s they made",
    applies=_accumulates_on_the_device)
_GAP_MACHINE = Gap("machine variation",
    "the H100 of 2026-11-26 (89c21e7) ran plain AdamW at 26092 tok/s, 17% below the 31422-31680 of the "
    "2026-11-22 runs on the same settings: machine-to-machine variation the preset (fitted to the runs of "
    "db96fea) does not know")
#: The known gaps by the label a run of gpu_runs.json names.
GAPS = {gap.label: gap for gap in (_GAP_TORCHAO, _GAP_FIRST_GRADS, _GAP_MICRO, _GAP_PASSES, _GAP_MACHINE)}


@dataclass(frozen=True)
class RecordedRun:
    """One recorded run: its name (the variant and its settings), measured tok/s, source (docs/gpu_results.md,
    its date and commit, the model and settings), the step's work, a known gap, and the run's date, commit
    and device."""

    name: str
    measured_tokens_per_second: float
    source: str
    work: StepWork
    samples_per_micro_batch: int
    gap: Optional[Gap] = None
    date: str = ""
    commit: str = ""
    device: str = ""


def _work(run: Dict[str, Any]) -> StepWork:
    """The work of a run's step: bf16, activation checkpointing; the engine's fields as the run records them."""
    params = PARAMS[run["model"]]
    engine = dict(run.get("engine", {}))
    if "bitsandbytes" in run:
        # A paged bitsandbytes optimizer's step on the device: its synchronizations.
        engine["device_syncs"] = bitsandbytes_syncs_per_step(tensors=TENSORS[params], **run["bitsandbytes"])
    if "paged_state_bytes_per_param" in run:
        # States beyond what the budget left beside the run's allocator peak page both ways every step.
        engine["paged_excess_bytes"] = int(run["allocator_peak_gib"] * GIB + run["paged_state_bytes_per_param"] * params
                                           - run["gpu_memory_gib"] * GIB)
    work = StepWork(params=params, trainable=params, tokens=run["batch"] * run["seq"],
                    micro_batches=run["accumulation"], clipping=run["clip"] is not None,
                    ops_per_micro_batch=narrowed_ops_per_micro_batch(NARROW[params]), **engine)
    # The engine's gradient hooks of these runs handed each parameter over on its own.
    hooked = work.update == "host" and (work.offload_gradients or work.overlap)
    return replace(work, handoffs_per_micro_batch=TENSORS[params] if hooked else 0)


def _source(run: Dict[str, Any]) -> str:
    title = f", {run['title']}" if run.get("title") else ""
    return (f"gpu_results.md, {run['date']}, {run['commit']}: {MODELS[run['model']]}, {gpu_memory(run)}, "
            f"batch {run['batch']}{title}")


def recorded_runs() -> List[RecordedRun]:
    """Every recorded H100 run of gpu_runs.json with a tok/s (or step seconds); bf16, activation
    checkpointing, sequences of 2048 tokens throughout. The two that did not run (out of memory,
    and a bitsandbytes kernel's fault) have none."""
    return [RecordedRun(run_name(run), tokens_per_second(run), _source(run), _work(run), run["batch"],
                        GAPS[run["gap"]] if "gap" in run else None, run["date"], run["commit"], run["device"])
            for run in run_rows(load()) if run["status"] == "ok"]


def calibrate(machine_name: str = "h100_recorded") -> List[tuple]:
    """(run, prediction, error) for every recorded run; error is predicted / measured tok/s - 1."""
    machine = load_machine(machine_name)
    out = []
    for run in recorded_runs():
        speed: Speed = predict(run.work, machine, samples_per_micro_batch=run.samples_per_micro_batch)
        out.append((run, speed, speed.tokens_per_second / run.measured_tokens_per_second - 1))
    return out


def calibration_table(machine_name: str = "h100_recorded") -> str:
    """The markdown table of docs/planner.md: predicted against measured tok/s, each run's source,
    then the known gaps with their causes."""
    lines = ["| run | section of gpu_results.md | measured tok/s | predicted tok/s | error | bound | within 20% |",
             "|---|---|---:|---:|---:|---|---|"]
    gaps = {}
    for run, speed, err in calibrate(machine_name):
        verdict = "yes" if abs(err) <= TOLERANCE else "**no**"
        if run.gap is not None:
            gaps[run.gap.label] = run.gap.cause
            verdict += f" (gap: {run.gap.label})"
        lines.append(f"| {run.name} | {run.source.removeprefix('gpu_results.md, ')} | "
                     f"{run.measured_tokens_per_second:.0f} | {speed.tokens_per_second:.0f} | {err:+.0%} | "
                     f"{speed.bound} | {verdict} |")
    lines += ["", "Known gaps:", ""] + [f"- **{label}**: {cause}." for label, cause in gaps.items()]
    return "\n".join(lines)


def known_gaps(work: StepWork, *, machine_name: str = "h100_recorded") -> List[Tuple[str, float, float]]:
    """The known gaps of the kind of step ``work`` is, each as ``(label, lowest, highest)``: the
    range of measured / predicted tok/s over the recorded runs that show it (on ``machine_name``,
    the machine they ran on), for the planner to print beside its own prediction."""
    ratios = {}
    for run, _, err in calibrate(machine_name):
        gap = run.gap
        if gap is not None and gap.applies is not None and gap.applies(work):
            ratios.setdefault(gap.label, []).append(1 / (1 + err))
    return [(label, min(r), max(r)) for label, r in ratios.items()]


def known_gaps_block(speeds: Dict[str, Speed]) -> List[str]:
    """Lines for under the planner's table: each variant's known gaps (``Speed.known_gaps``) with
    what the recorded runs made of the model's tok/s; none where no variant has one."""
    lines = [f"- {name}: {label}: {lo:.2f}-{hi:.2f} of the predicted tok/s" if lo != hi else
             f"- {name}: {label}: {lo:.2f} of the predicted tok/s"
             for name, speed in speeds.items() for label, lo, hi in speed.known_gaps]
    if not lines:
        return []
    return ["", "Known gaps of the speed model: recorded H100 runs of the same kind made, of what it predicted "
            "for them (docs/planner.md#calibration-against-the-recorded-h100-runs):", *lines]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="The speed model's calibration against the recorded GPU runs "
                                                 "(docs/planner.md), or with --tables docs/gpu_results.md's tables.")
    parser.add_argument("--tables", action="store_true", help="print the tables of gpu_runs.json instead")
    parser.add_argument("--write", metavar="PAGE", type=Path,
                        help="with --tables: put them between the markers of PAGE (docs/gpu_results.md)")
    args = parser.parse_args(argv)
    if args.write is not None and not args.tables:
        parser.error("--write goes with --tables")
    if not args.tables:
        print(calibration_table())
    elif args.write is None:
        print(tables())
    else:
        args.write.write_text(with_tables(args.write.read_text(), tables()))


if __name__ == "__main__":
    main()

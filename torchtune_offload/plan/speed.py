"""How fast? A training step's seconds from the work the plan traces and a machine's measured rates.

A step costs the GPU's matmuls (about 6 x parameters x tokens FLOPs, 8 with activation
checkpointing, which runs the forward twice) or, where it takes longer, the launching thread's
dispatch of the passes' operators and the engine's hand-offs (``plan/launch.py``), the PCIe traffic (gradients down, weights or
optimizer states up and down) and the host's work (the optimizer step, and with
``offload_gradients`` the sums of the micro-batches' gradients), partly overlapped. The machine
is a handful of measured rates (:class:`Machine`): a preset from ``machines.json`` beside this
module, or a file written by ``tune-offload probe`` (:mod:`torchtune_offload.plan.probe`).

The model is calibrated against every recorded H100 run (``docs/planner.md``, the runs in
:mod:`torchtune_offload.plan.recorded_runs`); the runs it misses by more than 20% are named there
with their causes.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from torchtune_offload.optim.staging import CHUNK_BYTES, NUM_CHUNKS

#: The keys of a machine file, each a positive number, with what it means.
MACHINE_KEYS: Dict[str, str] = {
    "gpu_bf16_tflops": "bf16 FLOP rate a training step reaches on the GPU, its FLOPs counted as 6 (8 with activation "
                       "checkpointing) x parameters x tokens (TFLOP/s; effective, not the datasheet's peak)",
    "pcie_h2d_gbs": "host-to-device copy bandwidth from pinned memory (GB/s)",
    "pcie_d2h_gbs": "device-to-host copy bandwidth into pinned memory (GB/s)",
    "host_copy_gbs": "host memory bandwidth, bytes read plus bytes written per second by a large copy (GB/s)",
    "host_adamw_bf16_mparams": "torch's fused AdamW on bf16 CPU tensors, all cores (million parameters/s)",
    "host_adamw8bit_mparams": "this project's AdamW8bit host pass, all cores (million parameters/s)",
    "host_adamw_master_mparams": "this project's fused fp32-master AdamW pass (fp32 master and states, bf16 gradient "
                                 "and weight), all cores (million parameters/s)",
    "host_cores": "CPU cores the host step may use (recorded with the rates, which are all-core rates; the model "
                  "does not read it)",
    "device_sync_us": "the launching thread's time for one call of an optimizer that synchronizes the device after "
                      "each parameter (bitsandbytes' step of one small parameter, its synchronization included), "
                      "during which the GPU waits (microseconds)",
    "launch_us_per_op": "the launching thread's time per aten operator of a training step's forward and backward "
                        "(torch's dispatch, the kernel's launch and the Python around them), operators counted as "
                        "plan/launch.py counts them (microseconds)",
    "handoff_us": "the launching thread's time per hand-off of this project's engine in backward (one per "
                  "transformer layer or bucket of other parameters per micro-batch, or per parameter with "
                  "handoff=parameter: its hooks, norms, copies and events), beyond the model's own operators "
                  "(microseconds)",
}
#: The optional key of a machine file: the GPU's memory, which the planner takes as its device budget
#: when ``--machine`` names the machine and ``--device-gib`` is not given, so that a plan for a
#: machine one is not on (a preset) needs no more flags.
DEVICE_MEMORY_KEY = "device_memory_gib"
#: Bytes a torch AdamW step over bf16 tensors reads and writes per parameter: weight, gradient and
#: two states read (8), weight and states written (6).
ADAMW_BF16_BYTES = 14
#: With fp32 master weights: fp32 master and states read and written (24), the bf16 gradient read
#: and the bf16 weight written (4).
ADAMW_MASTER_BYTES = 28
#: torch's AdamW over fp32 tensors, which steps fp32 masters where the fused pass does not: master,
#: states and gradient read (16), master and states written (12).
ADAMW_FP32_BYTES = 28
#: Bytes per parameter of clipping's own pass over the host gradients (each read and written once),
#: as a multiple of the host gradient's element size. The host pays it where the gradients are on the
#: host when clipped (``offload_gradients``, or any overlapped window) and the step cannot take the
#: factor itself: torch's optimizers, and the serial path, which scales the gradients in place. The
#: overlapped engine hands the factor to AdamW8bit's pass (without masters, on sums of the
#: parameter's dtype) and to the fused fp32-master pass of torch's Adam/AdamW, which multiply as
#: they read the gradient (no pass of its own); AdamW8bit over fp32 masters still scales first.
CLIP_PASS_BYTES_PER_ELEMENT_SIZE = 2
#: The share of the last backward that the overlapped host step hides behind, fitted to the
#: recorded H100 overlap runs (docs/planner.md; alone they read about 0 for 1B at batch 2, 0.35 at
#: batch 4 and 0.64 for 8B at batch 2): the host step slows beside GPU work (0.219 s serial,
#: 0.266 s overlapped, docs/gpu_results.md) and the next forward waits for its first weights.
OVERLAP_HIDDEN_SHARE = 0.35
PRESETS_FILE = Path(__file__).with_name("machines.json")


@dataclass(frozen=True)
class Machine:
    """A machine's measured (or estimated) rates; see :data:`MACHINE_KEYS` for each key's meaning."""

    gpu_bf16_tflops: float
    pcie_h2d_gbs: float
    pcie_d2h_gbs: float
    host_copy_gbs: float
    host_adamw_bf16_mparams: float
    host_adamw8bit_mparams: float
    host_adamw_master_mparams: float
    host_cores: float
    device_sync_us: float
    launch_us_per_op: float
    handoff_us: float
    name: str = "machine.json"
    #: :data:`DEVICE_MEMORY_KEY`, where the file gives it.
    device_memory_gib: Optional[float] = None

    @classmethod
    def from_dict(cls, data: Mapping[str, object], *, name: str) -> "Machine":
        """A machine from its keys, all checked at once.

        Raises:
            ValueError: naming every missing, unknown, non-numeric or non-positive key, and the fix.
        """
        problems = []
        missing = [k for k in MACHINE_KEYS if k not in data]
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        unknown = sorted(k for k in data if k not in MACHINE_KEYS and k != DEVICE_MEMORY_KEY)
        if unknown:
            problems.append(f"unknown {', '.join(unknown)} (the keys are {', '.join(MACHINE_KEYS)}, and optionally "
                            f"{DEVICE_MEMORY_KEY})")
        for key in [*MACHINE_KEYS, DEVICE_MEMORY_KEY]:
            if key not in data:
                continue
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                problems.append(f"{key}={value!r} is not a positive number")
            elif key == "host_cores" and value != int(value):
                problems.append(f"host_cores={value!r} is not a whole number of cores")
        if problems:
            raise ValueError(f"{name}: {'; '.join(problems)}. Measure the machine with `tune-offload probe "
                             f"--output machine.json`, or take the GPU keys from a preset "
                             f"({', '.join(preset_names())}).")
        memory = data.get(DEVICE_MEMORY_KEY)
        return cls(name=name, **{k: float(data[k]) for k in MACHINE_KEYS},
                   device_memory_gib=None if memory is None else float(memory))

    def as_dict(self) -> Dict[str, float]:
        """The machine file's keys and values (:data:`DEVICE_MEMORY_KEY` last, where given)."""
        memory = {} if self.device_memory_gib is None else {DEVICE_MEMORY_KEY: self.device_memory_gib}
        return {**{k: getattr(self, k) for k in MACHINE_KEYS}, **memory}


def _presets() -> Dict[str, dict]:
    return json.loads(PRESETS_FILE.read_text())["presets"]


def preset_names() -> list:
    """The names ``--machine`` takes besides a path."""
    return sorted(_presets())


def preset_about(name: str) -> dict:
    """A preset's description, whether its figures are estimates, and their sources."""
    entry = _presets()[name]
    return {k: v for k, v in entry.items() if k != "machine"}


def load_machine(spec: Union[str, Path]) -> Machine:
    """A preset by name, else a machine JSON file.

    Raises:
        ValueError: an unknown preset and no such file, a file that is not JSON, or bad keys.
    """
    presets = _presets()
    if str(spec) in presets:
        return Machine.from_dict(presets[str(spec)]["machine"], name=str(spec))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--machine {spec}: neither a preset ({', '.join(sorted(presets))}) nor a file. "
                         "Write one with `tune-offload probe --output machine.json`.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--machine {spec}: not JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"--machine {spec}: a JSON object of {', '.join(MACHINE_KEYS)} is expected")
    return Machine.from_dict(data, name=str(path))


#: Where a variant's optimizer update runs.
UPDATES = ("device", "host", "device_update", "torchao")


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step does, as the plan traces it.

    Attributes:
        params: every parameter of the model (each takes part in the matmuls).
        trainable: the parameters the optimizer steps.
        tokens: tokens per micro-batch (batch x sequence length).
        micro_batches: micro-batches per optimizer step (gradient accumulation).
        activation_checkpointing: the forward runs twice.
        element_size: bytes per weight and gradient element (2 for bf16).
        update: ``device`` (the optimizer on the GPU), ``host`` (this project's host engine),
            ``device_update`` (``update_on=device``: the states cross PCIe), ``torchao``
            (torchao's ``CPUOffloadOptimizer``: copy, step, copy back, one after the other).
        offload_gradients: gradients go to the host during every backward and are summed there.
        overlap: the host step runs beside the GPU's work.
        clipping: gradients are clipped by their total norm, so the host steps wait for the last
            backward's norms (with ``overlap``, nothing of them hides behind that backward).
        eight_bit: the host step is :class:`torchtune_offload.AdamW8bit`.
        master_fp32: fp32 master weights and states on the host.
        fused_master: with ``master_fp32`` (and not ``eight_bit``), the fused fp32-master pass steps
            them. False where it cannot (``fused_master_step: False``, an option it lacks such as
            ``amsgrad``, another base optimizer, no C compiler): the base optimizer steps the masters
            on the gradient widened into an fp32 buffer (priced as torch's fp32 AdamW), and the
            weight is rounded from them after.
        grad_sum_size: bytes per element of the host gradient buffers (``grad_sum_dtype``: 4 for
            fp32 sums); None for the gradient's own ``element_size``. A sum wider than the
            parameter is narrowed to it before a step without masters (a pass of its own).
        sums_on_device: ``grad_sum_on=device``: a later micro-batch's gradient is added into its
            host sum on the device (the sum crosses PCIe both ways and the host's memory twice,
            its cores do nothing) instead of landing and being added by the host's cores.
        state_bytes: optimizer-state bytes per trainable parameter (what ``device_update`` moves).
        paged_excess_bytes: paged optimizer state beyond the device's room: it crosses PCIe both
            ways every step.
        device_syncs: for an optimizer on the device, the times a step synchronizes the device
            (:func:`bitsandbytes_syncs_per_step`): the GPU waits ``device_sync_us`` for each.
        ops_per_micro_batch: the aten operators one micro-batch's forward and backward dispatch
            (``plan/launch.py``); 0 where not counted (the launching thread is then not priced).
        handoffs_per_micro_batch: this project's engine's hand-offs in one backward (its groups,
            ``optim/handoff.py``); 0 for other optimizers.
    """

    params: int
    trainable: int
    tokens: int
    micro_batches: int = 1
    activation_checkpointing: bool = True
    element_size: int = 2
    update: str = "device"
    offload_gradients: bool = False
    overlap: bool = False
    clipping: bool = False
    eight_bit: bool = False
    master_fp32: bool = False
    fused_master: bool = True
    grad_sum_size: Optional[int] = None
    sums_on_device: bool = False
    state_bytes: float = 4.0
    paged_excess_bytes: int = 0
    device_syncs: int = 0
    ops_per_micro_batch: int = 0
    handoffs_per_micro_batch: int = 0

    @property
    def sum_size(self) -> int:
        """Bytes per element of the host gradient buffers."""
        return self.grad_sum_size or self.element_size

    @property
    def master_pass(self) -> bool:
        """The fused fp32-master pass steps the masters (it reads the gradient as it is, takes
        clipping's factor, and writes the bf16 weight)."""
        return self.master_fp32 and not self.eight_bit and self.fused_master

    @property
    def sums_later_micro_batches(self) -> bool:
        """The host engine adds later micro-batches' offloaded gradients into their host sums
        (where ``sums_on_device`` says: the host's staging ring, or the device)."""
        return self.update == "host" and self.offload_gradients and self.micro_batches > 1

    def __post_init__(self) -> None:
        if self.update not in UPDATES:
            raise ValueError(f"StepWork.update={self.update!r}: one of {', '.join(UPDATES)}")
        if min(self.params, self.trainable, self.tokens, self.micro_batches) <= 0:
            raise ValueError(f"StepWork needs positive params, trainable, tokens and micro_batches: {self}")
        if self.device_syncs < 0 or (self.device_syncs and self.update != "device"):
            raise ValueError(f"StepWork.device_syncs={self.device_syncs}: a count, for an optimizer on the device")
        if min(self.ops_per_micro_batch, self.handoffs_per_micro_batch) < 0:
            raise ValueError(f"StepWork needs counts of at least 0 for ops_per_micro_batch and handoffs_per_micro_batch: "
                             f"{self}")


def bitsandbytes_syncs_per_step(*, tensors: int, paged: bool, in_backward: bool) -> int:
    """How often one optimizer step of a bitsandbytes optimizer on the device synchronizes the device.

    bitsandbytes' optimizers (``bitsandbytes.optim.optimizer.Optimizer8bit.step``, the base of its
    8-bit and 32-bit ones alike) call ``sync_gpu`` after each parameter's update, and a paged one
    once more at the end of each ``step()``. With ``in_backward`` (torchtune's ``optimizer_in_bwd``)
    every parameter has an optimizer of its own, stepped from its gradient hook, so each ``step()``
    updates one tensor. (torch's optimizers do not synchronize in a step.)

    Args:
        tensors: the trainable parameter tensors it steps.
        paged: a paged optimizer (``Paged*``, or ``is_paged=True``).
        in_backward: stepped from each parameter's gradient hook.

    Returns:
        The synchronizations of one optimizer step.
    """
    step_calls = tensors if in_backward else 1
    return tensors + (step_calls if paged else 0)


def device_syncs(optimizer_class: type, options: Dict[str, Any], *, tensors: int, in_backward: bool) -> int:
    """How often a step of ``optimizer_class`` on the device synchronizes it.

    bitsandbytes' optimizers built on its ``Optimizer8bit`` (8-bit and 32-bit alike) synchronize
    after each parameter's update, and a paged one once more per ``step()``
    (:func:`bitsandbytes_syncs_per_step`); whether it is paged is
    read from an instance built with ``options`` on a one-element CPU tensor (``Paged*`` classes,
    or ``is_paged=True``). Other optimizers (torch's, and bitsandbytes' plain-torch ones such as
    ``PytorchLARS``) do not synchronize.

    Args:
        optimizer_class: the optimizer the recipe builds on the device.
        options: its keyword options.
        tensors: the trainable parameter tensors it steps.
        in_backward: stepped from each parameter's gradient hook (``optimizer_in_bwd``).

    Returns:
        The synchronizations of one optimizer step.
    """
    if not any(c.__module__ == "bitsandbytes.optim.optimizer" and c.__name__ == "Optimizer8bit"
               for c in optimizer_class.__mro__):
        return 0
    paged = bool(optimizer_class([torch.nn.Parameter(torch.zeros(1))], **options).is_paged)
    return bitsandbytes_syncs_per_step(tensors=tensors, paged=paged, in_backward=in_backward)


#: The bounds a step can have, as the plan's table names them.
BOUNDS = ("GPU compute", "launching thread", "PCIe", "host step", "host gradient sums", "device synchronizations")


@dataclass(frozen=True)
class Speed:
    """A predicted step: its seconds, tokens per second, what bounds it and the seconds of each part.

    Attributes:
        parts: seconds of each resource's work in a step (``gpu``, ``launch``: the launching
            thread's for the passes, ``pcie``, ``host_step``, ``host_sums``, and ``syncs``: the GPU's
            waits at the optimizer's synchronizations), whether or not it is hidden behind another's.
        hides_at_batch: for this project's offload variants (host engine or ``update_on=device``),
            the smallest batch per micro-batch (samples of this sequence length) at which, with
            ``overlap``, the offloaded work hides behind GPU work; None for the others, and for the
            host engine with clipping (its steps wait for the last backward's norms).
        known_gaps: ``(label, lowest, highest)`` for each known gap of the model on steps of this
            kind: the range of measured / predicted tok/s of the recorded runs that show it (the
            planner fills it from :mod:`torchtune_offload.plan.recorded_runs`).
        sums_elsewhere: for a host-engine step that sums offloaded gradients over micro-batches,
            the other ``grad_sum_on`` value and the tok/s predicted with it; None for the others.
    """

    step_seconds: float
    tokens_per_second: float
    bound: str
    parts: Dict[str, float]
    hides_at_batch: Optional[int] = None
    known_gaps: Tuple[Tuple[str, float, float], ...] = ()
    sums_elsewhere: Optional[Tuple[str, float]] = None

    def summary(self) -> Dict[str, object]:
        """The ``"speed"`` entry of the plan's JSON."""
        def four(x: float) -> float:  # four significant digits: the model is not finer than that
            return float(f"{x:.4g}")

        return {"step_seconds": four(self.step_seconds), "tokens_per_second": four(self.tokens_per_second),
                "bound": self.bound, "parts": {k: four(v) for k, v in self.parts.items()},
                "hides_at_batch": self.hides_at_batch,
                "known_gaps": [{"label": label, "measured_over_predicted": [four(lo), four(hi)]}
                               for label, lo, hi in self.known_gaps],
                "sums_elsewhere": None if self.sums_elsewhere is None else {
                    "grad_sum_on": self.sums_elsewhere[0], "tokens_per_second": four(self.sums_elsewhere[1])}}


def _gpu_seconds(work: StepWork, machine: Machine, tokens: int) -> tuple:
    """(forward, backward) seconds of one micro-batch of ``tokens``: 2 FLOPs per parameter per token
    forward (twice with checkpointing), 2 for the input gradients, 2 per trainable one for the weights'."""
    rate = machine.gpu_bf16_tflops * 1e12
    forward = 2 * work.params * tokens / rate
    recompute = 2 * work.params if work.activation_checkpointing else 0
    backward = (recompute + 2 * work.params + 2 * work.trainable) * tokens / rate
    return forward, backward


def launch_seconds(work: StepWork, machine: Machine) -> float:
    """The launching thread's seconds for one micro-batch's passes: its operators at
    ``launch_us_per_op`` and the engine's hand-offs at ``handoff_us``."""
    return (work.ops_per_micro_batch * machine.launch_us_per_op
            + work.handoffs_per_micro_batch * machine.handoff_us) * 1e-6


def _pass_seconds(work: StepWork, machine: Machine, tokens: float) -> tuple:
    """(forward, backward) seconds of one micro-batch of ``tokens`` as it runs: the GPU's work
    (:func:`_gpu_seconds`), both stretched alike where the launching thread takes longer to launch
    them (the GPU then waits for it)."""
    forward, backward = _gpu_seconds(work, machine, tokens)
    stretch = max(1.0, launch_seconds(work, machine) / (forward + backward))
    return forward * stretch, backward * stretch


def predict(work: StepWork, machine: Machine, *, samples_per_micro_batch: Optional[int] = None) -> Speed:
    """The step's seconds on ``machine`` (see the module's docstring and docs/planner.md), and
    where the host engine sums offloaded gradients, the same step with them summed at the other
    place (:attr:`Speed.sums_elsewhere`).

    Args:
        samples_per_micro_batch: the batch size, for :attr:`Speed.hides_at_batch`.
    """
    speed = _predict(work, machine, samples_per_micro_batch)
    if work.sums_later_micro_batches:
        other = _predict(replace(work, sums_on_device=not work.sums_on_device), machine, samples_per_micro_batch)
        speed = replace(speed, sums_elsewhere=("host" if work.sums_on_device else "device", other.tokens_per_second))
    return speed


def _later_sum_seconds(work: StepWork, machine: Machine, *, down: float) -> Tuple[float, float]:
    """The seconds a later micro-batch's gradient sum takes, and the seconds of PCIe it adds (``down``:
    one gradient's copy to the host), where :attr:`StepWork.sums_on_device` says it runs."""
    if work.sums_on_device:
        sum_bytes = work.trainable * work.sum_size
        sum_up, sum_down = sum_bytes / (machine.pcie_h2d_gbs * 1e9), sum_bytes / (machine.pcie_d2h_gbs * 1e9)
        # The sum up and back down (the link carries both ways at once), the host's memory read
        # and written once by the DMA engines: the slowest of the three sets the pace.
        return max(sum_up, sum_down, 2 * sum_bytes / (machine.host_copy_gbs * 1e9)), sum_up + sum_down
    # A later micro-batch's sum on the host: the DMA engine writes the gradient into the pinned
    # chunks, the cores read it and the sum and write the sum, all in the host's one memory (the
    # 8B run of docs/gpu_results.md, H100, 2026-11-27 at ed2357a, added at 74 GB/s counting all four).
    return work.trainable * (2 * work.element_size + 2 * work.sum_size) / (machine.host_copy_gbs * 1e9), down


def _predict(work: StepWork, machine: Machine, samples_per_micro_batch: Optional[int]) -> Speed:
    gpu_work = work.micro_batches * sum(_gpu_seconds(work, machine, work.tokens))
    launch = work.micro_batches * launch_seconds(work, machine)
    forward, backward = _pass_seconds(work, machine, work.tokens)
    micro = forward + backward
    gpu = work.micro_batches * micro  # the passes as they run: the GPU's work, or its launching
    weight_bytes = work.trainable * work.element_size
    down = weight_bytes / (machine.pcie_d2h_gbs * 1e9)  # one gradient's copy
    up = weight_bytes / (machine.pcie_h2d_gbs * 1e9)  # the new weights
    host_step = _host_step_seconds(work, machine)
    sum_one, later_pcie = _later_sum_seconds(work, machine, down=down)
    sums = (work.micro_batches - 1) * sum_one if work.offload_gradients else 0.0
    hides = None
    # Each synchronization empties the GPU's queue: it then waits for the launching thread's next
    # call, stepping in backward or after it alike (docs/planner.md).
    syncs = work.device_syncs * machine.device_sync_us * 1e-6
    if work.update == "device":
        pcie = work.paged_excess_bytes / (machine.pcie_d2h_gbs * 1e9) + work.paged_excess_bytes / (
            machine.pcie_h2d_gbs * 1e9)
        host_step, sums, step = 0.0, 0.0, gpu + pcie + syncs
    elif work.update == "device_update":
        state = work.trainable * work.state_bytes
        state_up, state_down = state / (machine.pcie_h2d_gbs * 1e9), state / (machine.pcie_d2h_gbs * 1e9)
        host_step, sums = 0.0, 0.0
        hides = _hides_at_batch(work, machine, max(state_up, state_down), 0.0, samples_per_micro_batch)
        if work.overlap:  # staging up and down on their own streams, beside the GPU's update and backward
            pcie = max(state_up, state_down)
            step = gpu + max(0.0, pcie - OVERLAP_HIDDEN_SHARE * backward)
        else:
            pcie = state_up + state_down
            step = gpu + pcie
    elif work.update == "torchao":
        pcie = down + up
        sums = 0.0
        step = gpu + down + host_step + up
    else:
        pcie = down + up + ((work.micro_batches - 1) * later_pcie if work.offload_gradients else 0.0)
        # Copies down, the per-parameter steps and copies up run as a pipeline: the slowest sets its pace.
        phase = max(down, host_step, up)
        # With clipping no batch hides the host steps (they wait for the norms): no such batch.
        hides = None if work.clipping else _hides_at_batch(work, machine, phase, sum_one, samples_per_micro_batch)
        if work.overlap:
            # Each later micro-batch's sum hides behind the next micro-batch's GPU work; the host
            # phase behind part of the last backward.
            exposed_sums = (work.micro_batches - 1) * max(0.0, sum_one - micro) if work.offload_gradients else 0.0
            # With clipping the steps start only once the last backward's norms are in.
            hidden = 0.0 if work.clipping else OVERLAP_HIDDEN_SHARE * backward
            step = gpu + exposed_sums + max(0.0, phase - hidden)
        else:
            step = gpu + sums + phase
    parts = {"gpu": gpu_work, "launch": launch, "pcie": pcie, "host_step": host_step, "host_sums": sums,
             "syncs": syncs}
    bound = max(zip(parts.values(), BOUNDS))[1]
    tokens = work.tokens * work.micro_batches
    return Speed(step_seconds=step, tokens_per_second=tokens / step, bound=bound, parts=parts, hides_at_batch=hides)


#: How much faster the other place to sum the micro-batches must be predicted before the planner names it.
SUMS_ELSEWHERE_MARGIN = 1.05


def sums_elsewhere_block(speeds: Mapping[str, Speed]) -> List[str]:
    """Lines for under the planner's table: the variants whose gradient sums are predicted at least
    :data:`SUMS_ELSEWHERE_MARGIN` times faster summed at the other place (``grad_sum_on``), with
    both predictions; none where no variant's are."""
    lines = []
    for name, speed in speeds.items():
        if speed.sums_elsewhere is None or speed.sums_elsewhere[1] < SUMS_ELSEWHERE_MARGIN * speed.tokens_per_second:
            continue
        site, tokens_per_second = speed.sums_elsewhere
        # Either ring holds at most NUM_CHUNKS chunks of CHUNK_BYTES: on the device, or pinned on the host.
        cost = "on the device" if site == "device" else "pinned on the host"
        lines.append(f"- {name}: optimizer.grad_sum_on={site}: {tokens_per_second:.0f} tok/s predicted against "
                     f"{speed.tokens_per_second:.0f}, for at most {NUM_CHUNKS * CHUNK_BYTES // 2**20} MiB more {cost}")
    if not lines:
        return []
    return ["", "Where later micro-batches are summed (docs/accumulation.md): the other place is predicted faster "
            "for", *lines]


def _host_step_seconds(work: StepWork, machine: Machine) -> float:
    """The host's work of one step: the optimizer's pass at its measured rate (the fused fp32-master
    pass at its own; AdamW8bit over fp32 masters at its rate scaled by their bytes against the bf16
    step's; torch's AdamW over fp32 masters at the bf16 step's rate scaled by the bytes), and the
    passes of their own at ``host_copy_gbs``: a wider gradient sum narrowed to the parameter's dtype,
    a narrower one widened to an fp32 master that the fused pass does not step, the weight rounded
    from a master after torch's step, and clipping's scaling."""
    sum_size = work.sum_size if work.update == "host" else work.element_size
    # The master pass reads the gradient sum as it is (28 bytes a parameter with bf16 sums, 30 with fp32).
    master_bytes = ADAMW_MASTER_BYTES - work.element_size + sum_size
    torch_master = work.master_fp32 and not work.eight_bit and not work.master_pass
    if work.master_pass:
        # Its rate is measured on bf16 gradients; wider sums add their bytes.
        seconds = work.trainable / (machine.host_adamw_master_mparams * 1e6) * (master_bytes / ADAMW_MASTER_BYTES)
    elif torch_master:
        seconds = work.trainable / (machine.host_adamw_bf16_mparams * 1e6) * (ADAMW_FP32_BYTES / ADAMW_BF16_BYTES)
    else:
        rate = (machine.host_adamw8bit_mparams if work.eight_bit else machine.host_adamw_bf16_mparams) * 1e6
        seconds = work.trainable / rate * (master_bytes / ADAMW_BF16_BYTES if work.master_fp32 else 1)
    extra = 0
    if sum_size != work.element_size and not work.master_fp32:
        extra += sum_size + work.element_size  # the sum read, its narrowed copy written
    if work.master_fp32 and not work.master_pass and sum_size != 4:
        extra += sum_size + 4  # the fp32 master is stepped on the sum widened into a kept buffer
    if torch_master:
        extra += 4 + work.element_size  # the weight rounded from the master: master read, weight written
    if _clips_in_a_pass_of_its_own(work):
        extra += sum_size * CLIP_PASS_BYTES_PER_ELEMENT_SIZE
    return seconds + work.trainable * extra / (machine.host_copy_gbs * 1e9)


def _clips_in_a_pass_of_its_own(work: StepWork) -> bool:
    """Whether the host scales the gradients for clipping in a pass of their own (see
    :data:`CLIP_PASS_BYTES_PER_ELEMENT_SIZE`): AdamW8bit takes the factor only on a sum of the
    parameter's own dtype."""
    on_host = work.update == "host" and (work.offload_gradients or work.overlap)
    same_dtype_sum = work.sum_size == work.element_size
    factor_in_the_pass = work.overlap and ((work.eight_bit and not work.master_fp32 and same_dtype_sum)
                                           or work.master_pass)
    return work.clipping and on_host and not factor_in_the_pass


def _hides_at_batch(work: StepWork, machine: Machine, phase: float, sum_one: float,
                    samples: Optional[int]) -> Optional[int]:
    """The smallest batch per micro-batch at which, with ``overlap``, the offloaded work ``phase``
    (the host pipeline, or the states' copies for ``update_on=device``) hides behind the last
    backward and each gradient sum behind a micro-batch. Accumulation alone does not hide the host
    step: the next window's first forward needs the new weights."""
    if samples is None or samples <= 0:
        return None
    per_sample = work.tokens / samples
    forward, backward = _gpu_seconds(work, machine, per_sample)
    # At b samples a micro-batch's passes take the larger of b times one sample's GPU work and the
    # launching thread's time (the backward its share of it): a launching thread slower than the
    # GPU's work may hide the host's work at any batch.
    launch = launch_seconds(work, machine)
    launch_backward = launch * backward / (forward + backward)
    need = 1.0 if phase <= OVERLAP_HIDDEN_SHARE * launch_backward else phase / (OVERLAP_HIDDEN_SHARE * backward)
    if work.offload_gradients and work.micro_batches > 1 and sum_one > launch:
        need = max(need, sum_one / (forward + backward))
    return max(1, math.ceil(need - 1e-9))

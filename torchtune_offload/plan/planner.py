"""Will it fit? The peak device and host memory of a configured run, for each optimizer variant.

For each variant (the configured optimizer, and those of the benchmark sweep: plain AdamW,
bitsandbytes' paged optimizers, torchao's and this project's offload) the config is changed as the
sweep changes it and checked as the recipe checks it. Then:

- device: one training step traced on fake tensors (:mod:`torchtune_offload.plan.trace`), with
  gradients freed during backward where the variant frees them, plus the optimizer state the
  variant keeps on the device (traced with the step for torch's optimizers, counted from its
  width for bitsandbytes' paged ones, which page out to host memory only under pressure);
- host: this process's own memory (Python, PyTorch, torchtune: what any run holds) plus the
  recipes' host-RAM pre-flight calculation (:func:`torchtune_offload.recipe.host_memory_need`),
  the one the recipes run before loading, with the traced step in place of weights and gradients
  for a ``device=cpu`` run.
"""

import gc
import os
from argparse import Namespace
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import psutil
import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, modules, training
# Recipes run under torchtune's ``tune`` launcher; the libraries its commands import are part of every
# run's RSS, so the process baseline measured here (process_baseline) holds them too.
from torchtune._cli import tune as _tune_launcher  # noqa: F401
from torchtune.config._utils import _merge_yaml_and_cli_args
from torchtune.models.llama3 import llama3, lora_llama3
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.bench.variants import SINGLE_DEVICE_VARIANTS, VARIANTS
from torchtune_offload.optim import fused_step
from torchtune_offload.optim.handoff import handoff_groups
from torchtune_offload.optim.host_buffers import offloads
from torchtune_offload.optim.host_memory import device_sum_ring_bytes, optimizer_state_bytes, plan_device_staging
from torchtune_offload.plan.fine_tunes import (DEFAULT_ADAPTERS, FineTune, configured_fine_tune, fine_tunes,
                                               unquantised_twin)
from torchtune_offload.plan.fsdp import fsdp_peak, fsdp_units, shard_bytes
from torchtune_offload.plan.recorded_runs import known_gaps
from torchtune_offload.plan.speed import Machine, Speed, StepWork, device_syncs, predict
from torchtune_offload.plan.step_traces import StepRequest, mark_lora, sequence_length, step_request
from torchtune_offload.plan.trace import (StepTrace, UntraceableModelError, build_meta_model, check_builder_imports,
                                          micro_batch_loss, one_line)
from torchtune_offload.recipe import RecipeSettings, check_recipe_config, host_memory_need
from torchtune_offload.recipe.checks.config import RECIPE_KEYS
from torchtune_offload.recipe.checks.fit import available_host_memory, sharded_host_memory_need, trainable_shards
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, OptimizerKind

GIB = 1024**3
#: The reserved peak a CUDA offload run is assumed to reach above its allocated peak, as a share of it,
#: with the expandable segments the recipes turn on (the 8B batch-1 runs on an H100: 1.8-2.0%).
RESERVED_MARGIN = 0.05


@dataclass
class VariantPlan:
    """The predicted peaks of one optimizer variant; figures are ``None`` where it cannot run."""

    name: str
    description: str
    problem: Optional[str] = None
    device_bytes: Optional[int] = None
    device_parts: Dict[str, int] = field(default_factory=dict)
    paged_bytes: int = 0
    host_bytes: Optional[int] = None
    host_parts: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    #: What one optimizer step does, for the speed model (:mod:`torchtune_offload.plan.speed`);
    #: None for a run on the CPU or one that cannot run.
    work: Optional[StepWork] = None
    #: Samples per micro-batch (the config's ``batch_size``).
    batch_size: Optional[int] = None
    #: CUDA offload runs: the caching allocator's reserved peak the plan assumes (see ``RESERVED_MARGIN``).
    reserved_bytes: Optional[int] = None
    #: FP8 device weights: the device's bytes while the model loads, every weight in the model's
    #: dtype before the optimizer makes its images (more than the step peak where that is tight).
    load_bytes: Optional[int] = None
    #: The distributed recipe's ranks on this machine (``--nproc-per-node``): the device figures are
    #: then one rank's (every device holds about as much), the host figures the machine's, all its
    #: ranks together; None for a single-device recipe.
    ranks: Optional[int] = None
    #: With ``ranks``: one rank's own host memory in training (its process and its optimizer's share).
    rank_host_bytes: Optional[int] = None

    @property
    def device_need(self) -> int:
        """What the device must hold at the run's tightest moment: the step peak or the load."""
        return max(self.device_bytes or 0, self.load_bytes or 0)

    def fits(self, *, device_budget: Optional[int], host_budget: int) -> bool:
        """Whether the variant runs within both budgets.

        Args:
            device_budget: device bytes; None (unknown) fits nothing.
            host_budget: host bytes.

        Returns:
            True where it is planned (no problem), its :attr:`device_need` is within the device's
            budget and its host peak within the host's.
        """
        return (self.problem is None and self.device_bytes is not None and self.host_bytes is not None
                and device_budget is not None and self.device_need <= device_budget
                and self.host_bytes <= host_budget)


def load_config(config_path: str, overrides: Sequence[str]) -> DictConfig:
    """The config with command-line overrides applied as ``tune run`` applies them (``~key`` deletes)."""
    yaml_args = Namespace(**OmegaConf.to_container(OmegaConf.load(config_path)))
    return _merge_yaml_and_cli_args(yaml_args, list(overrides))


def variant_config(config_path: str, overrides: Sequence[str], name: str) -> DictConfig:
    """Variant ``name``'s config (``config`` or one of ``bench/variants.py``), as the sweep runs it."""
    extra = VARIANTS[name].overrides(config_path) if name != "config" else []
    return load_config(config_path, [*overrides, *extra])


def _device_state(settings: RecipeSettings, named: List[Tuple[str, torch.Tensor]]) -> Dict[str, int]:
    """Optimizer state kept on the device and not traced with the step, for the trainable
    parameters ``named`` (a rank's shards in the distributed recipe): (label, bytes)."""
    trainable = [p for _, p in named]
    chosen = settings.optimizer
    opts = chosen.offload
    if opts is not None:
        small = [p for p in trainable if not offloads(p, opts.minimal_size)]
        state, _ = optimizer_state_bytes(chosen.base_class, small, chosen.base_options)
        parts = {"optimizer state (parameters below minimal_size)": state}
        if opts.update_on == "device":
            # The states come to the device a slice at a time, through two staging buffers.
            parts["state staging (update_on=device)"] = plan_device_staging(
                named, base_class=chosen.base_class, options=chosen.base_options, minimal_size=opts.minimal_size,
                staging_bytes=opts.device_staging_bytes)
        accumulates = opts.offload_gradients and settings.gradient_accumulation_steps > 1
        if opts.grad_sum_on == "device" and accumulates:
            # Later micro-batches are added into their host sums through a few device chunks.
            parts["gradient sum chunks (grad_sum_on=device)"] = device_sum_ring_bytes(
                trainable, minimal_size=opts.minimal_size, grad_sum_dtype=opts.grad_sum_dtype)
        return parts
    if chosen.kind is OptimizerKind.PLAIN and chosen.optimizer_class.__module__.startswith("torch.optim"):
        return {}  # traced with the step
    state, _ = optimizer_state_bytes(chosen.optimizer_class, trainable, chosen.base_options)
    label = "optimizer state (paged)" if chosen.optimizer_class.__name__.startswith("Paged") else "optimizer state"
    return {label: state}


def _fused_master(chosen: ChosenOptimizer, *, dtype: torch.dtype) -> bool:
    """Whether the engine would step the fp32 masters with its fused pass: the engine's option, the
    base optimizer and its options (``fused_step.fuses``, as the engine asks it), and a C compiler to
    build the pass with (the engine falls back to torch's step without one)."""
    opts = chosen.offload
    sums = opts.grad_sum_dtype or dtype
    return (opts.fused_master_step and fused_step.c_compiler() is not None
            and fused_step.fuses(chosen.base_class, chosen.base_options, master=torch.float32, grad=sums, out=dtype))


#: How each kind of optimizer updates, as the speed model names it: torchao's wrapper copies, steps
#: and copies back one after the other; the engine pipelines them on the host, or streams the
#: states to the device (``update_on=device``).
_UPDATE = {OptimizerKind.OFFLOAD_ENGINE: "host", OptimizerKind.SHARDED_ENGINE: "host",
           OptimizerKind.TORCHAO_OFFLOAD: "torchao"}


def _step_work(settings: RecipeSettings, model: torch.nn.Module, tokens: int, *, ops: int) -> StepWork:
    """What one optimizer step of the run does, as the speed model reads it (``ops``: the operators
    of one micro-batch, from its trace)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    chosen = settings.optimizer
    opts = chosen.offload
    update = _UPDATE.get(chosen.kind, "device")
    if opts is not None and opts.update_on == "device":
        update = "device_update"
    n_trainable = sum(p.numel() for p in trainable)
    syncs = 0
    if update == "device":
        syncs = device_syncs(chosen.optimizer_class, chosen.base_options, tensors=len(trainable),
                             in_backward=chosen.kind is OptimizerKind.IN_BACKWARD)
    state_bytes = 4.0
    if opts is not None and n_trainable:
        state_bytes = optimizer_state_bytes(chosen.base_class, trainable, chosen.base_options)[0] / n_trainable
    handoffs = 0
    if chosen.capabilities.hands_over_per_group and opts is not None and opts.hands_off_in_backward:
        # this project's engine hands gradients over in each backward: per group, or per parameter
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        handoffs = len(set(handoff_groups([n for n, _ in named], [p.numel() * p.element_size() for _, p in named],
                                          per_parameter=opts.handoff == "parameter")))
    master = opts is not None and opts.master_dtype is not None
    return StepWork(params=sum(p.numel() for p in model.parameters()), trainable=max(1, n_trainable), tokens=tokens,
                    micro_batches=settings.gradient_accumulation_steps,
                    activation_checkpointing=settings.enable_activation_checkpointing,
                    element_size=settings.dtype.itemsize, update=update,
                    offload_gradients=chosen.offload_gradients, overlap=opts is not None and opts.overlap,
                    clipping=settings.clip_grad_norm is not None,
                    eight_bit=opts is not None and chosen.base_class.__name__ == "AdamW8bit",
                    master_fp32=master, fused_master=opts is not None and _fused_master(chosen, dtype=settings.dtype),
                    grad_sum_size=4 if opts is not None and opts.grad_sum_dtype is not None else None,
                    sums_on_device=opts is not None and opts.grad_sum_on == "device", state_bytes=state_bytes,
                    device_syncs=syncs, ops_per_micro_batch=ops, handoffs_per_micro_batch=handoffs)


def plan_variant(config_path: str, overrides: Sequence[str], name: str, *, recipe: str, seq_len: Optional[int],
                 baseline: int, traces: Optional[Dict[tuple, StepTrace]] = None, nproc_per_node: int = 1) -> VariantPlan:
    """Predicts one variant's device and host peaks (or says why it cannot run).

    Args:
        traces: traced steps by what shapes them, shared between the variants of one config.
        nproc_per_node: the distributed recipe's ranks on this machine (``recipe="distributed"``).

    Raises:
        UntraceableModelError: the configured model cannot be built or traced.
    """
    description = "the config as given" if name == "config" else VARIANTS[name].description
    return plan_config(variant_config(config_path, overrides, name), VariantPlan(name=name, description=description),
                       recipe=recipe, seq_len=seq_len, baseline=baseline, traces=traces, nproc_per_node=nproc_per_node)


def plan_config(cfg: DictConfig, plan: VariantPlan, *, recipe: str, seq_len: Optional[int], baseline: int,
                traces: Optional[Dict[tuple, StepTrace]] = None, nproc_per_node: int = 1) -> VariantPlan:
    """Fills ``plan`` with the device and host peaks of the run ``cfg`` describes (or why it cannot
    run); for the distributed recipe, one rank's device and the machine's host over ``nproc_per_node``
    ranks (:func:`_plan_ranks`).

    Raises:
        UntraceableModelError: ``cfg.model`` cannot be built or traced.
    """
    check_builder_imports(cfg)
    try:
        settings = check_recipe_config(cfg, recipe=recipe, device_present=False)
        length = sequence_length(cfg, seq_len)
    except UntraceableModelError:
        raise
    except ValueError as err:
        plan.problem = str(err).replace("Invalid config:\n  - ", "").splitlines()[0]
        return plan
    except ImportError as err:  # bitsandbytes missing
        plan.problem = f"cannot be planned here ({err})"
        return plan
    request = step_request(cfg, settings, recipe=recipe, seq_len=length)
    settings, mark, fp8 = request.settings, request.mark_trainable, request.fp8_weights
    traces = {} if traces is None else traces
    if request.key not in traces:
        traces.update(request.traces())
    trace = traces[request.key]
    twin = unquantised_twin(cfg.model)
    if twin is not None:  # the counts below read shapes only, the same on a model of plain tensors
        cfg = OmegaConf.merge(cfg, {})
        cfg.model = OmegaConf.create(twin)
    model = build_meta_model(cfg, settings)
    if mark is not None:
        mark(model)
    if recipe == "distributed":
        return _plan_ranks(plan, cfg, settings, model, trace=trace, seq_len=length, baseline=baseline,
                           ranks=nproc_per_node)
    try:
        need = host_memory_need(cfg, settings, model=model,
                                step_bytes=trace.peak_bytes if settings.device.type == "cpu" else None)
    except ValueError as err:  # an optimizer option its memory plan refuses and the config check let by
        plan.problem = str(err).splitlines()[0]
        return plan
    _fill_device_figures(plan, settings, model, trace=trace, seq_len=length, fp8_images=fp8 is not None)
    phase = max(need.phases, key=lambda p: sum(need.phases[p].values()))
    plan.host_parts = {"this process (Python, PyTorch, torchtune)": baseline,
                       **{f"{phase}: {k}": v for k, v in need.phases[phase].items()}}
    plan.host_bytes = baseline + need.peak
    plan.notes += list(need.notes)
    _add_device_notes(plan, settings)
    return plan


def _add_device_notes(plan: VariantPlan, settings: RecipeSettings) -> None:
    """The notes of a plan for a GPU: fake CPU tensors, and the reserved peak of an offload run."""
    if settings.device.type != "cpu":
        plan.notes.append("device figures are traced on fake CPU tensors: a GPU's allocator rounds and caches "
                          "on top (expect a few percent more)")
    if settings.device.type == "cuda" and settings.optimizer.kind.offloads:
        plan.reserved_bytes = int(plan.device_bytes * (1 + RESERVED_MARGIN))
        plan.notes.append(f"reserved peak assumed: {plan.reserved_bytes / GIB:.2f} GiB, the step peak plus "
                          f"{RESERVED_MARGIN:.0%}: the recipes run offload runs with expandable_segments "
                          "(unless PYTORCH_CUDA_ALLOC_CONF is set), whose pages leave little cached beside what is "
                          "allocated (the 8B batch-1 runs on an H100: 1.8-2.0% above; docs/fp8_weights.md)")


def _plan_ranks(plan: VariantPlan, cfg: DictConfig, settings: RecipeSettings, model: torch.nn.Module, *,
                trace: StepTrace, seq_len: int, baseline: int, ranks: int) -> VariantPlan:
    """Fills ``plan`` for the distributed recipe over ``ranks`` ranks on one machine: one rank's device
    (:mod:`torchtune_offload.plan.fsdp`) and the machine's host (every rank's process, and the pre-flight's
    node-wide figures, ``recipe.checks.fit.sharded_host_memory_need``: each rank's engine over its shards)."""
    plan.ranks = ranks
    parts, resident = _rank_device_parts(cfg, settings, model, trace=trace, ranks=ranks)
    plan.device_parts = {k: v for k, v in parts.items() if v}
    plan.device_bytes = sum(plan.device_parts.values())
    plan.batch_size = settings.batch_size
    need = sharded_host_memory_need(cfg, settings, world_size=ranks, local_world_size=ranks)
    phases = {phase: dict(figures) for phase, figures in need.phases.items()}
    notes = list(need.notes)
    if settings.device.type == "cpu":  # each rank's "device" is this host: its gathered units and activations too
        rest = plan.device_bytes - resident  # the shards are in the pre-flight's figures already
        phases["training"][f"{ranks} ranks' gathered units, activations and buffers (planned per rank)"] = ranks * rest
        notes = [n for n in notes if not n.startswith("activations and the layers FSDP2 gathers")]
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    processes = f"{ranks} processes" if ranks > 1 else "1 process"
    plan.host_parts = {f"{processes} (Python, PyTorch, torchtune), {baseline / GIB:.2f} GiB each": ranks * baseline,
                       **{f"{phase}: {k}": v for k, v in phases[phase].items()}}
    plan.host_bytes = ranks * baseline + sum(phases[phase].values())
    plan.rank_host_bytes = baseline + sum(phases["training"].values()) // ranks
    plan.notes += notes + [
        f"distributed recipe over {ranks} ranks on this machine: the device figures are one rank's (every device "
        "holds about as much: the shards are padded alike), the host figures the machine's, all ranks together "
        f"({plan.rank_host_bytes / GIB:.2f} GiB a rank in training)",
        "one rank's device peak is the sum of each part at its own largest (plan/fsdp.py): an upper bound; FSDP2's "
        "gathered units and whole gradients are replayed from torch's fully_shard, unit by unit"]
    if settings.device.type != "cpu":
        work = _step_work(settings, model, settings.batch_size * seq_len, ops=trace.ops_per_micro_batch)
        plan.work = _rank_work(work, settings)
    _add_device_notes(plan, settings)
    return plan


def _rank_device_parts(cfg: DictConfig, settings: RecipeSettings, model: torch.nn.Module, *, trace: StepTrace,
                       ranks: int) -> Tuple[Dict[str, int], int]:
    """One rank's device memory by part (:mod:`torchtune_offload.plan.fsdp`), and how much of it is
    the parameter and gradient shards the pre-flight counts on the host of a ``device=cpu`` run."""
    params, grads = shard_bytes(model, world_size=ranks)
    units = fsdp_units(model, cfg, world_size=ranks)
    peak = fsdp_peak(units, world_size=ranks, reshard_after_forward=settings.fsdp_reshard_after_forward,
                     cpu_offload=settings.fsdp_cpu_offload)
    chosen = settings.optimizer
    if settings.fsdp_cpu_offload:
        params, grads = 0, 0
    elif chosen.kind is OptimizerKind.IN_BACKWARD:
        grads = 0  # each gradient shard stepped and freed in backward
    parts = {f"parameter shards (1/{ranks} of each, dim 0 padded)": params, "gradient shards": grads}
    if chosen.kind is OptimizerKind.SHARDED_ENGINE and chosen.offload_gradients:
        # Each unit's gradient shards go to the host after its reduce-scatter, freed once copied.
        parts.pop("gradient shards")
        parts["gradient shards on their way to the host (offload_gradients: the two largest units')"] = sum(
            sorted(-(-u.grad_bytes // ranks) for u in units)[-2:])
    parts.update({"buffers (not sharded)": trace.by_kind.get("Buffer", 0),
                  f"FSDP2's gathered units and whole gradients at their peak ({peak.where})": peak.bytes,
                  "activations and temporaries at their peak (one device's trace at the per-rank batch)":
                      trace.working_bytes})
    if settings.device.type != "cpu":
        parts.update(_rank_device_state(settings, trainable_shards(model, world_size=ranks)))
    return parts, params + grads


def _rank_device_state(settings: RecipeSettings, named: List[Tuple[str, torch.Tensor]]) -> Dict[str, int]:
    """The optimizer's device state over one rank's trainable shards ``named``: the engine's
    (:func:`_device_state`), a torch optimizer's states of the shards, none with ``fsdp_cpu_offload``."""
    chosen = settings.optimizer
    if chosen.kind is OptimizerKind.SHARDED_ENGINE:
        return _device_state(settings, named)
    if settings.fsdp_cpu_offload:
        return {}
    state, _ = optimizer_state_bytes(chosen.optimizer_class, [p for _, p in named], chosen.base_options)
    return {"optimizer state (the shards')": state}


def _rank_work(work: StepWork, settings: RecipeSettings) -> StepWork:
    """One rank's step as the speed model reads it: the whole model's matmuls on the rank's batch and the
    whole update (:func:`plan_speed` gives each rank's link its 1/N). FSDP2's CPU offload steps on the host
    after backward, serially."""
    if settings.fsdp_cpu_offload:
        work = replace(work, update="torchao", device_syncs=0)
    return work


def _fill_device_figures(plan: VariantPlan, settings: RecipeSettings, model: torch.nn.Module, *, trace: StepTrace,
                         seq_len: int, fp8_images: bool) -> None:
    """Fills ``plan``'s device figures: the traced step's peak by kind, the optimizer state kept on the
    device (paged state apart), the step's work and, where the optimizer makes ``device_weights`` FP8
    images, the weights at load."""
    plan.device_parts = {f"step peak: {k.lower()}": v for k, v in trace.by_kind.items() if v}
    if settings.device.type != "cpu":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for label, size in _device_state(settings, named).items():
            if "paged" in label:
                plan.paged_bytes = size
                plan.notes.append(f"{size / GIB:.2f} GiB of paged optimizer state in unified memory: on the device "
                                  "where it fits, paged to host memory beyond (slower)")
            elif size:
                plan.device_parts[label] = size
    plan.device_bytes = sum(plan.device_parts.values())
    plan.batch_size = settings.batch_size
    if settings.device.type != "cpu":
        plan.work = _step_work(settings, model, settings.batch_size * seq_len, ops=trace.ops_per_micro_batch)
    if fp8_images:
        plan.load_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        plan.notes.append(f"device_weights: the model loads in {settings.dtype} on the device before the optimizer "
                          f"makes its FP8 images: {plan.load_bytes / GIB:.2f} GiB of weights at that moment, not in "
                          "the step peak above; a device budget below it is 'no (load)'")


def step_requests(config_path: str, overrides: Sequence[str], names: Sequence[str], *, recipe: str,
                  seq_len: Optional[int], with_fine_tunes: bool) -> List[StepRequest]:
    """The steps a plan will trace, for :func:`~torchtune_offload.plan.step_traces.trace_steps` to
    trace ahead, side by side.

    Args:
        config_path, overrides: the config and its command-line overrides.
        names: the variants planned (``config`` and names of the sweep's variants).
        recipe: the recipe the config runs.
        seq_len: ``--seq-len``, or None for the config's.
        with_fine_tunes: the full, LoRA and QLoRA fine-tunes are planned too (with the config's
            own plan, which stands for its fine-tune).

    Returns:
        One request per variant or fine-tune that can be described; one that cannot (a refused
        config, a model without a builder) is left out, for the plan to meet again and report.
    """
    names = [*names, "config"] if with_fine_tunes and "config" not in names else list(names)
    configs = [(variant_config(config_path, overrides, name), recipe) for name in names]
    if with_fine_tunes:
        cfg = load_config(config_path, overrides)
        mine = configured_fine_tune(cfg.model)
        configs += [(_fine_tune_cfg(cfg, f), f.recipe) for f in fine_tunes(cfg.model)
                    if f.model is not None and f.name != mine]
    requests = []
    for cfg, cfg_recipe in configs:
        try:
            settings = check_recipe_config(cfg, recipe=cfg_recipe, device_present=False)
            requests.append(step_request(cfg, settings, recipe=cfg_recipe, seq_len=sequence_length(cfg, seq_len)))
        except Exception:  # met again by the plan, which reports or raises it as it would without this
            pass
    return requests


def plan_fine_tunes(config_path: str, overrides: Sequence[str], configured: VariantPlan, *,
                    seq_len: Optional[int], baseline: int,
                    traces: Optional[Dict[tuple, StepTrace]] = None) -> List[VariantPlan]:
    """The full, LoRA and QLoRA fine-tunes of the configured model, each with the configured optimizer.

    Args:
        configured: the plan of the config as given, which stands for its own fine-tune.

    Returns:
        One plan per fine-tune, named ``full``, ``LoRA``, ``QLoRA``, described by its builder; a
        fine-tune without a builder, or whose model cannot be traced, has its ``problem`` instead.
    """
    cfg = load_config(config_path, overrides)
    mine = configured_fine_tune(cfg.model)
    plans = []
    for fine_tune in fine_tunes(cfg.model):
        if fine_tune.model is None:
            plans.append(VariantPlan(name=fine_tune.name, description="-", problem=fine_tune.problem))
            continue
        component = fine_tune.model["_component_"]
        if fine_tune.name == mine:
            plans.append(replace(configured, name=fine_tune.name, description=f"{component} (configured)"))
            continue
        plan = VariantPlan(name=fine_tune.name, description=component)
        try:
            plans.append(plan_config(_fine_tune_cfg(cfg, fine_tune), plan, recipe=fine_tune.recipe,
                                     seq_len=seq_len, baseline=baseline, traces=traces))
        except UntraceableModelError as err:
            plan.problem = err.problem
            plans.append(plan)
    return plans


def _fine_tune_cfg(cfg: DictConfig, fine_tune: FineTune) -> DictConfig:
    """``cfg`` with the fine-tune's model, less the keys its recipe does not take (LoRA's, for full)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out.model = OmegaConf.create(fine_tune.model)
    for key in [k for k in out.keys() if k not in RECIPE_KEYS[fine_tune.recipe]]:
        del out[key]
    return out


def default_variants() -> List[str]:
    """The configured optimizer, then the sweep's single-device variants: a single-device config's
    (a config of the distributed recipe gets the ``fsdp2_`` ones, ``plan/__main__.py``)."""
    return ["config", *SINGLE_DEVICE_VARIANTS]


#: :func:`miniature_step`'s decoder: Llama 3 blocks NF4 can quantise (weights multiples of 64 x 256), in ms.
_MINIATURE = {"vocab_size": 512, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 256,
              "intermediate_dim": 512, "max_seq_len": 128}


def miniature_step(cfg: DictConfig) -> str:
    """Runs one forward, loss and backward of a miniature decoder, for real, as ``cfg``'s run would
    set it up: full, LoRA or QLoRA (NF4 base weights, quantised on the CPU at build) as its model is,
    in its dtype, with its activation checkpointing and its loss (and the loss's output chunks).

    What this leaves resident is the runtime's one-time memory of a training step, which a run holds
    from its first step on and which the traced step (tensors only) does not count: the code of the
    kernels a step runs, paged in from ``libtorch_cpu.so`` on first use, and the caches they fill
    (oneDNN's primitive cache among them). Measured on the 78M-parameter QLoRA model (bf16, chunked
    loss, activation checkpointing): one real step, the model then deleted and freed memory
    trimmed, left 36 MiB more resident than the one attention kernel this baseline ran before
    (16 MiB of ``libtorch_cpu.so`` code, 2 MiB of ``libtorch_python.so``, 16 MiB of heap, 8 MiB of
    which oneDNN's primitive cache, 2 MiB other). The plan's host figure was 7.4% under that run's
    RSS peak; with this step in the baseline, 1.8%. Kernel code and caches depend on which
    operators and dtypes a step runs far more than on its shapes, so a miniature's step stands for
    the configured model's; it takes under a second.

    Returns:
        the fine-tune it ran: ``full``, ``LoRA`` or ``QLoRA``.
    """
    kind = configured_fine_tune(cfg.model)
    dtype = {"bf16": torch.bfloat16}.get(str(cfg.get("dtype", "fp32")), torch.float32)
    with training.set_default_dtype(dtype):
        if kind == "full":
            model = llama3(**_MINIATURE)
        else:
            model = lora_llama3(**_MINIATURE, quantize_base=kind == "QLoRA", **{
                k: v for k, v in DEFAULT_ADAPTERS.items() if k != "lora_dropout"})
    if kind != "full":
        mark_lora(model)
    if cfg.get("enable_activation_checkpointing", False):
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = config.instantiate(cfg.loss) if "loss" in cfg else torch.nn.CrossEntropyLoss()
    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    tokens = torch.randint(0, _MINIATURE["vocab_size"], (1, 64))
    loss = micro_batch_loss(model, loss_fn, tokens, tokens)
    loss.backward()
    del loss, model, loss_fn, tokens
    gc.collect()
    return kind


def process_baseline(cfg: DictConfig, *, device: torch.device) -> Tuple[int, List[str]]:
    """What every run of ``cfg`` holds besides its tensors, measured in this process: the libraries
    (``tune``'s launcher included, imported with this module),
    PyTorch's CPU runtime once it has run a training step (:func:`miniature_step`) for a CPU run, or
    one kernel for a run on another device (and that device's runtime, where this machine has it),
    and the tokenizer and dataset, built for real.

    Returns:
        ``(bytes, notes)``; a note says what could not be built here and is not counted.
    """
    notes = []
    stepped = False
    if device.type == "cpu":  # a CPU run's step runs the CPU kernels: run them (a GPU run's run on the GPU)
        try:
            miniature_step(cfg)
            stepped = True
        except Exception as err:  # a loss or dtype the miniature cannot run: one kernel instead, as for a GPU run
            notes.append(f"the miniature training step could not run here ({type(err).__name__}: "
                         f"{one_line(err)}): the runtime's one-time memory of a step (36 MiB for a "
                         "78M-parameter QLoRA run) is not counted")
    if not stepped:
        x = torch.randn(64, 64, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]).sum().backward()
    if device.type == "cuda" and torch.cuda.is_available():
        # The CUDA runtime's host memory (libraries, context, cuBLAS workspace) is part of every GPU
        # run: on an H100 the runs' RSS peaks were 0.8-1.9 GiB above plans made without it.
        a = torch.randn(256, 256, device=device)
        (a @ a).sum().item()
    elif device.type != "cpu":
        notes.append(f"the {device.type} runtime's own host memory is not counted: it cannot be measured on a "
                     "machine without that device (on an H100 with torch 2.11, runs' RSS peaks were "
                     "0.8-1.9 GiB above such plans: docs/gpu_results.md)")
    try:
        tokenizer = config.instantiate(cfg.tokenizer)
        dataset = config.instantiate(cfg.dataset, tokenizer)
        del tokenizer, dataset
    except Exception as err:  # e.g. a tokenizer not downloaded on this machine
        notes.append(f"the tokenizer and dataset could not be built here ({type(err).__name__}): their memory "
                     "(tens of MB for local files) is not counted")
    return psutil.Process(os.getpid()).memory_info().rss, notes


def plan_speed(plan: VariantPlan, machine: Machine, *, device_budget: Optional[int]) -> Optional[Speed]:
    """The variant's predicted step on ``machine`` (None where it cannot run or runs on the CPU),
    with the model's known gaps on steps of its kind. Paged optimizer state beyond the device
    budget crosses PCIe both ways every step."""
    if plan.work is None or plan.problem is not None:
        return None
    work = plan.work
    if plan.paged_bytes and device_budget is not None:
        work = replace(work, paged_excess_bytes=max(0, plan.device_bytes + plan.paged_bytes - device_budget))
    if plan.ranks is not None:
        # Each rank moves its 1/N of the update over a link of its own; the host's rates are shared.
        machine = replace(machine, pcie_h2d_gbs=machine.pcie_h2d_gbs * plan.ranks,
                          pcie_d2h_gbs=machine.pcie_d2h_gbs * plan.ranks)
    speed = predict(work, machine, samples_per_micro_batch=plan.batch_size)
    # The gaps are those of recorded single-device runs; no FSDP2 run is recorded.
    return replace(speed, known_gaps=() if plan.ranks is not None else tuple(known_gaps(work)))


def default_host_budget() -> int:
    """What this machine's memory allows: what is available now plus what this process holds."""
    return available_host_memory() + psutil.Process(os.getpid()).memory_info().rss


def default_device_budget(device: torch.device) -> Optional[int]:
    """This machine's device memory for ``device`` (the host's for a CPU run), if known."""
    if device.type == "cpu":
        return default_host_budget()
    if torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type:
        return torch.get_device_module(device).get_device_properties(device).total_memory
    return None



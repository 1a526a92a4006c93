"""The training steps a plan traces, and tracing the distinct ones on all cores.

Each variant and fine-tune of a plan needs one training step traced on fake tensors
(:mod:`torchtune_offload.plan.trace`): seconds each for an 8B model, and most of the planner's
time. Many share a step (the same model, gradients kept or freed, the same traced optimizer):
:func:`step_request` describes a config's step and the key that tells one step from another.
:func:`trace_steps` traces the distinct steps side by side in forked worker processes and leaves
them in the plan's shared cache, so that a 2-core machine plans an 8B config on both of its cores
(issue 43 asks for at most 60 s there); the plan is then assembled from the cache as before.
"""

import json
import multiprocessing
import os
import sys
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_offload.optim.optimizer_class import split_options
from torchtune_offload.plan.trace import StepTrace, trace_training_step
from torchtune_offload.recipe import RecipeSettings, check_recipe_config


def mark_lora(model: torch.nn.Module) -> None:
    """Makes the adapters the only trainable parameters, as the LoRA recipe does."""
    set_trainable_params(model, get_adapter_params(model))


def sequence_length(cfg: DictConfig, override: Optional[int]) -> int:
    """Tokens per sample: ``--seq-len``, else the synthetic dataset's ``seq_len``, else ``tokenizer.max_seq_len``.

    Raises:
        ValueError: when none is known.
    """
    for value in (override, OmegaConf.select(cfg, "dataset.seq_len"), OmegaConf.select(cfg, "tokenizer.max_seq_len")):
        if value is not None:
            return int(value)
    raise ValueError("tokenizer.max_seq_len is null, so the sequence length is unknown: give --seq-len N.")


def traced_optimizer(settings: RecipeSettings, cfg: DictConfig) -> Optional[Callable[[list], torch.optim.Optimizer]]:
    """The optimizer whose step is traced: torch's own, on the device, stepping after backward."""
    cls = settings.optimizer_class
    if settings.device.type == "cpu" or settings.optimizer_in_bwd or not cls.__module__.startswith("torch.optim"):
        return None
    options = {k: v for k, v in OmegaConf.to_container(cfg.optimizer, resolve=True).items() if k != "_component_"}
    # torch picks its multi-tensor (foreach) kernels for CUDA parameters; the fake ones are CPU
    # tensors. A config that asks for the fused step keeps it (torch refuses fused with foreach).
    if not options.get("fused"):
        options.setdefault("foreach", True)

    def make(params: list) -> torch.optim.Optimizer:
        optimizer = cls(params, **options)
        for p in params:  # one step first: the state exists during a step's forward and backward
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return optimizer

    return make


def fp8_weights(settings: RecipeSettings, cfg: DictConfig) -> Optional[Tuple[int, bool]]:
    """``(minimal_size, per_row)`` where the run holds its layer weights in FP8 on the device."""
    if not settings.optimizer_capabilities.offloads or settings.device.type == "cpu":
        return None
    options = {k: v for k, v in OmegaConf.to_container(cfg.optimizer, resolve=True).items() if k != "_component_"}
    own, _ = split_options(settings.optimizer_class.__init__, options)
    if not own.get("device_weights"):
        return None
    return own["minimal_size"], own["device_weights"] == "fp8"


@dataclass(frozen=True)
class StepRequest:
    """One config's training step, as the planner traces it.

    Attributes:
        key: what shapes the traced step; two requests with one key trace the same step.
        cfg: the config.
        settings: its checked settings (never compiled: fake tensors are traced eagerly).
        seq_len: tokens per sample.
        mark_trainable: marks the trainable parameters (LoRA), or None for all of them.
        fp8_weights: see :func:`fp8_weights`.
    """

    key: tuple
    cfg: DictConfig
    settings: RecipeSettings
    seq_len: int
    mark_trainable: Optional[Callable[[torch.nn.Module], None]]
    fp8_weights: Optional[Tuple[int, bool]]

    def trace(self) -> StepTrace:
        """Traces the step (seconds for an 8B model)."""
        s = self.settings
        return trace_training_step(self.cfg, s, seq_len=self.seq_len, mark_trainable=self.mark_trainable,
                                   free_gradients=_frees_gradients(s), make_optimizer=traced_optimizer(s, self.cfg),
                                   fp8_weights=self.fp8_weights)


def _frees_gradients(settings: RecipeSettings) -> bool:
    return settings.offload_gradients or settings.optimizer_in_bwd


def step_request(cfg: DictConfig, *, recipe: str, seq_len: Optional[int]) -> StepRequest:
    """The step ``cfg`` trains, checked as ``recipe`` checks it.

    Args:
        cfg: a recipe config.
        recipe: ``full``, ``lora`` or ``distributed``.
        seq_len: tokens per sample, or None for the config's (:func:`sequence_length`).

    Raises:
        ValueError: a problem of the config (the recipe's check) or an unknown sequence length.
        ImportError: the configured optimizer's library is missing.
    """
    settings = replace(check_recipe_config(cfg, recipe=recipe, device_present=False), compile=False)
    length = sequence_length(cfg, seq_len)
    free = _frees_gradients(settings)
    make = traced_optimizer(settings, cfg)
    fp8 = fp8_weights(settings, cfg)
    # The micro-batches the trace runs: one where each gradient is freed (a second repeats it), else up to two.
    micro_batches = 1 if free else min(settings.gradient_accumulation_steps, 2)
    key = (free, fp8, settings.optimizer_class if make else None, micro_batches,
           str(settings.device), json.dumps(OmegaConf.to_container(cfg.optimizer, resolve=True), sort_keys=True)
           if make else None, recipe, json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True),
           length)
    return StepRequest(key=key, cfg=cfg, settings=settings, seq_len=length,
                       mark_trainable=mark_lora if recipe == "lora" else None, fp8_weights=fp8)


def default_jobs() -> int:
    """The cores this process may run on (``--jobs``' default)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: The longest wait for a worker's next traced step (an 8B step takes 2-8 s on the 2-core development
#: machine); a worker that hangs or dies costs this wait, then the plan traces in this process.
WORKER_TIMEOUT_S = 300.0

#: The requests the forked workers trace, by index: set by trace_steps before it forks, and read
#: by the workers in their copy of this process (a fork copies them; nothing is pickled).
_PENDING: List[StepRequest] = []


def _trace_pending(index: int) -> Tuple[int, Optional[StepTrace]]:
    torch.set_num_threads(1)  # one worker a core; fake tensors compute next to nothing
    try:
        return index, _PENDING[index].trace()
    except Exception:  # not sent back: an exception that cannot be unpickled would break the pool
        return index, None


def trace_steps(requests: Sequence[StepRequest], traces: Dict[tuple, StepTrace], *, jobs: int,
                timeout_s: float = WORKER_TIMEOUT_S) -> int:
    """Traces the distinct steps of ``requests`` that ``traces`` lacks, ``jobs`` at a time in forked
    worker processes, into ``traces``.

    A step whose trace fails in a worker is left out: the plan traces it again where it needs it,
    and reports the error there as it always has. With one job, one step to trace, or no ``fork``
    (Windows), nothing is traced here. Workers that go ``timeout_s`` without a result are stopped,
    and the plan traces what they left in this process.

    Args:
        requests: the plan's steps (see :func:`step_request`).
        traces: the plan's cache of traced steps by key; filled in.
        jobs: worker processes at most.
        timeout_s: the longest wait for the next result.

    Returns:
        How many steps were traced here.
    """
    global _PENDING
    todo: Dict[tuple, StepRequest] = {}
    for request in requests:
        if request.key not in traces:
            todo.setdefault(request.key, request)
    if jobs < 2 or len(todo) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    _PENDING = list(todo.values())
    traced = 0
    try:
        # Leaving the block terminates the workers, any still running included.
        with multiprocessing.get_context("fork").Pool(processes=min(jobs, len(_PENDING))) as pool:
            results = pool.imap_unordered(_trace_pending, range(len(_PENDING)))
            for _ in range(len(_PENDING)):
                index, trace = results.next(timeout=timeout_s)
                if trace is not None:  # else traced again by the plan, which reports the error where it belongs
                    traces[_PENDING[index].key] = trace
                    traced += 1
    except multiprocessing.TimeoutError:
        print(f"[plan] a tracing worker gave no result in {timeout_s:.0f} s; the rest are traced in this process.",
              file=sys.stderr, flush=True)
    finally:
        _PENDING = []
    return traced

"""The training steps a plan traces, and tracing the distinct ones on all cores.

Each variant and fine-tune of a plan needs one training step traced on fake tensors
(:mod:`torchtune_offload.plan.trace`): seconds each for an 8B model, and most of the planner's
time. Many share a step (the same model, gradients kept or freed, the same traced optimizer):
:func:`step_request` describes a config's step and the key that tells one step from another.
:func:`trace_steps` traces the distinct steps side by side in forked worker processes and leaves
them in the plan's shared cache, so that a 2-core machine plans an 8B config on both of its cores
(the target is at most 60 s there; Linux only); the plan is then assembled from the cache as
before.
"""

import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_offload.plan.fine_tunes import configured_fine_tune
from torchtune_offload.plan.fsdp import output_is_unit
from torchtune_offload.plan.trace import StepTrace, trace_training_step
from torchtune_offload.recipe import RecipeSettings
from torchtune_offload.recipe.checks.optimizer_rules import is_int
from torchtune_offload.recipe.chosen_optimizer import OptimizerKind


def mark_lora(model: torch.nn.Module) -> None:
    """Makes the adapters the only trainable parameters, as the LoRA recipe does."""
    set_trainable_params(model, get_adapter_params(model))


def sequence_length(cfg: DictConfig, override: Optional[int]) -> int:
    """Tokens per sample: ``--seq-len``, else the synthetic dataset's ``seq_len``, else ``tokenizer.max_seq_len``.

    Raises:
        ValueError: when none is known, or the one that counts is not a whole number of at least 1.
    """
    for key, value in (("--seq-len", override), ("dataset.seq_len", OmegaConf.select(cfg, "dataset.seq_len")),
                       ("tokenizer.max_seq_len", OmegaConf.select(cfg, "tokenizer.max_seq_len"))):
        if value is not None:
            if not is_int(value, low=1):
                raise ValueError(f"{key}={value!r}: the tokens per sample must be a whole number of at least 1.")
            return value
    raise ValueError("tokenizer.max_seq_len is null, so the sequence length is unknown: give --seq-len N.")


def traced_optimizer(settings: RecipeSettings) -> Optional[Callable[[list], torch.optim.Optimizer]]:
    """The optimizer whose step is traced: torch's own, on the device, stepping after backward."""
    chosen = settings.optimizer
    cls = chosen.optimizer_class
    if settings.device.type == "cpu" or chosen.kind is not OptimizerKind.PLAIN or not cls.__module__.startswith("torch.optim"):
        return None
    options = dict(chosen.base_options)
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


def fp8_weights(settings: RecipeSettings) -> Optional[Tuple[int, bool]]:
    """``(minimal_size, per_row)`` where the run holds its layer weights in FP8 on the device."""
    opts = settings.optimizer.offload
    if opts is None or opts.device_weights is None or settings.device.type == "cpu":
        return None
    return opts.minimal_size, opts.device_weights == "fp8"


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
        key_without_optimizer: where the step traces an optimizer, the key of the same step
            without it (a config whose optimizer keeps its state off the device), which
            :meth:`traces` gives as well; else None.
    """

    key: tuple
    cfg: DictConfig
    settings: RecipeSettings
    seq_len: int
    mark_trainable: Optional[Callable[[torch.nn.Module], None]]
    fp8_weights: Optional[Tuple[int, bool]]
    key_without_optimizer: Optional[tuple] = None
    #: The distributed recipe's step (one rank's model and batch; FSDP2's own memory is
    #: ``plan/fsdp.py``'s): no optimizer traced, gradients kept, and its loss.
    distributed: bool = False

    def describe(self) -> str:
        """The step in a few words, for messages."""
        frees = "gradients freed" if _frees_gradients(self.settings) else "gradients kept"
        return f"{self.cfg.model._component_} ({frees}, {self.settings.optimizer.optimizer_class.__name__})"

    def trace(self) -> StepTrace:
        """Traces the step (seconds for an 8B model)."""
        s = self.settings
        if self.distributed:
            return trace_training_step(self.cfg, s, seq_len=self.seq_len, row_chunked_loss=output_is_unit(self.cfg, s))
        return trace_training_step(self.cfg, s, seq_len=self.seq_len, mark_trainable=self.mark_trainable,
                                   free_gradients=_frees_gradients(s), make_optimizer=traced_optimizer(s),
                                   fp8_weights=self.fp8_weights)

    def traces(self) -> Dict[tuple, StepTrace]:
        """Traces the step, and gives the same step without its optimizer from the one trace.

        Returns:
            By key: the step's trace, and where it traces an optimizer and the derivation holds
            (see :func:`~torchtune_offload.plan.trace.trace_training_step`), the trace of the same
            step without it under ``key_without_optimizer``.
        """
        trace = self.trace()
        out = {self.key: trace}
        if self.key_without_optimizer is not None and trace.without_optimizer is not None:
            out[self.key_without_optimizer] = trace.without_optimizer
        return out


def _frees_gradients(settings: RecipeSettings) -> Union[bool, str]:
    """How the step's optimizer frees the gradients (:func:`trace_training_step`'s ``free_gradients``):
    torchtune's in-backward steps and torchao's offloader each gradient as it is made, an optimizer
    that declares ``hands_over_per_group`` (this project's engine) once its group is complete, unless
    its ``handoff`` is ``"parameter"``."""
    chosen = settings.optimizer
    if chosen.kind is OptimizerKind.IN_BACKWARD:
        return True
    if chosen.offload_gradients:
        per_parameter = chosen.offload is not None and chosen.offload.handoff == "parameter"
        return "per group" if chosen.capabilities.hands_over_per_group and not per_parameter else True
    return False


def step_request(cfg: DictConfig, settings: RecipeSettings, *, recipe: str, seq_len: int) -> StepRequest:
    """The step ``cfg`` trains.

    Args:
        cfg: a recipe config.
        settings: its settings, as ``check_recipe_config`` read them for ``recipe``.
        recipe: ``full``, ``lora`` or ``distributed``.
        seq_len: tokens per sample (:func:`sequence_length`).

    Returns:
        The request, keyed by what tells the steps of one plan apart. The variants and fine-tunes
        of one plan share the config's batch, dtype, activation settings and loss, so the key
        leaves them out; a cache shared across plans would need them. The distributed recipe's
        variants share one step: one rank's forward and backward, whatever the optimizer.
    """
    settings = replace(settings, compile=False)
    if recipe == "distributed":
        policy = json.dumps(OmegaConf.to_container(OmegaConf.create({"p": cfg.get("fsdp_shard_policy"),
                                                                     "c": cfg.get("custom_sharded_layers")})))
        key = (recipe, min(settings.gradient_accumulation_steps, 2), str(settings.device), policy,
               json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True), seq_len)
        return StepRequest(key=key, cfg=cfg, settings=settings, seq_len=seq_len, mark_trainable=None,
                           fp8_weights=None, distributed=True)
    free = _frees_gradients(settings)
    make = traced_optimizer(settings)
    fp8 = fp8_weights(settings)
    # The micro-batches the trace runs: one where each gradient is freed (a second repeats it), else up to two.
    micro_batches = 1 if free else min(settings.gradient_accumulation_steps, 2)

    def key(optimizer: Optional[tuple]) -> tuple:
        # optimizer: (class, its options) where its step is traced, else None.
        return (free, fp8, *(optimizer or (None, None)), micro_batches, str(settings.device), recipe,
                json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True), seq_len)

    traced = None
    if make is not None:
        traced = (settings.optimizer.optimizer_class, json.dumps(dict(settings.optimizer.options), sort_keys=True))
    return StepRequest(key=key(traced), cfg=cfg, settings=settings, seq_len=seq_len,
                       mark_trainable=mark_lora if recipe == "lora" else None, fp8_weights=fp8,
                       key_without_optimizer=key(None) if traced is not None else None)


def default_jobs() -> int:
    """The cores this process may run on (``--jobs``' default)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: The longest a worker may take over one step (an 8B step takes 2-8 s on the 2-core development
#: machine): one that hangs is stopped then, and the plan traces its step in this process.
WORKER_TIMEOUT_S = 300.0


def _not_given(later: Dict[tuple, StepRequest], request: StepRequest, traces: Dict[tuple, StepTrace]) -> list:
    """The step ``request`` was to give as well (``later``, by its key) where its worker did not
    give it and no other step still may: to be traced on its own, once."""
    step = later.pop(request.key, None)
    if step is None or step.key in traces or any(other.key == step.key for other in later.values()):
        return []
    return [step]


def _trace_in_worker(request: StepRequest, conn: Connection) -> None:
    """A forked worker's whole life: one step traced, its traces by key (:meth:`StepRequest.traces`;
    None where it failed) sent back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops its workers
    # The parent may have run torch's OpenMP threads (the process baseline runs a real step), and
    # libgomp's thread pool does not survive a fork: with one thread no parallel region enters it.
    torch.set_num_threads(1)
    try:
        traces: Optional[Dict[tuple, StepTrace]] = request.traces()
    except Exception:  # not sent: the plan traces the step again and reports the error where it belongs
        traces = None
    conn.send(traces)
    conn.close()


def parallel_tracing_available() -> bool:
    """Forked workers trace on Linux only: macOS's system libraries are not safe to fork (Python
    spawns there since 3.8) and Windows cannot fork."""
    return sys.platform == "linux"


#: A running worker: its process, the step it traces, and when it must be done (``time.monotonic()``).
_Worker = Tuple[multiprocessing.process.BaseProcess, StepRequest, float]


def _start_worker(context: Any, request: StepRequest) -> Tuple[Connection, multiprocessing.process.BaseProcess]:
    """A forked worker tracing ``request`` (the parent's own object, not a pickled copy), and the
    end of the pipe its traces come back on."""
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_trace_in_worker, args=(request, send), daemon=True)
    worker.start()
    send.close()  # the worker holds the only sending end: its death closes the pipe
    return receive, worker


def _result_of(receive: Connection, worker: multiprocessing.process.BaseProcess) -> Optional[Dict[tuple, Any]]:
    """What a finished worker sent (None if it died before sending); its pipe closed, its process joined."""
    try:
        result = receive.recv()
    except (EOFError, OSError):  # the worker died before sending
        result = None
    receive.close()
    worker.join()
    return result


def _stop_late(running: Dict[Connection, _Worker], *, timeout_s: float) -> List[StepRequest]:
    """Stops the workers past their deadline, each named on stderr; returns their steps."""
    now, late = time.monotonic(), []
    for receive in [r for r, (_, _, deadline) in running.items() if deadline <= now]:
        worker, request, _ = running.pop(receive)
        worker.kill()
        worker.join()
        receive.close()
        print(f"[plan] the trace of {request.describe()} took more than {timeout_s:.0f} s in a worker; "
              "it is traced in this process.", file=sys.stderr, flush=True)
        late.append(request)
    return late


def _steps_to_trace(requests: Sequence[StepRequest],
                    traces: Dict[tuple, StepTrace]) -> Tuple[List[StepRequest], Dict[tuple, StepRequest]]:
    """The distinct steps of ``requests`` that ``traces`` lacks: those to trace first, and the steps
    another one of them gives as well, by key (see :func:`_not_given`)."""
    todo: Dict[tuple, StepRequest] = {}
    for request in requests:
        if request.key not in traces:
            todo.setdefault(request.key, request)
    # Steps another one gives as well, by the key of that one: traced on their own only where it
    # does not give them (it failed, or its optimizer's state changed before its step).
    later = {r.key: todo[r.key_without_optimizer] for r in todo.values() if r.key_without_optimizer in todo}
    given = {step.key for step in later.values()}
    return [r for r in todo.values() if r.key not in given], later


def _keep_result(receive: Connection, worker: multiprocessing.process.BaseProcess, *,
                 traces: Dict[tuple, StepTrace], wanted: set) -> int:
    """Puts the traces a finished worker sent (see :func:`_result_of`) into ``traces``, those of the
    ``wanted`` steps only; returns how many."""
    result = _result_of(receive, worker)
    if result is None:
        return 0
    # A step without its optimizer that no variant runs is left out.
    result = {key: trace for key, trace in result.items() if key in wanted}
    traces.update(result)
    return len(result)


def trace_steps(requests: Sequence[StepRequest], traces: Dict[tuple, StepTrace], *, jobs: int,
                timeout_s: float = WORKER_TIMEOUT_S) -> int:
    """Traces the distinct steps of ``requests`` that ``traces`` lacks in forked worker processes,
    at most ``jobs`` at once, one step each, into ``traces``.

    Whatever goes wrong here only leaves steps out of ``traces``, and the plan traces those in this
    process where it needs them, reporting any error there as it always has: a step whose trace
    raises, a worker that dies (seen at once, by its pipe closing) or takes more than ``timeout_s``
    (stopped, and named on stderr), or processes that cannot be started. With one job, fewer than
    two steps to trace, or off Linux (:func:`parallel_tracing_available`), nothing is traced here;
    otherwise it says on stderr how many steps it traces, and how many it traced.

    Args:
        requests: the plan's steps (see :func:`step_request`).
        traces: the plan's cache of traced steps by key; filled in (the plan then adds what is missing).
        jobs: worker processes at most.
        timeout_s: the longest one worker may take.

    Returns:
        How many steps' traces were filled in here, those of steps without their optimizer
        included: each comes with the trace of the same step with it (:meth:`StepRequest.traces`)
        and is not traced on its own.
    """
    wanted = {request.key for request in requests}
    first, later = _steps_to_trace(requests, traces)
    if jobs < 2 or len(first) < 2 or not parallel_tracing_available():
        return 0
    print(f"tracing {len(wanted)} distinct training steps ({len(first)} traces), {min(jobs, len(first))} worker "
          "processes at a time ...", file=sys.stderr, flush=True)
    context = multiprocessing.get_context("fork")
    # The slowest first, so that the last worker to finish started early: a QLoRA step builds its
    # model whole, quantising every weight.
    waiting = sorted(first, key=lambda r: configured_fine_tune(r.cfg.model) != "QLoRA")
    running: Dict[Connection, _Worker] = {}
    traced = 0
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                request = waiting.pop(0)
                receive, worker = _start_worker(context, request)
                running[receive] = (worker, request, time.monotonic() + timeout_s)
            next_deadline = min(deadline for _, _, deadline in running.values())
            for receive in connection_wait(list(running), timeout=max(0.0, next_deadline - time.monotonic())):
                worker, request, _ = running.pop(receive)
                traced += _keep_result(receive, worker, traces=traces, wanted=wanted)
                waiting += _not_given(later, request, traces)
            for request in _stop_late(running, timeout_s=timeout_s):
                waiting += _not_given(later, request, traces)
    except Exception as err:  # no process could be started, say: the plan traces the rest itself
        print(f"[plan] tracing in worker processes stopped ({type(err).__name__}: {err}); the rest is traced in "
              "this process.", file=sys.stderr, flush=True)
    finally:
        for worker, _, _ in running.values():
            worker.kill()
            worker.join()
    print(f"traced {traced} of {len(wanted)} in workers" + ("" if traced == len(wanted) else
          "; the plan traces the rest, and says why it cannot where it cannot"), file=sys.stderr, flush=True)
    return traced

"""One training step of a configured model, traced on fake tensors: the memory the step needs.

The model is built on the meta device, as the recipe would build it (dtype, LoRA trainability,
activation checkpointing, the configured loss and its output chunks), then given fake CPU storage
under PyTorch's ``FakeTensorMode``: shapes, dtypes and every allocation, no memory and no data.
The RoPE caches are computed for real, since their construction reads values. QLoRA's frozen base
weights are torchao ``NF4Tensor`` objects, wrappers of five inner tensors (4-bit codes, quantised block
scales and their factors, the scales' mean, the 16-value code book); ``Module.to_empty`` gives
only three of them fake storage (torchao's ``empty_like`` copies the other two from the meta
weight), so the other two are given theirs here. Their dequantisation in forward and backward is
then traced like any other operator: its temporaries are in the peak. PyTorch's
``MemTracker`` then follows one training step (forward, loss, backward for each micro-batch of a
window up to two, and the optimizer step where one is given) and reports the peak of the memory
alive at any moment, split into parameters, buffers, gradients, activations, temporaries and
optimizer state.

A deep decoder is not traced whole: its layers are identical, so the step of its first four and
of its first five layers, traced event by event (after each operator: which layers run, the memory
by kind), gives every event of the whole model's step as a linear function of the number of layers
(``_extrapolated_peak`` says why that is exact). Llama 3.1 8B's 32 layers trace in about a third of
the time, to the byte (the whole model is still built, for the layer check and the copies: QLoRA's
without torchao's quantisation arithmetic, :mod:`~torchtune_offload.recipe.checks.meta_nf4`). Other
models (no ``layers`` list, layers unlike each other, few layers) are traced whole.

Fake tensors are CPU tensors here (a CPU-only torch cannot make fake CUDA ones): the trace counts
what the step allocates, which is what a GPU run allocates too, but a GPU's kernels may pick other
algorithms and its caching allocator rounds and fragments, so for a GPU the figure is a lower bound.
"""

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import config, modules, training
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.distributed.loss import RowChunkedLoss
from torchtune_offload.optim.fp8_weights import fp8_candidates, hold_in_fp8, image_bytes
from torchtune_offload.optim.handoff import BackwardHandoff, handoff_groups
from torchtune_offload.plan.peak_tracker import KINDS as _KINDS
from torchtune_offload.plan.peak_tracker import MIDDLE as _MIDDLE
from torchtune_offload.plan.peak_tracker import OPT as _OPT
from torchtune_offload.plan.peak_tracker import TOTAL as _TOTAL
from torchtune_offload.plan.peak_tracker import WORKING_KINDS, Event, NoHook, PeakTracker
from torchtune_offload.recipe import RecipeSettings, build_loss, loss_of_logits
from torchtune_offload.recipe.checks.fit import meta_model
from torchtune_offload.recipe.checks.meta_nf4 import copy_meta_model


#: Tensor subclasses the trace gives fake storage and follows exactly (QLoRA's NF4 base weights).
TRACEABLE_SUBCLASSES = (NF4Tensor,)
_WHAT_TO_DO = ("Plan a model of plain tensors or torchao NF4 weights (QLoRA), for example its lora_ or qlora_ "
               "builder, or measure a real run of it (log_peak_memory_stats=True).")


class UntraceableModelError(ValueError):
    """The configured model cannot be built or traced by the planner; the message is one line that
    names ``model._component_`` and what to do."""

    def __init__(self, component: str, problem: str, *, fix: str = _WHAT_TO_DO):
        super().__init__(f"model._component_={component}: {problem}. {fix}")
        self.component, self.problem = component, problem


@dataclass(frozen=True)
class StepTrace:
    """The traced peak of one training step.

    Attributes:
        peak_bytes: the most memory alive at once during the step.
        by_kind: that peak split by kind (``Parameter``, ``Buffer``, ``Gradient``,
            ``Activation``, ``Temp``, ``Optstate``, ``Other``).
        seconds: how long the trace took (0 for a step derived from another's trace).
        traced_layers: the layer counts of the reduced traces the step was extrapolated from
            (:func:`trace_training_step`); empty where the whole model was traced.
        without_optimizer: where an optimizer's step was traced, the same step without that
            optimizer (no state, no step), as tracing it so would give; else None.
        ops_per_micro_batch: the aten operators the first micro-batch's forward, loss and backward
            dispatched, as ``plan/launch.py`` counts them (extrapolated to every layer with the peak).
        working_bytes: the most memory alive at once that is no parameter, buffer, gradient or
            optimizer state (activations, temporaries, the loss's), at its own moment of the step,
            which need not be the peak's: what a rank of FSDP2 adds to the parameters it holds,
            running the same model on its own batch (``plan/fsdp.py``).
    """

    peak_bytes: int
    by_kind: Dict[str, int]
    seconds: float
    traced_layers: Tuple[int, ...] = ()
    without_optimizer: Optional["StepTrace"] = None
    ops_per_micro_batch: int = 0
    working_bytes: int = 0


def trace_training_step(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    seq_len: int,
    mark_trainable: Optional[Callable[[nn.Module], Any]] = None,
    free_gradients: Union[bool, str] = False,
    make_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
    fp8_weights: Optional[Tuple[int, bool]] = None,
    row_chunked_loss: bool = False,
) -> StepTrace:
    """Traces one training step of the run ``cfg`` describes, on fake tensors.

    A decoder of more than ``sum(REDUCED_LAYERS)`` identical layers is traced twice with its first
    ``REDUCED_LAYERS`` layers only and the step extrapolated to all of them
    (:func:`_extrapolated_peak`); any other model is traced whole.

    Args:
        cfg: the recipe config.
        settings: its checked settings (batch size, dtype, accumulation, checkpointing).
        seq_len: tokens per sample.
        mark_trainable: sets ``requires_grad`` as the recipe will (LoRA: the adapters).
        free_gradients: each gradient is freed as soon as backward has produced it (True: an
            optimizer that frees each gradient in its hook, or steps inside backward), or
            ``"per group"``: once its hand-off group is complete, as ``OffloadOptimizer`` hands
            gradients over (``optim/handoff.py``: a transformer layer, or a bucket of other
            parameters), so that a layer's gradients are on the device together.
        make_optimizer: builds the optimizer whose step is traced too, from the trainable
            parameters; ``None`` when its state is not on the device. The result then also holds
            the step without it (``without_optimizer``): the optimizer's state is made before the
            step's first operator, and torch's optimizers touch it in their step alone, so the
            events up to the step, less that state, are the events of the step traced without
            the optimizer, and a plan whose optimizer keeps its state off the device needs no
            trace of its own. Nothing is derived where the state the tracker saw was not the same
            at the first operator, at the peak before the step and at the step (and, in a trace
            extrapolated from reduced layers, at every event before the step: a whole-model trace
            keeps no events).
        fp8_weights: ``(minimal_size, per_row)`` of ``device_weights`` FP8 images: the layers the
            engine would hold in FP8 compute as it makes them (widened in forward and backward),
            their images counted under ``FP8 weight images``.
        row_chunked_loss: the distributed recipe's loss where the output projection is an FSDP2
            unit of its own (``distributed/loss.py``): the projection runs once, and a chunked loss
            upcasts its rows a chunk at a time, instead of the decoder projecting chunk by chunk.
    """
    start = time.perf_counter()
    model = build_meta_model(cfg, settings)
    try:
        if mark_trainable is not None:
            mark_trainable(model)
    except Exception as err:  # a builder whose model the recipe's set-up refuses
        raise UntraceableModelError(_component(cfg), f"cannot be set up for a training step as the recipe sets "
                                    f"it up ({type(err).__name__}: {one_line(err)})") from err
    step = partial(_traced_step, cfg, settings, seq_len=seq_len, free_gradients=free_gradients,
                   make_optimizer=make_optimizer, fp8_weights=fp8_weights, row_chunked_loss=row_chunked_loss)
    peak, peak_without, traced_layers, ops = _traced_peaks(step, model)
    seconds = time.perf_counter() - start
    without = None
    if peak_without is not None:
        (total, by_kind), working = peak_without
        without = StepTrace(peak_bytes=total, by_kind=by_kind, seconds=0.0, traced_layers=traced_layers,
                            ops_per_micro_batch=ops, working_bytes=working)
    (total, by_kind), working = peak
    return StepTrace(peak_bytes=total, by_kind=by_kind, seconds=seconds, traced_layers=traced_layers,
                     without_optimizer=without, ops_per_micro_batch=ops, working_bytes=working)


#: A step's peak ``(bytes, bytes by kind)`` and its working peak (:attr:`StepTrace.working_bytes`).
_Peaks = Tuple[Tuple[int, Dict[str, int]], int]


def _traced_peaks(step: Callable[..., "_Traced"], model: nn.Module) -> Tuple[
        _Peaks, Optional[_Peaks], Tuple[int, ...], int]:
    """``step``'s peaks on ``model``, its peaks without the optimizer (or None), the layer counts traced
    and a micro-batch's operators: extrapolated from reduced layers where that is exact, else traced whole."""
    layers = _identical_layers(model)
    if layers is not None and len(layers) > sum(REDUCED_LAYERS):
        small, large = (step(_with_first_layers(model, n), record=True) for n in REDUCED_LAYERS)
        peaks = _extrapolated_peaks(small, large, num_layers=len(layers))
        if peaks is not None:
            peaks_without = None
            if small.before_step is not None and large.before_step is not None:
                peaks_without = _extrapolated_peaks(small.before_step, large.before_step, num_layers=len(layers))
            # A layer's operators run once per layer, the rest once (see _extrapolated_peak).
            per_layer = (large.ops - small.ops) // (large.num_layers - small.num_layers)
            return peaks, peaks_without, REDUCED_LAYERS, small.ops + per_layer * (len(layers) - small.num_layers)
    whole = step(model, record=False)
    without = whole.before_step
    return (whole.peak, whole.working), None if without is None else (without.peak, without.working), (), whole.ops


def _extrapolated_peaks(small: "_Traced", large: "_Traced", *, num_layers: int) -> Optional[_Peaks]:
    """:func:`_extrapolated_peak` of the total and of the working memory; None where either is."""
    peak = _extrapolated_peak(small, large, num_layers=num_layers)
    working = _extrapolated_peak(small, large, num_layers=num_layers, of=_working)
    return None if peak is None or working is None else (peak, _working(working[1]))


@dataclass
class _Traced:
    """One traced step: its peak ``(bytes, bytes by kind)`` and, where recorded, every event;
    ``before_step``: the same step without its optimizer, where one was traced and its state
    stayed the same until its step (see :func:`trace_training_step`)."""

    peak: Tuple[int, Dict[str, int]]
    events: List[Event]
    num_layers: int
    before_step: Optional["_Traced"] = None
    #: The operators of the first micro-batch (:attr:`StepTrace.ops_per_micro_batch`).
    ops: int = 0
    #: :attr:`StepTrace.working_bytes` of this trace.
    working: int = 0


def _freeing_hooks(model: nn.Module, free_gradients: Union[bool, str]) -> List[Any]:
    """The hooks that free the trainable parameters' gradients as the optimizer will (see
    :func:`trace_training_step`'s ``free_gradients``)."""
    if not free_gradients:
        return []
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = handoff_groups([n for n, _ in named], [p.numel() * p.element_size() for _, p in named],
                            per_parameter=free_gradients != "per group")

    def free(indices: List[int]) -> None:
        for i in indices:
            named[i][1].grad = None

    handoff = BackwardHandoff(groups, free)

    def hook(index: int, _param: torch.Tensor) -> None:
        handoff.on_grad(index)

    return [p.register_post_accumulate_grad_hook(partial(hook, i)) for i, (_, p) in enumerate(named)]


def _set_up(cfg: DictConfig, settings: RecipeSettings, model: nn.Module, *,
            fp8_weights: Optional[Tuple[int, bool]], row_chunked_loss: bool = False) -> Tuple[FakeTensorMode, int, Any]:
    """Sets the meta ``model`` up as the recipe would, on fake storage: activation checkpointing,
    FP8 layer images where asked, RoPE caches, the loss (``row_chunked_loss``: see
    :func:`trace_training_step`). Returns the fake mode, the FP8 images' bytes and the loss.

    Raises:
        UntraceableModelError: the recipe's set-up fails on this model.
    """
    try:
        if settings.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        _give_fake_storage(model, mode)
        images = 0
        if fp8_weights is not None:
            minimal_size, per_row = fp8_weights
            with mode:
                for module in fp8_candidates(model, minimal_size=minimal_size).values():
                    images += image_bytes(module.weight, per_row=per_row)
                    hold_in_fp8(module, per_row=per_row)
        with training.set_default_dtype(settings.dtype):
            for module in model.modules():
                if callable(getattr(module, "rope_init", None)):
                    module.rope_init()
        if row_chunked_loss:  # as build_loss makes it for an FSDP2 output unit (traced eagerly, never compiled)
            loss = config.instantiate(cfg.loss)
            return mode, images, RowChunkedLoss(loss) if isinstance(loss, CEWithChunkedOutputLoss) else loss
        return mode, images, build_loss(cfg.loss, model, settings, verbose=False)
    except Exception as err:  # a model that is not a torchtune decoder, or a tensor type fake storage misses
        raise UntraceableModelError(_component(cfg), f"cannot be set up for a training step as the recipe sets "
                                    f"it up ({type(err).__name__}: {one_line(err)})") from err


def _traced_step(cfg: DictConfig, settings: RecipeSettings, model: nn.Module, *, seq_len: int,
                 free_gradients: Union[bool, str],
                 make_optimizer: Optional[Callable[[list], torch.optim.Optimizer]],
                 fp8_weights: Optional[Tuple[int, bool]], record: bool, row_chunked_loss: bool = False) -> _Traced:
    """Traces one step of the meta ``model`` (its trainable parameters marked), as
    :func:`trace_training_step` describes; ``record`` keeps every event for :func:`_extrapolated_peak`."""
    mode, images, loss_fn = _set_up(cfg, settings, model, fp8_weights=fp8_weights, row_chunked_loss=row_chunked_loss)
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = _freeing_hooks(model, free_gradients)
    vocab = token_vocab_size(cfg, model)
    layers = getattr(model, "layers", None)
    with mode, warnings.catch_warnings():
        optimizer = make_optimizer(trainable) if make_optimizer is not None else None
        tracker = PeakTracker(layers=list(layers) if record else None)
        # MemTracker hooks every parameter's gradient, which torch refuses for frozen ones (LoRA's
        # base weights): mark those as hooked already. They never get a gradient to track.
        for param in model.parameters():
            if not param.requires_grad:
                tracker._param_to_grad_hook_handles[param] = (NoHook(), NoHook())
        # MemTracker warns about the gradients the free hook has just dropped; they are gone, as meant.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        # torchtune's RMSNorm hands torch an fp32 input with a bf16 weight, and torch's CPU kernel
        # says it will not take its fused path: a CPU speed note, nothing about the traced memory.
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        before_step, ops = None, 0
        try:
            with tracker:
                state = tracker.now()[_OPT]
                for micro_batch in range(min(settings.gradient_accumulation_steps, 2)):
                    if micro_batch and all(p.grad is None for p in trainable):
                        break  # nothing kept from the first: the second would repeat it byte for byte
                    if micro_batch:
                        # The second micro-batch reuses the modules; the overall peak is kept.
                        tracker.reset_mod_stats()
                    tokens = torch.randint(0, vocab, (settings.batch_size, seq_len))
                    labels = torch.randint(0, vocab, (settings.batch_size, seq_len))
                    loss = micro_batch_loss(model, loss_fn, tokens, labels)
                    loss.backward()
                    del loss
                    if not micro_batch:
                        ops = tracker.ops
                if optimizer is not None:
                    before_step = (tracker.peak(), len(tracker.events), tracker.now()[_OPT], tracker.working_peak)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        except Exception as err:  # whatever an operator of the model refuses on fake tensors
            raise UntraceableModelError(_component(cfg), f"a training step could not be traced on fake tensors "
                                        f"({type(err).__name__}: {one_line(err)})") from err
    for hook in hooks:
        hook.remove()
    # The FP8 images are alive for the whole step, beside whatever the tracker saw (it tracks
    # parameters, not them): a constant added to every event.
    events = [(label, (*kinds, images)) for label, kinds in tracker.events]
    num_layers = len(layers) if layers is not None else 0
    traced = _Traced(peak=_peak_of(tracker.peak(), images), events=events, num_layers=num_layers, ops=ops,
                     working=tracker.working_peak)
    if before_step is not None:
        peak, count, state_at_step, working = before_step
        earlier = events[:count]
        # Exact only if the optimizer's state was the same from the first operator to its step
        # (the peak's figure stands for the events a whole-model trace does not keep).
        if state_at_step == state == peak[_OPT] and all(figures[_OPT] == state for _, figures in earlier):
            traced.before_step = _Traced(
                peak=_peak_of(_less_state(peak, state), images),
                events=[(label, _less_state(figures, state)) for label, figures in earlier], num_layers=num_layers,
                working=working)
    return traced


def _less_state(figures: Tuple[int, ...], state: int) -> Tuple[int, ...]:
    """Figures by kind (``_KINDS``, then any more) without ``state`` bytes of optimizer state."""
    out = list(figures)
    out[_OPT] -= state
    out[_TOTAL] -= state
    return tuple(out)


def _peak_of(figures: Tuple[int, ...], images: int) -> Tuple[int, Dict[str, int]]:
    """``(bytes, bytes by kind)`` of a tracker's figures (``_KINDS``) with ``images`` bytes of FP8 images beside."""
    by_kind = {getattr(k, "value", str(k)): v for k, v in zip(_KINDS, figures) if k != _TOTAL_KEY}
    if images:
        by_kind[_FP8_IMAGES] = images
    return figures[_TOTAL] + images, by_kind


#: The layer counts of the two reduced traces a deep decoder's step is extrapolated from: with
#: two layers at each end (``peak_tracker.role``), each count holds the first, second, second-last and last.
REDUCED_LAYERS = (4, 5)
_FP8_IMAGES = "FP8 weight images"


def _identical_layers(model: nn.Module) -> Optional[nn.ModuleList]:
    """The decoder's ``layers`` where every one is the same as the first: the same modules, the
    same parameter and buffer shapes, dtypes, types and trainability, the same settings (an
    attention window, a dropout), and no tensor shared between some layers but not all; ``None``
    for any other model (no ``layers`` list, a layer unlike the others, hidden states taken from
    some layers), which is then traced whole."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2 or getattr(model, "output_hidden_states", None):
        return None
    first = _layer_signature(layers[0])
    if any(_layer_signature(layer) != first for layer in layers[1:]):
        return None
    # A tensor held by every layer (the RoPE cache) is copied once into a reduced model, as here.
    holders: Counter = Counter()
    for layer in layers:
        holders.update({id(t) for t in (*layer.parameters(), *layer.buffers())})
    if any(n not in (1, len(layers)) for n in holders.values()):
        return None
    return layers


def _layer_signature(layer: nn.Module) -> list:
    signature = []
    for name, module in layer.named_modules():
        settings = sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str, type(None))))
        signature.append((name, type(module), settings))
    for name, tensor in (*layer.named_parameters(), *layer.named_buffers()):
        signature.append((name, type(tensor), tuple(tensor.shape), tensor.dtype, tensor.requires_grad))
    return signature


def _with_first_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """A copy of the meta ``model`` with its first ``num_layers`` layers only."""
    layers = model.layers
    model.layers = nn.ModuleList(layers[:num_layers])
    try:
        return copy_meta_model(model)
    finally:
        model.layers = layers


def _working(figures: Any) -> int:
    """The working memory (:attr:`StepTrace.working_bytes`) of an event's figures by kind (``_KINDS``,
    then any more), or of a peak's figures by kind name."""
    if isinstance(figures, dict):
        return sum(figures.get(k.value, 0) for k in WORKING_KINDS)
    return sum(figures[_KINDS.index(k)] for k in WORKING_KINDS)


def _total(figures: Tuple[int, ...]) -> int:
    """An event's total, the FP8 images beside what the tracker saw included."""
    return figures[_TOTAL] + figures[-1]


def _extrapolated_peak(small: _Traced, large: _Traced, *, num_layers: int,
                       of: Callable[[Tuple[int, ...]], int] = _total) -> Optional[Tuple[int, Dict[str, int]]]:
    """The peak of the step with ``num_layers`` identical layers, from traces with fewer: the event
    where ``of`` its figures (default: the total) is largest.

    Why it is exact: the step's operators run in the same order at any depth, those outside the
    layers once, those of a layer once per layer. An event (the memory alive after an operator) is
    keyed by the layers running then, each by its role (``peak_tracker.role``: the first two and the last two
    by place, the others ``_MIDDLE``), and by its place in that run of events. What is alive at an
    event outside the layers or in an end layer is what each layer holds at that moment (weights,
    gradients, saved inputs, optimizer state: the same for every layer before it, the same for
    every layer after it) plus what the moment itself adds: a linear function of the number of
    layers, which two traces give exactly. In a middle layer ``k`` it is linear in ``k`` too, so
    over the middle layers it is largest at the second or the second-last layer, both keyed; their
    events are left out. The peak is the largest event with ``num_layers`` layers, by kind as at
    that event. Operators that allocate nothing are not events (``PeakTracker``). The same holds
    for any sum of kinds (``of``: the working memory, :func:`_working`), each kind being linear too.

    Returns:
        ``(bytes, bytes by kind)``; ``None`` where the two traces' events do not line up (a step
        whose operators depend on the number of layers), for which the model is traced whole.
    """
    runs = [_runs(traced) for traced in (small, large)]
    if [(label, len(events)) for label, events in runs[0]] != [(label, len(events)) for label, events in runs[1]]:
        return None
    steps = large.num_layers - small.num_layers
    peak = None
    for (_, few), (_, more) in zip(*runs):
        for a, b in zip(few, more):
            figures = [x + (y - x) * (num_layers - small.num_layers) // steps for x, y in zip(a, b)]
            total = of(figures)
            if peak is None or total > peak[0]:
                peak = (total, figures)
    if peak is None:
        return None
    return _peak_of(tuple(peak[1][:-1]), peak[1][-1])


def _runs(traced: _Traced) -> List[Tuple[FrozenSet[Any], List[Tuple[int, ...]]]]:
    """The events in runs of the same layers running, those of middle layers left out."""
    runs: List[Tuple[FrozenSet[Any], List[Tuple[int, ...]]]] = []
    for label, figures in traced.events:
        if runs and runs[-1][0] == label:
            runs[-1][1].append(figures)
        else:
            runs.append((label, [figures]))
    return [(label, events) for label, events in runs if _MIDDLE not in label]


def check_builder_imports(cfg: DictConfig) -> None:
    """Raises where ``cfg.model``'s builder cannot be imported: before the recipe's config check,
    which would refuse it in every variant's row, the plan ends in one line. A config without a
    model builder is left to that check, which names the missing key.

    Args:
        cfg: a recipe config.

    Raises:
        UntraceableModelError: naming ``model._component_``.
    """
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not model.get("_component_"):
        return
    try:
        _get_component_from_path(_component(cfg))
    except Exception as err:  # torchtune raises its own InstantiationError, or ValueError for a bad path
        raise _unbuildable(cfg, err) from err


def _unbuildable(cfg: DictConfig, err: Exception) -> UntraceableModelError:
    return UntraceableModelError(
        _component(cfg), f"cannot be built on the meta device ({type(err).__name__}: {one_line(err)})",
        fix="Give the dotted path of a model builder that takes the other model.* keys, for example "
            "torchtune.models.llama3_1.qlora_llama3_1_8b.")


def build_meta_model(cfg: DictConfig, settings: RecipeSettings) -> nn.Module:
    """The configured model on the meta device (as :func:`meta_model`), its tensors checked.

    Raises:
        UntraceableModelError: when the builder cannot be found or fails, or the model holds a
            tensor subclass the trace cannot follow.
    """
    try:
        model = meta_model(cfg.model, settings)
    except Exception as err:  # torchtune's instantiate raises whatever the import or the builder raises
        raise _unbuildable(cfg, err) from err
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        kind = torch.Tensor if type(tensor) is nn.Parameter else type(tensor)
        if kind is not torch.Tensor and not issubclass(kind, TRACEABLE_SUBCLASSES):
            raise UntraceableModelError(
                _component(cfg), f"{name} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass the "
                "planner cannot trace on fake tensors")
    return model


def _give_fake_storage(model: nn.Module, mode: FakeTensorMode) -> None:
    """Fake CPU storage for every tensor of the meta ``model``, inner tensors of NF4 weights included."""
    with mode:
        model.to_empty(device="cpu")
        for tensor in [*model.parameters(), *model.buffers()]:
            if not is_traceable_wrapper_subclass(tensor):
                continue
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if not isinstance(inner, FakeTensor):
                    setattr(tensor, name, torch.empty_like(inner, device="cpu"))


def _component(cfg: DictConfig) -> str:
    return str(cfg.model.get("_component_", "?"))


def micro_batch_loss(model: nn.Module, loss_fn: nn.Module, tokens: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss as the recipes' loop computes it (:func:`loss_of_logits`). The logits
    are gone when this returns, as the recipe's loss helper drops them before backward; the loss
    keeps what its backward needs."""
    return loss_of_logits(loss_fn, model(tokens), labels)


def one_line(err: BaseException) -> str:
    """The error's message on one line, cut at 300 characters (a line, not a page of a kernel's dump)."""
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def token_vocab_size(cfg: DictConfig, model: nn.Module) -> int:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise UntraceableModelError(_component(cfg), "no token embedding found, so the planner cannot make "
                                    "input tokens for it")
    return embeddings[0].num_embeddings

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

Fake tensors are CPU tensors here (a CPU-only torch cannot make fake CUDA ones): the trace counts
what the step allocates, which is what a GPU run allocates too, but a GPU's kernels may pick other
algorithms and its caching allocator rounds and fragments, so for a GPU the figure is a lower bound.
"""

import time
import warnings
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import modules, training

from torchtune_offload.optim.fp8_weights import fp8_candidates, hold_in_fp8, image_bytes
from torchtune_offload.recipe import RecipeSettings, build_loss, loss_of_logits
from torchtune_offload.recipe.host_preflight import meta_model


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
        seconds: how long the trace took.
    """

    peak_bytes: int
    by_kind: Dict[str, int]
    seconds: float


def trace_training_step(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    seq_len: int,
    mark_trainable: Optional[Callable[[nn.Module], Any]] = None,
    free_gradients: bool = False,
    make_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
    fp8_weights: Optional[Tuple[int, bool]] = None,
) -> StepTrace:
    """Traces one training step of the run ``cfg`` describes, on fake tensors.

    Args:
        cfg: the recipe config.
        settings: its checked settings (batch size, dtype, accumulation, checkpointing).
        seq_len: tokens per sample.
        mark_trainable: sets ``requires_grad`` as the recipe will (LoRA: the adapters).
        free_gradients: each gradient is freed as soon as backward has produced it (an
            optimizer that offloads gradients, or steps inside backward).
        make_optimizer: builds the optimizer whose step is traced too, from the trainable
            parameters; ``None`` when its state is not on the device.
        fp8_weights: ``(minimal_size, per_row)`` of ``device_weights`` FP8 images: the layers the
            engine would hold in FP8 compute as it makes them (widened in forward and backward),
            their images counted under ``FP8 weight images``.
    """
    start = time.perf_counter()
    model = build_meta_model(cfg, settings)
    try:
        if mark_trainable is not None:
            mark_trainable(model)
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
        loss_fn = build_loss(cfg.loss, model, settings, verbose=False)
    except Exception as err:  # a model that is not a torchtune decoder, or a tensor type fake storage misses
        raise UntraceableModelError(_component(cfg), f"cannot be set up for a training step as the recipe sets "
                                    f"it up ({type(err).__name__}: {one_line(err)})") from err
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = []
    if free_gradients:
        def free(param: torch.Tensor) -> None:
            param.grad = None
        hooks = [p.register_post_accumulate_grad_hook(free) for p in trainable]
    vocab = _vocab_size(cfg, model)
    with mode:
        optimizer = make_optimizer(trainable) if make_optimizer is not None else None
        tracker = _PeakTracker()
        # MemTracker hooks every parameter's gradient, which torch refuses for frozen ones (LoRA's
        # base weights): mark those as hooked already. They never get a gradient to track.
        for param in model.parameters():
            if not param.requires_grad:
                tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        # MemTracker warns about the gradients the free hook has just dropped; they are gone, as meant.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        try:
            with tracker:
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
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        except Exception as err:  # whatever an operator of the model refuses on fake tensors
            raise UntraceableModelError(_component(cfg), f"a training step could not be traced on fake tensors "
                                        f"({type(err).__name__}: {one_line(err)})") from err
        snapshot = tracker.get_tracker_snapshot("peak")
    for hook in hooks:
        hook.remove()
    figures = next(iter(snapshot.values())) if snapshot else {}
    by_kind = {getattr(k, "value", str(k)): int(v) for k, v in figures.items() if k != "Total"}
    if images:
        # Alive for the whole step, beside whatever the tracker saw (it tracks parameters, not them).
        by_kind["FP8 weight images"] = images
    return StepTrace(peak_bytes=int(figures.get("Total", 0)) + images, by_kind=by_kind,
                     seconds=time.perf_counter() - start)


def build_meta_model(cfg: DictConfig, settings: RecipeSettings) -> nn.Module:
    """The configured model on the meta device (as :func:`meta_model`), its tensors checked.

    Raises:
        UntraceableModelError: when the builder cannot be found or fails, or the model holds a
            tensor subclass the trace cannot follow.
    """
    try:
        model = meta_model(cfg.model, settings)
    except Exception as err:  # torchtune's instantiate raises whatever the import or the builder raises
        raise UntraceableModelError(
            _component(cfg), f"cannot be built on the meta device ({type(err).__name__}: {one_line(err)})",
            fix="Give the dotted path of a model builder that takes the other model.* keys, for example "
                "torchtune.models.llama3_1.qlora_llama3_1_8b.") from err
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


class _PeakTracker(MemTracker):
    """``MemTracker`` keeping only the step's overall peak, which is all the planner reads.

    ``MemTracker`` also keeps each module's own peak: at every operator it passes over every
    module seen so far, so a trace costs operators x modules. LoRA's adapters triple the modules of
    a model: planning llama3_2 1B LoRA took 75 s against 33 s for the full fine-tune, and Llama 3.1
    8B LoRA did not finish a variant in 9 minutes. The overall peak is updated exactly as
    ``MemTracker`` updates it.
    """

    def _update_peak_stats(self, peak_state) -> None:
        del peak_state  # a module-level state; no module peaks are kept
        for dev, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[dev] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(snapshot)


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def _vocab_size(cfg: DictConfig, model: nn.Module) -> int:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise UntraceableModelError(_component(cfg), "no token embedding found, so the planner cannot make "
                                    "input tokens for it")
    return embeddings[0].num_embeddings

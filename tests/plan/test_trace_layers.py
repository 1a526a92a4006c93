"""A deep decoder's step extrapolated from traces of its first few layers, against the whole model traced."""

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from torchtune_offload.plan import trace
from torchtune_offload.plan.planner import load_config
from torchtune_offload.plan.step_traces import mark_lora, traced_optimizer
from torchtune_offload.plan.trace import REDUCED_LAYERS, build_meta_model, trace_training_step
from torchtune_offload.recipe import check_recipe_config

#: The tiny Llama at shapes NF4 can quantise, 10 layers deep (the fewest traced in part: more than 4 + 5).
DEEP_TINY = ["model.num_layers=10", "model.embed_dim=256", "model.intermediate_dim=512"]
BF16_CHECKPOINTED = ["dtype=bf16", "enable_activation_checkpointing=True"]


def _traces(monkeypatch, config, overrides, *, recipe, seq_len, free_gradients=True, with_optimizer=False,
            fp8_weights=None):
    """The step traced as the planner traces it, then with every layer (extrapolation turned off)."""
    cfg = load_config(config, overrides)
    settings = replace(check_recipe_config(cfg, recipe=recipe, device_present=False), compile=False)
    options = dict(seq_len=seq_len, mark_trainable=mark_lora if recipe == "lora" else None,
                   free_gradients=free_gradients, fp8_weights=fp8_weights,
                   make_optimizer=traced_optimizer(settings) if with_optimizer else None)
    if with_optimizer:
        assert options["make_optimizer"] is not None
    reduced = trace_training_step(cfg, settings, **options)
    with monkeypatch.context() as patch:
        patch.setattr(trace, "REDUCED_LAYERS", (1000, 1001))  # more layers than the model has: traced whole
        whole = trace_training_step(cfg, settings, **options)
    assert reduced.traced_layers == REDUCED_LAYERS and whole.traced_layers == ()
    return reduced, whole, build_meta_model(cfg, settings)


@pytest.mark.parametrize("config, overrides, recipe, free_gradients, with_optimizer", [
    # torch's AdamW stepping on the device, its multi-tensor kernels over every layer's weights.
    ("configs/tiny/full.yaml", [*DEEP_TINY, "device=cuda", "optimizer._component_=torch.optim.AdamW"],
     "full", False, True),
    ("configs/tiny/lora.yaml", [*DEEP_TINY, *BF16_CHECKPOINTED], "lora", False, False),
    # QLoRA: NF4 base weights, dequantised in forward, in the recomputed forward and in backward.
    ("configs/tiny/lora.yaml", [*DEEP_TINY, *BF16_CHECKPOINTED, "model.quantize_base=True"], "lora", True, False),
], ids=["full-adamw-step", "lora", "qlora"])
def test_the_extrapolated_step_is_the_whole_models_byte_for_byte(monkeypatch, config, overrides, recipe,
                                                                 free_gradients, with_optimizer):
    reduced, whole, model = _traces(monkeypatch, config, overrides, recipe=recipe, seq_len=2,
                                    free_gradients=free_gradients, with_optimizer=with_optimizer)
    assert (reduced.peak_bytes, reduced.by_kind) == (whole.peak_bytes, whole.by_kind)
    # The operators of a micro-batch, extrapolated from the reduced traces as the peak is: the whole model's.
    assert reduced.ops_per_micro_batch == whole.ops_per_micro_batch > 0
    if reduced.without_optimizer is not None:
        assert reduced.without_optimizer.ops_per_micro_batch == reduced.ops_per_micro_batch
    # The weights at the peak are the whole model's, NF4 storage and adapters included.
    assert reduced.by_kind["Parameter"] == sum(
        sum(t.numel() * t.element_size() for t in _storages(p)) for p in model.parameters())


def _storages(param: torch.Tensor) -> list:
    if hasattr(param, "__tensor_flatten__"):  # NF4: codes, scales and their factors, the code book
        return [getattr(param, name) for name in param.__tensor_flatten__()[0]]
    return [param]


def test_a_peak_that_moves_with_the_layer_count(monkeypatch):
    # Gradients kept, four tokens: the peak is in the loss with 4 or 5 layers but at the end of
    # backward with 24, whose gradients outgrow the logits. A line through the two reduced traces'
    # peaks misses it; their events, extrapolated one by one, do not.
    reduced, whole, _ = _traces(monkeypatch, "configs/tiny/full.yaml", ["model.num_layers=24"], recipe="full",
                                seq_len=4, free_gradients=False)
    assert (reduced.peak_bytes, reduced.by_kind) == (whole.peak_bytes, whole.by_kind)
    cfg = load_config("configs/tiny/full.yaml", ["model.num_layers=24"])
    settings = check_recipe_config(cfg, recipe="full", device_present=False)
    model = build_meta_model(cfg, settings)
    few, more = (trace._traced_step(cfg, settings, trace._with_first_layers(model, n), seq_len=4, free_gradients=False,
                                    make_optimizer=None, fp8_weights=None, record=False).peak[0]
                 for n in REDUCED_LAYERS)
    assert few + (more - few) * (24 - REDUCED_LAYERS[0]) < whole.peak_bytes


def test_a_real_architecture_with_tied_embeddings_and_fp8_layer_images(monkeypatch):
    # Llama 3.2 1B, full, bf16, activation checkpointing: 16 layers, the output projection tied to
    # the token embedding; the engine's FP8 images of the layer weights, extrapolated with the rest.
    reduced, whole, _ = _traces(monkeypatch, "configs/llama3_2/1B_full_offload_engine.yaml", ["batch_size=1"],
                                recipe="full", seq_len=16, fp8_weights=(4096, True))
    assert reduced.by_kind["FP8 weight images"] > 0
    assert (reduced.peak_bytes, reduced.by_kind) == (whole.peak_bytes, whole.by_kind)


def test_layers_unlike_the_others_are_traced_whole():
    cfg = load_config("configs/tiny/full.yaml", ["model.num_layers=12"])
    settings = check_recipe_config(cfg, recipe="full", device_present=False)
    model = build_meta_model(cfg, settings)
    assert trace._identical_layers(model) is model.layers
    with torch.device("meta"):
        model.layers[7].mlp = nn.Linear(64, 64)
    assert trace._identical_layers(model) is None
    model = build_meta_model(cfg, settings)
    model.layers[3].attn.num_heads = 2  # a setting, as an attention window of some layers would be
    assert trace._identical_layers(model) is None
    model = build_meta_model(cfg, settings)
    model.output_hidden_states = [5]
    assert trace._identical_layers(model) is None
    model = build_meta_model(cfg, settings)
    model.layers[1].mlp.w1.weight = model.layers[2].mlp.w1.weight  # shared by two layers, not all
    assert trace._identical_layers(model) is None


def test_traces_whose_events_do_not_line_up_give_no_extrapolation():
    def traced(num_layers, runs):
        events = [(frozenset(label), (size,) * len(trace._KINDS) + (0,)) for label, n, size in runs for _ in range(n)]
        return trace._Traced(peak=(0, {}), events=events, num_layers=num_layers)

    small = traced(4, [((), 2, 10), ((0,), 3, 20), ((-1,), 3, 30)])
    assert trace._extrapolated_peak(small, traced(5, [((), 2, 10), ((0,), 3, 22), (("middle",), 3, 99),
                                                      ((-1,), 3, 33)]), num_layers=32)[0] == 30 + 3 * 28
    # One more operator in the last layer of the larger trace: the step depends on the layer count.
    assert trace._extrapolated_peak(small, traced(5, [((), 2, 10), ((0,), 3, 22), ((-1,), 4, 33)]),
                                    num_layers=32) is None


@pytest.mark.parametrize("config, overrides, recipe", [
    # Traced whole (two layers), one micro-batch.
    ("configs/tiny/full.yaml", [], "full"),
    # Extrapolated, gradients kept over two micro-batches.
    ("configs/tiny/full.yaml", [*DEEP_TINY, "gradient_accumulation_steps=2"], "full"),
    # Extrapolated LoRA: the adapters' state only, bf16 with activation checkpointing.
    ("configs/tiny/lora.yaml", [*DEEP_TINY, *BF16_CHECKPOINTED], "lora"),
], ids=["whole", "extrapolated-accumulating", "lora"])
def test_the_step_without_its_optimizer_is_derived_as_tracing_it_gives(config, overrides, recipe):
    """One trace with torch's AdamW stepping also gives the step without it (a paged or offloaded
    optimizer's), byte for byte and kind for kind, at the same layer counts."""
    cfg = load_config(config, [*overrides, "device=cuda", "optimizer._component_=torch.optim.AdamW"])
    settings = replace(check_recipe_config(cfg, recipe=recipe, device_present=False), compile=False)
    options = dict(seq_len=4, mark_trainable=mark_lora if recipe == "lora" else None, free_gradients=False)
    with_optimizer = trace_training_step(cfg, settings, make_optimizer=traced_optimizer(settings), **options)
    without = trace_training_step(cfg, settings, **options)
    derived = with_optimizer.without_optimizer
    assert derived is not None and without.without_optimizer is None
    assert (derived.peak_bytes, derived.by_kind, derived.traced_layers) == (
        without.peak_bytes, without.by_kind, without.traced_layers)
    assert with_optimizer.by_kind["Optstate"] > 0 == derived.by_kind["Optstate"]


def test_no_step_is_derived_where_the_optimizers_state_changes_before_its_step():
    """The derivation holds only while the state stays as the optimizer made it until its step
    (torch's optimizers touch it in step() alone): one whose state is dropped during backward (here,
    by a gradient hook) gets no derived step."""
    cfg = load_config("configs/tiny/full.yaml", ["device=cuda", "optimizer._component_=torch.optim.AdamW"])
    settings = replace(check_recipe_config(cfg, recipe="full", device_present=False), compile=False)
    make = traced_optimizer(settings)

    def make_forgetful(params):
        optimizer = make(params)

        def forget(param):
            optimizer.state[param].clear()

        for param in params:
            param.register_post_accumulate_grad_hook(forget)
        return optimizer

    assert trace_training_step(cfg, settings, seq_len=4, make_optimizer=make).without_optimizer is not None
    assert trace_training_step(cfg, settings, seq_len=4, make_optimizer=make_forgetful).without_optimizer is None


def test_a_bf16_trace_passes_on_no_warning_about_the_cpu_kernel_or_dropped_gradients():
    """The planner's output is for the user: torch's note that its CPU RMSNorm kernel is not fused
    (torchtune's fp32 input beside a bf16 weight) and MemTracker's about freed gradients say
    nothing about the plan, and the filters do not outlive the trace."""
    cfg = load_config("configs/tiny/full.yaml", BF16_CHECKPOINTED)
    settings = replace(check_recipe_config(cfg, recipe="full", device_present=False), compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters_before = list(warnings.filters)
        trace_training_step(cfg, settings, seq_len=4, mark_trainable=None, free_gradients=True, fp8_weights=None,
                            make_optimizer=None)
        assert warnings.filters == filters_before
    assert [str(w.message) for w in caught] == []

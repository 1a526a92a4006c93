"""The backward hand-off per group: the groups, when each is handed over, and the engine's results
against a hand-off per parameter (``handoff="parameter"``)."""

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2

from tests.optim.side_by_side import assert_same_params, assert_same_states, batches, tiny_model, twin
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim.handoff import BUCKET_BYTES, BackwardHandoff, handoff_groups, layer_prefix
from torchtune_offload.recipe.chosen_optimizer import OptimizerKind
from torchtune_offload.recipe.run_optimizer import HoldingOptimizer, RunOptimizer


def test_layer_prefix():
    assert layer_prefix("layers.3.attn.q_proj.weight") == "layers.3"
    assert layer_prefix("model.layers.12.mlp.w1.weight") == "model.layers.12"
    assert layer_prefix("layers.3") == "layers.3"
    assert layer_prefix("layers.3._checkpoint_wrapped_module.attn") == "layers.3"
    assert layer_prefix("tok_embeddings.weight") == layer_prefix("layers") == layer_prefix("extra_layers.1x") == ""


def test_a_group_per_layer_and_buckets_of_the_rest():
    names = ["tok_embeddings.weight", "layers.0.a", "layers.0.b", "layers.1.a", "norm.scale", "output.weight",
             "extra.small"]
    sizes = [4, 10, 10, 10, 4, BUCKET_BYTES + 1, 4]
    groups = handoff_groups(names, sizes)
    assert groups[1] == groups[2] != groups[3]
    # The embedding and the norm are not neighbours (layers between); output is over the bucket alone.
    assert len({groups[0], groups[4], groups[5], groups[6]}) == 4
    assert handoff_groups(["a", "b", "c"], [4, 4, 4], bucket_bytes=8) == [0, 0, 1]
    assert handoff_groups(["a", "layers.0.w", "b"], [4, 4, 4]) == [0, 1, 2]


def test_a_group_is_handed_over_when_complete_and_the_rest_at_the_end_of_backward():
    handed = []
    handoff = BackwardHandoff([0, 0, 1, 1], handed.append)
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    a.register_post_accumulate_grad_hook(lambda _: handoff.on_grad(0))
    b.register_post_accumulate_grad_hook(lambda _: handoff.on_grad(2))

    def check_on_hook(_):  # neither group is complete during the backward
        assert handed == [] and handoff.collected >= 1

    a.register_post_accumulate_grad_hook(check_on_hook)
    ((a * 2).sum() + (b * 3).sum()).backward()
    # Neither group was complete (indices 1 and 3 never arrived): both went at the end of the backward.
    assert sorted(map(sorted, handed)) == [[0], [2]] and handoff.num_handoffs == 2 and handoff.collected == 0
    handed.clear()
    handoff.on_grad(1)  # outside a backward: handed over at once
    assert handed == [[1]]


def _llama():
    torch.manual_seed(0)
    return llama3_2(vocab_size=128, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=16,
                    intermediate_dim=64)


def test_the_engine_hands_over_once_per_layer_and_bucket():
    model = _llama()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True, lr=1e-3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for micro_batch in range(2):
        before = opt.handoff_count()
        model(tokens).float().mean().backward()
        # 3 layers, and the embedding, the final norm and the output projection in one bucket or two
        assert 3 < opt.handoff_count() - before <= 3 + 4
    opt.step()
    opt.zero_grad()
    opt.close()


def test_groups_given_to_the_engine_are_handed_over_whole_and_the_rest_as_before():
    """``group_handoff`` (an FSDP2 unit's parameters, ``distributed/sharded_offload.py``): the given
    groups replace the layers' and buckets' of their members; the training is plain AdamW's."""
    model, plain = _llama(), _llama()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True, lr=1e-3)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    # Two layers as one group, the third layer's parameters two groups, the rest untouched.
    third = list(model.layers[2].parameters())
    opt.group_handoff([[*model.layers[0].parameters(), *model.layers[1].parameters()], third[:2], third[2:]])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(2):
        before = opt.handoff_count()
        model(tokens).float().mean().backward()
        plain(tokens).float().mean().backward()
        # 1 + 2 groups of layers, and the embedding, the final norm and the output in one bucket or two
        assert 3 < opt.handoff_count() - before <= 3 + 2, opt.handoff_count() - before
        for optimizer in (opt, reference):
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    opt.close()


def test_groups_given_to_an_engine_that_hands_over_per_parameter_are_refused():
    model = _llama()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True, handoff="parameter")
    with pytest.raises(ValueError, match=r"optimizer.handoff=parameter with groups .* Remove it \(~optimizer.handoff\)"):
        opt.group_handoff([list(model.layers[0].parameters())])
    opt.close()


def _raise(_grad):
    raise RuntimeError("a backward that stops half way")


def test_gradients_collected_by_a_backward_that_raises_are_stepped_as_plain_adamw_steps_them():
    """A backward that raises ends neither its incomplete group nor itself (no end-of-backward
    hand-off): the gradients it completed are handed over when the optimizer next reads them, so
    none is lost, and the step is plain AdamW's on the same partial gradients."""
    base = tiny_model()
    (x, y), (x2, y2) = batches(num=2)
    ref, model = twin(base), twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True, lr=1e-2,
                           weight_decay=0.1)
    for m in (ref, model):
        hidden = m[1](m[0](x))
        hidden.register_hook(_raise)  # the first layer's gradients are never made
        with pytest.raises(RuntimeError, match="half way"):
            ((m[2:](hidden) - y) ** 2).sum().backward()
    assert model[0].weight.grad is None and opt._scheduler.handoff.collected == 4  # layers 2 and 4, unhanded
    for o in (ref_opt, opt):
        o.step()
        o.zero_grad()
    assert_same_params(ref, model)
    for m, o in ((ref, ref_opt), (model, opt)):  # and training goes on as before
        ((m(x2) - y2) ** 2).sum().backward()
        o.step()
        o.zero_grad()
    assert_same_params(ref, model)
    opt.close()


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("offload_gradients, overlap", [(True, False), (False, True), (True, True)])
def test_a_handoff_per_parameter_trains_plain_adamws_bits_and_frees_each_gradient_as_it_is_made(
        offload_gradients, overlap, clip):
    """``handoff="parameter"``: a hand-off per gradient (so an offloaded gradient leaves the device
    before the rest of its layer's are made), the results plain AdamW's with accumulation and
    clipping, as with a hand-off per group."""
    model, plain = _llama(), _llama()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=offload_gradients,
                           overlap=overlap, handoff="parameter", lr=1e-3, weight_decay=0.1)
    assert "handoff=parameter" in opt.options.summary()
    engine = HoldingOptimizer(opt, model=model, clip_grad_norm=clip)
    reference = RunOptimizer(torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1),
                             params=list(plain.parameters()), clip_grad_norm=clip, kind=OptimizerKind.PLAIN)
    # Within layer 0 the attention's q_proj gets its gradient after the feed-forward's (backward's order).
    q_proj, w1 = model.layers[0].attn.q_proj.weight, model.layers[0].mlp.w1.weight
    freed_before_layer_ends = []
    q_proj.register_post_accumulate_grad_hook(lambda _: freed_before_layer_ends.append(w1.grad is None))
    tokens = torch.randint(0, 128, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    n_params = len(list(model.parameters()))
    for step in range(3):
        for run, m in ((engine, model), (reference, plain)):
            for i, micro_batch in enumerate(tokens):
                if i == len(tokens) - 1:
                    run.before_final_backward()
                before = opt.handoff_count()
                (m(micro_batch).float().mean() / len(tokens)).backward()
                if run is engine:
                    assert opt.handoff_count() - before == n_params
            run.step()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    # Offloaded gradients leave the device one by one; kept on it (overlap alone), they stay until the step.
    assert freed_before_layer_ends == [offload_gradients] * 6
    opt.close()


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("options", [
    dict(optimizer_class="torchtune_offload.AdamW8bit", min_8bit_size=0),
    dict(master_dtype="fp32"),
    dict(device_weights="fp8"),
], ids=["AdamW8bit", "fp32-masters", "fp8-device-weights"])
def test_a_handoff_per_parameter_changes_no_bit_of_the_engines_other_paths(options, clip):
    """The host steps' other paths (8-bit states, fp32 masters, FP8 device images re-quantized after
    each step), overlapped with offloaded gradients: the same bits per parameter as per group."""
    models, runs = [], []
    for handoff in ("group", "parameter"):
        model = _llama().to(torch.bfloat16)
        opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True, overlap=True,
                               handoff=handoff, lr=1e-3, **options)
        models.append(model)
        runs.append(HoldingOptimizer(opt, model=model, clip_grad_norm=clip))
    tokens = torch.randint(0, 128, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        for run, model in zip(runs, models):
            for i, micro_batch in enumerate(tokens):
                if i == len(tokens) - 1:
                    run.before_final_backward()
                (model(micro_batch).float().mean() / len(tokens)).backward()
            run.step()
    for run in runs:
        run.synchronize()
    grouped, per_parameter = (run.optimizer for run in runs)
    assert per_parameter.handoff_count() > grouped.handoff_count()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert_same_states(per_parameter.state_dict(), grouped.state_dict())
    for run in runs:
        run.close()


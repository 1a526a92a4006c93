"""FSDP2 shard policies: what each selects, how YAML reads, and tied embeddings.

Plans are checked on meta-device models; sharding runs for real in a one-rank gloo group, where
FSDP2 still gathers and reduces through its collectives, against an unsharded copy.
"""

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torchtune import modules, training
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.distributed import policies
from torchtune_offload.distributed import (
    ModuleClass,
    NamePattern,
    RowChunkedLoss,
    any_of,
    embeddings,
    layers,
    parse_shard_policy,
    plan_shard,
    policy_problems,
    shard_model,
)

VOCAB = 96


def decoder(*, tied: bool, num_layers: int = 2, device: str = "meta") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return llama3_2(vocab_size=VOCAB, num_layers=num_layers, num_heads=4, num_kv_heads=2, embed_dim=32,
                        max_seq_len=64, intermediate_dim=48, tie_word_embeddings=tied)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# --------------------------------------------------------------------------------- policies


def test_layers_is_the_default_and_selects_each_transformer_layer():
    plan = plan_shard(decoder(tied=False, num_layers=3), parse_shard_policy(None))
    assert plan.units == ["layers.2", "layers.1", "layers.0"]  # innermost / last first
    assert layers("decoder.layers.12", None) and not layers("layers.1.attn", None) and not layers("layers", None)


def test_embeddings_selects_token_embedding_and_output_projection():
    plan = plan_shard(decoder(tied=False), [layers, embeddings])
    assert sorted(plan.units) == ["layers.0", "layers.1", "output", "tok_embeddings"]
    assert plan.matches["embeddings"] == ["tok_embeddings", "output"]
    assert not plan.skipped


def test_name_pattern_is_a_full_match_on_the_qualified_name():
    model = decoder(tied=False, num_layers=12)
    plan = plan_shard(model, [NamePattern(r"layers\.1")])
    assert plan.units == ["layers.1"]  # not layers.10, layers.11 or layers.1.attn
    mlps = plan_shard(model, [NamePattern(r"layers\.1\d?\.mlp")]).units
    assert mlps == ["layers.11.mlp", "layers.10.mlp", "layers.1.mlp"]


def test_module_class_by_dotted_path_and_through_activation_checkpointing():
    model = decoder(tied=False)
    by_class = parse_shard_policy([{"module_class": "torchtune.modules.TransformerSelfAttentionLayer"}])
    assert plan_shard(model, by_class).units == plan_shard(model, [layers]).units
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    # Names and classes see through the checkpoint wrapper; the unit is the wrapper itself.
    assert plan_shard(model, by_class).units == ["layers.1", "layers.0"]
    assert plan_shard(model, [NamePattern(r"layers\.0\.mlp")]).units == ["layers.0.mlp"]
    assert type(model.layers[0]).__name__ == "CheckpointWrapper"


def test_policies_compose():
    model = decoder(tied=False)
    as_list = plan_shard(model, [layers, NamePattern("output")]).units
    assert plan_shard(model, any_of(layers, NamePattern("output"))).units == as_list
    assert sorted(as_list) == ["layers.0", "layers.1", "output"]
    mixed = parse_shard_policy(["layers", {"module_class": "torch.nn.Embedding"}, {"name_pattern": "norm"}])
    assert sorted(plan_shard(model, mixed).units) == ["layers.0", "layers.1", "norm", "tok_embeddings"]


def test_custom_sharded_layers_keeps_torchtunes_meaning():
    # torchtune: each layer plus the modules named exactly as listed.
    policies = parse_shard_policy(None, custom_sharded_layers=["tok_embeddings", "output"])
    units = plan_shard(decoder(tied=False), policies).units
    assert sorted(units) == ["layers.0", "layers.1", "output", "tok_embeddings"]
    assert NamePattern(re.escape("a.b"))("a.b", None) and not NamePattern(re.escape("a.b"))("axb", None)


@pytest.mark.parametrize("policy", [NamePattern("tok_embedding"), ModuleClass(nn.Conv2d)])
def test_a_policy_that_matches_nothing_is_an_error(policy):
    with pytest.raises(ValueError, match=r"fsdp_shard_policy: .* selects no module"):
        plan_shard(decoder(tied=False), [layers, policy])


def test_invalid_yaml_items_are_all_reported_by_index():
    _, problems = policy_problems(
        ["layer", {"module_class": "torch.nn.NoSuchLayer"}, {"module_class": "torch.optim.AdamW"},
         {"name_pattern": "("}, {"name_pattern": "a", "module_class": "b"}]
    )
    assert [p.split("=")[0] for p in problems] == [f"fsdp_shard_policy[{i}]" for i in range(5)]
    assert "unknown built-in policy" in problems[0] and "does not resolve" in problems[1]
    assert "not an nn.Module subclass" in problems[2]
    _, problems = policy_problems([], custom_sharded_layers="output")
    assert problems[0].startswith("fsdp_shard_policy=[]") and problems[1].startswith("custom_sharded_layers=")


# ---------------------------------------------------------------------------------- tied


def test_tied_embedding_stays_in_the_root_unit():
    model = decoder(tied=True)
    torchtunes = parse_shard_policy(None, custom_sharded_layers=["tok_embeddings", "output"])
    for policy in ([layers, embeddings], torchtunes):
        plan = plan_shard(model, policy)  # 'output' is a TiedLinear, not a module: still a match
        assert plan.units == ["layers.1", "layers.0"]
        assert set(plan.skipped) == {"tok_embeddings", "output"}
        assert "root unit" in plan.skipped["tok_embeddings"]


def _forward_backward(model: nn.Module, tokens: torch.Tensor):
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()
    }
    return logits.detach(), grads


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embeddings_policy_trains_exactly_like_the_unsharded_model(one_rank, tied):
    model = decoder(tied=tied, device="cpu")
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    plan = shard_model(model, policy=[layers, embeddings])
    assert isinstance(model.tok_embeddings, FSDPModule) is not tied
    assert isinstance(model, FSDPModule) and all(isinstance(m, FSDPModule) for m in model.layers)
    assert ("output" in plan.units) is not tied
    for _ in range(2):  # the second pass runs from resharded state
        logits, grads = _forward_backward(model, tokens)
        ref_logits, ref_grads = _forward_backward(reference, tokens)
        torch.testing.assert_close(logits, ref_logits)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], msg=name)
        model.zero_grad(), reference.zero_grad()


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_cpu_offload_reaches_every_unit_and_the_root(monkeypatch, cpu_offload):
    """fsdp_cpu_offload runs only with an accelerator; here the calls it makes are recorded: every
    unit, the root last, gets FSDP2's CPUOffloadPolicy (a unit without it would keep its shards on
    the device), and none does without it."""
    calls = []
    monkeypatch.setattr(policies, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    model = decoder(tied=False)
    plan = shard_model(model, policy=[layers, embeddings], cpu_offload=cpu_offload)
    assert len(calls) == len(plan.units) + 1 and calls[-1][0] is model
    for _, kwargs in calls:
        assert isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy) is cpu_offload


def test_a_separate_unit_for_a_tied_embedding_would_break_the_forward(one_rank):
    # Why the plan keeps it in the root: the embedding's unit frees its gathered weight after the
    # lookup, and the tied output projection then meets a sharded DTensor.
    model = decoder(tied=True, device="cpu")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model.tok_embeddings)
    fully_shard(model)
    with pytest.raises(RuntimeError, match="DTensor"):
        model(torch.randint(0, VOCAB, (2, 12)))


# ------------------------------------------------------------------------ chunked output


def test_row_chunked_loss_equals_torchtunes_chunked_loss():
    # With the output projection as a unit, the recipe projects once and chunks rows instead.
    torch.manual_seed(0)
    logits = torch.randn(3, 17, VOCAB, dtype=torch.bfloat16)
    labels = torch.randint(0, VOCAB, (3, 17))
    labels[0, 5:] = -100
    chunked = CEWithChunkedOutputLoss(num_output_chunks=8)
    expected = chunked(list(logits.chunk(8, dim=1)), labels)
    actual = RowChunkedLoss(chunked)(logits.reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(actual, expected)

"""Unit tests of torchtune_offload.assets.checkpoints: seeded init, HF configs, architectures."""

from __future__ import annotations

import math

import pytest
import torch
from torchtune.config._utils import _get_component_from_path

from torchtune_offload.assets.checkpoints import (
    INIT_STD,
    REAL_ARCHES,
    build_meta_model,
    hf_config_for,
    init_tensor,
)
from torchtune_offload.models import TINY_LLAMA_DEFAULTS


def _init(name, shape=(64, 32), num_layers=2, seed=0, dtype=torch.float32):
    meta = torch.empty(shape, device="meta")
    return init_tensor(name=name, meta=meta, num_layers=num_layers, seed=seed, dtype=dtype)


def test_init_is_per_name_and_seed_deterministic():
    q = _init("layers.0.attn.q_proj.weight")
    assert torch.equal(q, _init("layers.0.attn.q_proj.weight"))
    # Independent of depth (so a --num-layers cut keeps the same tensors) ...
    assert torch.equal(q, _init("layers.0.attn.q_proj.weight", num_layers=16))
    # ... but not of the name or the seed.
    assert not torch.equal(q, _init("layers.1.attn.q_proj.weight"))
    assert not torch.equal(q, _init("layers.0.attn.q_proj.weight", seed=1))
    assert q.device.type == "cpu" and q.is_contiguous() and q.dtype == torch.float32
    assert _init("layers.0.attn.q_proj.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_init_rules():
    assert torch.equal(_init("norm.scale", shape=(8,)), torch.ones(8))
    assert torch.equal(_init("layers.0.attn.q_proj.bias", shape=(8,)), torch.zeros(8))
    big = (256, 256)
    plain = _init("layers.0.mlp.w1.weight", shape=big, num_layers=8).std().item()
    residual = _init("layers.0.mlp.w2.weight", shape=big, num_layers=8).std().item()
    assert plain == pytest.approx(INIT_STD, rel=0.05)
    assert residual == pytest.approx(INIT_STD / math.sqrt(2 * 8), rel=0.05)
    with pytest.raises(ValueError, match="no init rule"):
        _init("layers.0.something.weight", shape=(4, 4, 4))


def test_tiny_hf_config_matches_the_builder_defaults():
    model = build_meta_model(real_arch=None, num_layers=None)
    special_ids = {"<|begin_of_text|>": 499, "<|end_of_text|>": 500,
                   "<|finetune_right_pad_id|>": 501}
    config = hf_config_for(model=model, real_arch=None, dtype=torch.float32,
                           special_ids=special_ids)
    d = TINY_LLAMA_DEFAULTS
    assert config["hidden_size"] == d["embed_dim"]
    assert config["intermediate_size"] == d["intermediate_dim"]
    assert config["num_attention_heads"] == d["num_heads"]
    assert config["num_key_value_heads"] == d["num_kv_heads"]
    assert config["head_dim"] == d["embed_dim"] // d["num_heads"]
    assert config["num_hidden_layers"] == d["num_layers"]
    assert config["vocab_size"] == d["vocab_size"]
    assert config["max_position_embeddings"] == d["max_seq_len"]
    assert config["rope_theta"] == float(d["rope_base"])
    assert config["rope_scaling"] is None and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    token_ids = (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    assert token_ids == (499, 500, 501)


def test_real_arch_table():
    for name, arch in REAL_ARCHES.items():
        # The dotted path names a torchtune builder.
        assert callable(_get_component_from_path(arch.builder))
        assert arch.model_type in ("LLAMA3", "LLAMA3_2", "QWEN2")
        assert arch.hf_extra["architectures"] and "bos_token_id" in arch.hf_extra
    model = build_meta_model(real_arch="llama3_2_1b", num_layers=2)
    assert len(model.layers) == 2 and model.tok_embeddings.weight.is_meta
    config = hf_config_for(model=model, real_arch="llama3_2_1b", dtype=torch.bfloat16)
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "bfloat16"
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["tie_word_embeddings"] is True and config["bos_token_id"] == 128000

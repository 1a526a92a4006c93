"""Random-init checkpoints in Hugging Face format, for the tiny model and for real architectures.

Real-architecture mode (``--real-arch``) writes ``config.json`` and
``model.safetensors`` (bf16 unless ``--dtype``) directly into ``--output-dir``,
built on the meta device and filled tensor by tensor from a seeded generator so
peak memory stays near one model copy. Every tensor has its own seed, derived
from the base seed and its state-dict key, so a ``--num-layers N`` cut holds
exactly the full checkpoint's first N blocks.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
from safetensors.torch import save_file
from torchtune import training
from torchtune.config._utils import _get_component_from_path
from torchtune.models.convert_weights import tune_to_hf
from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

from torchtune_offload.assets.files import CONFIG_FILE, WEIGHTS_FILE, log, write_json
from torchtune_offload.models import tiny_llama

INIT_STD = 0.02

# Weight dtypes by their command-line name.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class RealArch:
    """A torchtune model builder plus the HF fields its shapes do not imply.

    Attributes:
        builder: Dotted path of the torchtune model builder.
        model_type: torchtune checkpointer ``ModelType`` name.
        hf_extra: Hugging Face ``config.json`` fields set on top of the shapes.
    """

    builder: str
    model_type: str
    hf_extra: Mapping[str, Any]


# The architectures ``--real-arch`` accepts, by name.
_LLAMA_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "bos_token_id": 128000, "eos_token_id": 128001}
REAL_ARCHES: Dict[str, RealArch] = {
    "llama3_2_1b": RealArch(
        builder="torchtune.models.llama3_2.llama3_2_1b", model_type="LLAMA3_2", hf_extra=_LLAMA_HF,
    ),
    "llama3_2_3b": RealArch(
        builder="torchtune.models.llama3_2.llama3_2_3b", model_type="LLAMA3_2", hf_extra=_LLAMA_HF,
    ),
    # 16 GB in bf16: for GPU benchmarks on a machine with the disk and RAM for it.
    "llama3_1_8b": RealArch(
        builder="torchtune.models.llama3_1.llama3_1_8b", model_type="LLAMA3", hf_extra=_LLAMA_HF,
    ),
    # Llama 3.2 narrowed to 78M parameters (torchtune_offload/models/mid.py), for CPU benchmarks.
    "llama3_2_mid": RealArch(
        builder="torchtune_offload.models.llama3_2_mid", model_type="LLAMA3_2", hf_extra=_LLAMA_HF,
    ),
    "qwen2_5_0_5b": RealArch(
        builder="torchtune.models.qwen2_5.qwen2_5_0_5b",
        model_type="QWEN2",
        hf_extra={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                  "bos_token_id": 151643, "eos_token_id": 151645,
                  "use_sliding_window": False, "sliding_window": 32768},
    ),
}  # fmt: skip


def build_meta_model(*, real_arch: Optional[str], num_layers: Optional[int]) -> torch.nn.Module:
    """Build the target architecture on the meta device (no memory for weights).

    Args:
        real_arch: Key of ``REAL_ARCHES``, or None for :func:`tiny_llama`.
        num_layers: Keep only the first this-many transformer blocks.

    Returns:
        The model with meta tensors.
    """
    with torch.device("meta"):
        if real_arch is None:
            model = tiny_llama()
        else:
            model = _get_component_from_path(REAL_ARCHES[real_arch].builder)()
    if num_layers is not None:
        model.layers = model.layers[:num_layers]
    return model


def hf_config_for(*, model: torch.nn.Module, real_arch: Optional[str], dtype: torch.dtype,
                  special_ids: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    """Describe ``model`` as a Hugging Face ``config.json``.

    Shapes are read off the built module so they can never disagree with it.

    Args:
        model: A torchtune ``TransformerDecoder`` (meta tensors are fine).
        real_arch: Key of ``REAL_ARCHES``, or None for the tiny Llama.
        dtype: Dtype the weights are stored in.
        special_ids: The tiny tokenizer's special ids (tiny mode only).

    Returns:
        The config as a plain dict.
    """
    layer = model.layers[0]
    attn = layer.attn
    rope = attn.pos_embeddings
    config: Dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.tok_embeddings.embedding_dim,
        "intermediate_size": layer.mlp.w1.out_features,
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "num_hidden_layers": len(model.layers),
        "vocab_size": model.tok_embeddings.num_embeddings,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": layer.sa_norm.eps,
        "rope_theta": float(rope.base),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": attn.q_proj.bias is not None,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        # torchtune's TiedLinear has no parameter of its own, so no output.weight.
        "tie_word_embeddings": "output.weight" not in model.state_dict(),
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
        "use_cache": True,
    }
    if hasattr(rope, "scale_factor"):  # Llama 3.1+/3.2 frequency scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(rope.scale_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": rope.old_context_len,
        }
    if real_arch is not None:
        config.update(REAL_ARCHES[real_arch].hf_extra)
    if special_ids is not None:
        config["bos_token_id"] = special_ids["<|begin_of_text|>"]
        config["eos_token_id"] = special_ids["<|end_of_text|>"]
        config["pad_token_id"] = special_ids["<|finetune_right_pad_id|>"]
    return config


def _param_seed(*, seed: int, name: str) -> int:
    # Per-name seeds make each tensor independent of build order and of how
    # many layers exist, so --num-layers 1 reproduces layer 0 of the full model.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(*, name: str, meta: torch.Tensor, num_layers: int, seed: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Create one seeded, initialised parameter for a torchtune state-dict key.

    Args:
        name: torchtune state-dict key, e.g. ``layers.0.attn.q_proj.weight``.
        meta: The meta tensor giving the shape.
        num_layers: Depth of the model, for the residual-projection scaling.
        seed: Base seed.
        dtype: Storage dtype.

    Returns:
        A contiguous CPU tensor.

    Raises:
        ValueError: For a parameter kind this init scheme does not know.
    """
    if name.endswith(".scale"):  # RMSNorm gains start at identity
        return torch.ones(meta.shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(meta.shape, dtype=dtype)
    if not name.endswith(".weight") or meta.dim() != 2:
        raise ValueError(f"no init rule for parameter {name} with shape {tuple(meta.shape)}")
    std = INIT_STD
    if name.endswith(("attn.output_proj.weight", "mlp.w2.weight")):
        # Residual-branch outputs scaled down (GPT-2 style) so depth does not
        # inflate the initial activations; also keeps the initial loss ~ln(V).
        std = INIT_STD / math.sqrt(2 * num_layers)
    gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed=seed, name=name))
    values = torch.empty(meta.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    return values.to(dtype).contiguous()


def write_checkpoint(*, model: torch.nn.Module, config: Mapping[str, Any], model_type: str,
                     seed: int, dtype: torch.dtype, ckpt_dir: Path, init_depth: int) -> None:
    """Materialise seeded weights for ``model`` and write them in HF format.

    Args:
        model: The meta-device model whose state-dict keys and shapes to fill.
        config: The HF config (also written as ``config.json``).
        model_type: torchtune checkpointer model type; selects the key mapping.
        seed: Base seed for :func:`init_tensor`.
        dtype: Storage dtype.
        ckpt_dir: Directory receiving ``config.json`` and ``model.safetensors``.
        init_depth: Untruncated depth of the architecture; sets the residual
            init scale so a ``--num-layers`` cut keeps the full model's tensors.
    """
    tune_sd = {
        name: init_tensor(name=name, meta=meta, num_layers=init_depth, seed=seed, dtype=dtype)
        for name, meta in model.state_dict().items()
    }
    shape_kwargs = dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        dim=config["hidden_size"],
        head_dim=config["head_dim"],
    )
    if model_type == "QWEN2":
        hf_sd = qwen2_tune_to_hf(
            tune_sd, tie_word_embeddings=config["tie_word_embeddings"], **shape_kwargs
        )
    else:
        hf_sd = tune_to_hf(tune_sd, **shape_kwargs)
    del tune_sd
    # The q/k permutation returns views; safetensors wants owning contiguous tensors.
    hf_sd = {k: v.contiguous() for k, v in sorted(hf_sd.items())}
    n_params = sum(v.numel() for v in hf_sd.values())
    write_json(path=ckpt_dir / CONFIG_FILE, obj=dict(config))
    weights_path = ckpt_dir / WEIGHTS_FILE
    tmp = weights_path.with_name(weights_path.name + ".tmp")
    save_file(hf_sd, str(tmp), metadata={"format": "pt"})
    # safetensors creates the file owner-only; match the other files' umask mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    tmp.replace(weights_path)
    log(
        f"wrote {ckpt_dir / WEIGHTS_FILE} ({n_params:,} params, {_HF_DTYPE_NAMES[dtype]}, "
        f"{weights_path.stat().st_size / 2**20:.1f} MiB) and {CONFIG_FILE}; model_type={model_type}"
    )


def load_with_checkpointer(*, ckpt_dir: Path, model_type: str) -> Dict[str, torch.Tensor]:
    """Read a checkpoint back exactly as the recipes do.

    Args:
        ckpt_dir: Directory with ``config.json`` and ``model.safetensors``.
        model_type: torchtune ``ModelType`` name.

    Returns:
        The torchtune-format model state dict.
    """
    with tempfile.TemporaryDirectory(prefix="tiny_assets_ckpt_out_") as out:
        checkpointer = training.FullModelHFCheckpointer(
            checkpoint_dir=str(ckpt_dir),
            checkpoint_files=[WEIGHTS_FILE],
            model_type=model_type,
            output_dir=out,
            recipe_checkpoint=None,
        )
        return checkpointer.load_checkpoint()[training.MODEL_KEY]

"""NF4 weights on the meta device without the quantisation's arithmetic: the same tensors, sooner."""

import pytest
import torch
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
from torchtune import training

from torchtune_offload.models import qlora_llama3_2_mid
from torchtune_offload.recipe.meta_nf4 import nf4_on_meta_without_arithmetic

ORIGINAL = NF4Tensor.__dict__["convert_to_norm_float_weight"]


def _described(weight: NF4Tensor) -> dict:
    """Every inner tensor's shape, stride, dtype and device, and the weight's own."""
    names, _ = weight.__tensor_flatten__()
    inner = {n: (tuple(getattr(weight, n).shape), getattr(weight, n).stride(), getattr(weight, n).dtype,
                 getattr(weight, n).device) for n in names}
    return {"inner": inner, "outer": (tuple(weight.shape), weight.stride(), weight.dtype, weight.device),
            "blocks": (weight.block_size, weight.n_blocks, weight.scaler_block_size)}


@pytest.mark.parametrize("shape", [(512, 1536), (1536, 512), (64 * 256,), (128, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_meta_weight_is_described_as_torchao_describes_it(shape, dtype):
    weight = torch.empty(shape, dtype=dtype, device="meta")
    slow = to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        fast = to_nf4(weight)
    assert _described(fast) == _described(slow)


def test_inside_the_block_a_meta_weight_skips_the_quantisation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantised")

    monkeypatch.setattr(NF4Tensor, "quantize_tensor_nearest", staticmethod(refuse))
    weight = torch.empty(512, 1536, dtype=torch.bfloat16, device="meta")
    with pytest.raises(AssertionError, match="quantised"):
        to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        assert to_nf4(weight).quantized_data.shape == (512 * 1536 // 2,)


def test_a_patch_made_after_import_is_used_for_real_weights_and_kept(monkeypatch):
    calls = []
    torchaos = NF4Tensor.__dict__["convert_to_norm_float_weight"].__func__

    def counted(*args):
        calls.append(args[0].device.type)
        return torchaos(*args)

    monkeypatch.setattr(NF4Tensor, "convert_to_norm_float_weight", staticmethod(counted))
    patched = NF4Tensor.__dict__["convert_to_norm_float_weight"]
    with nf4_on_meta_without_arithmetic():
        to_nf4(torch.randn(64, 256))
        to_nf4(torch.empty(64, 256, device="meta"))
    assert calls == ["cpu"]
    assert NF4Tensor.__dict__["convert_to_norm_float_weight"] is patched


def test_a_whole_qlora_model_on_meta_has_the_same_tensors():
    def build():
        with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
            return qlora_llama3_2_mid(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
                                      apply_lora_to_mlp=True)

    slow = build()
    with nf4_on_meta_without_arithmetic():
        fast = build()
    slow_params, fast_params = dict(slow.named_parameters()), dict(fast.named_parameters())
    assert slow_params.keys() == fast_params.keys()
    quantised = [n for n, p in slow_params.items() if isinstance(p, NF4Tensor)]
    assert len(quantised) == 4 * 7, "every base weight of the 4 layers must be NF4"
    for name, p in slow_params.items():
        q = fast_params[name]
        assert type(q) is type(p) and q.requires_grad == p.requires_grad
        if isinstance(p, NF4Tensor):
            assert _described(q) == _described(p), name
        else:
            assert (q.shape, q.dtype, q.device) == (p.shape, p.dtype, p.device), name


def test_real_weights_are_quantised_by_torchao_bit_for_bit():
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        got = to_nf4(weight)
    assert torch.equal(got.quantized_data, expected.quantized_data)
    assert torch.equal(got.get_original_weight(), expected.get_original_weight())


def test_the_shortcut_is_only_installed_inside_the_block_nested_or_failing():
    with nf4_on_meta_without_arithmetic():
        with nf4_on_meta_without_arithmetic():
            assert NF4Tensor.__dict__["convert_to_norm_float_weight"] is not ORIGINAL
        # The inner block's end leaves the outer one's shortcut in place.
        assert NF4Tensor.__dict__["convert_to_norm_float_weight"] is not ORIGINAL
    assert NF4Tensor.__dict__["convert_to_norm_float_weight"] is ORIGINAL
    with pytest.raises(RuntimeError, match="inside"):
        with nf4_on_meta_without_arithmetic():
            raise RuntimeError("inside")
    assert NF4Tensor.__dict__["convert_to_norm_float_weight"] is ORIGINAL


def test_a_weight_torchao_refuses_is_refused_inside_the_block_too():
    # An odd element count passes torchao's block checks (block size 1) but not its packing.
    weight = torch.empty(7, device="meta")
    with pytest.raises(AssertionError, match="even"):
        NF4Tensor.convert_to_norm_float_weight(weight, 7, 1, torch.empty(16, device="meta"))
    with nf4_on_meta_without_arithmetic(), pytest.raises(AssertionError, match="even"):
        NF4Tensor.convert_to_norm_float_weight(weight, 7, 1, torch.empty(16, device="meta"))

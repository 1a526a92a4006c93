"""NF4 weights on the meta device without the quantisation's arithmetic: the same tensors, sooner."""

import copy

import pytest
import torch
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
from torchtune import training

from torchtune_offload.models import qlora_llama3_2_mid
from torchtune_offload.recipe.checks.meta_nf4 import copy_meta_model, nf4_on_meta_without_arithmetic

ORIGINAL = NF4Tensor.__dict__["convert_to_norm_float_weight"]
SHORTCUT_NAMES = ("convert_to_norm_float_weight", "double_quantize_scalers")


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype, t.device)


def _described(weight: NF4Tensor) -> dict:
    """Every inner tensor's layout (shape, strides, offset, storage size, dtype, device), the
    weight's own, and its other attributes."""
    names, _ = weight.__tensor_flatten__()
    inner = {n: _layout(getattr(weight, n)) for n in names}
    others = {k: v for k, v in vars(weight).items() if not isinstance(v, torch.Tensor)}
    return {"inner": inner, "outer": (tuple(weight.shape), weight.stride(), weight.dtype, weight.device),
            "blocks": (weight.block_size, weight.n_blocks, weight.scaler_block_size), "others": others,
            "requires_grad": weight.requires_grad}


# (64 * 256,) has one scaler block: torchao's quantisation factor is then a view of a longer storage.
@pytest.mark.parametrize("shape", [(512, 1536), (1536, 512), (64 * 256,), (128, 2048), (64 * 512, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_meta_weight_is_described_as_torchao_describes_it(shape, dtype):
    weight = torch.empty(shape, dtype=dtype, device="meta")
    slow = to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        # The first weight of a size may have its scalers laid out by torchao; the second is not.
        fast = [to_nf4(weight), to_nf4(weight)]
    assert _described(fast[0]) == _described(slow) and _described(fast[1]) == _described(slow)


def test_inside_the_block_a_meta_weight_skips_the_quantisation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantised")

    monkeypatch.setattr(NF4Tensor, "quantize_tensor_nearest", staticmethod(refuse))
    weight = torch.empty(512, 1536, dtype=torch.bfloat16, device="meta")
    with pytest.raises(AssertionError, match="quantised"):
        to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        assert to_nf4(weight).quantized_data.shape == (512 * 1536 // 2,)


def test_inside_the_block_torchao_lays_out_the_scalers_once_per_size(monkeypatch):
    calls = []
    torchaos = NF4Tensor.__dict__["double_quantize_scalers"].__func__

    def counted(*args):
        calls.append((args[0].device.type, args[0].numel()))
        return torchaos(*args)

    monkeypatch.setattr(NF4Tensor, "double_quantize_scalers", staticmethod(counted))
    # Sizes no other test quantises on the meta device: the layouts are kept for the process.
    sizes = [(64 * 256 * 37, 2), (64 * 256 * 41, 2)]
    with nf4_on_meta_without_arithmetic():
        made = [to_nf4(torch.empty(size, dtype=torch.bfloat16, device="meta")) for size in [*sizes, *sizes]]
        to_nf4(torch.randn(64, 256))
    assert calls == [("meta", 64 * 256 * 37 * 2), ("meta", 64 * 256 * 41 * 2), ("cpu", 64 * 256)]
    assert _described(made[2]) == _described(made[0]) and _described(made[3]) == _described(made[1])
    # New tensors each time, not the first weight's.
    assert made[2].quantized_scalers is not made[0].quantized_scalers


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
    assert torch.equal(got.quantized_scalers, expected.quantized_scalers)
    assert torch.equal(got.quantization_factor, expected.quantization_factor)
    assert torch.equal(got.get_original_weight(), expected.get_original_weight())


def test_the_shortcut_is_only_installed_inside_the_block_nested_or_failing():
    originals = {n: NF4Tensor.__dict__[n] for n in SHORTCUT_NAMES}
    assert originals["convert_to_norm_float_weight"] is ORIGINAL
    with nf4_on_meta_without_arithmetic():
        with nf4_on_meta_without_arithmetic():
            assert all(NF4Tensor.__dict__[n] is not originals[n] for n in SHORTCUT_NAMES)
        # The inner block's end leaves the outer one's shortcuts in place.
        assert all(NF4Tensor.__dict__[n] is not originals[n] for n in SHORTCUT_NAMES)
    assert all(NF4Tensor.__dict__[n] is originals[n] for n in SHORTCUT_NAMES)
    with pytest.raises(RuntimeError, match="inside"):
        with nf4_on_meta_without_arithmetic():
            raise RuntimeError("inside")
    assert all(NF4Tensor.__dict__[n] is originals[n] for n in SHORTCUT_NAMES)


def test_scalers_of_a_size_torchao_refuses_are_refused_every_time_inside_the_block():
    weight = torch.empty(64 * 100, device="meta")  # 100 blocks: not a whole scaler block of 256
    with pytest.raises(AssertionError, match="divisible"):
        to_nf4(weight)
    with nf4_on_meta_without_arithmetic():
        for _ in range(2):
            with pytest.raises(AssertionError, match="divisible"):
                to_nf4(weight)


def test_a_shortcut_looked_up_inside_the_block_still_works_after_it_closes():
    # Another thread may have looked a shortcut up just before the last block closed.
    with nf4_on_meta_without_arithmetic():
        scalers = NF4Tensor.double_quantize_scalers
        indices = NF4Tensor.convert_to_norm_float_weight
    weight = torch.empty(64 * 256, device="meta")
    assert len(scalers(weight, 64, 256)) == 3
    assert indices(weight, 256, 64, torch.empty(16, device="meta")).shape == (64 * 128,)


def test_a_weight_torchao_refuses_is_refused_inside_the_block_too():
    # An odd element count passes torchao's block checks (block size 1) but not its packing.
    weight = torch.empty(7, device="meta")
    with pytest.raises(AssertionError, match="even"):
        NF4Tensor.convert_to_norm_float_weight(weight, 7, 1, torch.empty(16, device="meta"))
    with nf4_on_meta_without_arithmetic(), pytest.raises(AssertionError, match="even"):
        NF4Tensor.convert_to_norm_float_weight(weight, 7, 1, torch.empty(16, device="meta"))


def _qlora_mid_on_meta():
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"), nf4_on_meta_without_arithmetic():
        return qlora_llama3_2_mid(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
                                  apply_lora_to_mlp=True)


def test_a_copied_meta_model_holds_what_a_deep_copy_holds_without_quantising(monkeypatch):
    model = _qlora_mid_on_meta()
    expected = copy.deepcopy(model)  # torchtune's NF4 clone: dequantises and quantises anew

    def refuse(*args, **kwargs):
        raise AssertionError("dequantised")

    monkeypatch.setattr(NF4Tensor, "get_original_weight", refuse)
    got = copy_meta_model(model)
    got_tensors = dict([*got.named_parameters(), *got.named_buffers()])
    expected_tensors = dict([*expected.named_parameters(), *expected.named_buffers()])
    originals = dict([*model.named_parameters(), *model.named_buffers()])
    assert got_tensors.keys() == expected_tensors.keys() == originals.keys()
    assert sum(isinstance(t, NF4Tensor) for t in got_tensors.values()) == 4 * 7
    for name, t in got_tensors.items():
        e = expected_tensors[name]
        assert type(t) is type(e) and t.requires_grad == e.requires_grad, name
        assert getattr(t, "_is_param", False) == getattr(e, "_is_param", False), name
        if isinstance(t, NF4Tensor):
            assert _described(t) == _described(e), name
            names, _ = t.__tensor_flatten__()
            assert all(getattr(t, n) is not getattr(originals[name], n) for n in names), name
        else:
            assert _layout(t) == _layout(e), name
        assert t is not originals[name], name
    assert [type(m) for m in got.modules()] == [type(m) for m in expected.modules()]


def test_a_copied_meta_model_given_storage_leaves_the_original_on_meta():
    model = _qlora_mid_on_meta()
    copy_meta_model(model).to_empty(device="cpu")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "meta", name
        if isinstance(t, NF4Tensor):
            names, _ = t.__tensor_flatten__()
            assert all(getattr(t, n).device.type == "meta" for n in names), name


class _Tied(torch.nn.Module):
    """Two linears holding one NF4 weight, and a transposed (non-contiguous) one."""

    def __init__(self):
        super().__init__()
        weight = torch.nn.Parameter(to_nf4(torch.empty(128, 256, dtype=torch.bfloat16, device="meta")),
                                    requires_grad=False)
        self.a, self.b, self.c = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        self.a.weight = self.b.weight = weight
        self.c.weight = torch.nn.Parameter(
            to_nf4(torch.empty(128, 256, dtype=torch.bfloat16, device="meta")).t(), requires_grad=False)


def test_a_copied_meta_model_keeps_a_shared_weight_shared_and_a_transposed_one_as_deepcopy_makes_it():
    with nf4_on_meta_without_arithmetic():
        model = _Tied()
    expected, got = copy.deepcopy(model), copy_meta_model(model)
    assert expected.a.weight is expected.b.weight and got.a.weight is got.b.weight
    assert got.a.weight is not model.a.weight
    assert _described(got.a.weight) == _described(expected.a.weight)
    # clone makes a transposed weight contiguous; the copy follows deepcopy there.
    assert got.c.weight.stride() == expected.c.weight.stride() != model.c.weight.stride()

"""AdamW8bit: the C pass against the pure-torch reference, against bitsandbytes' AdamW8bit, and as
the offload engine's base optimizer against itself without offload."""

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tests import zygote
from tests.optim import float_range
from tests.optim.side_by_side import assert_same_params, batches, through_a_file, tiny_model, twin
from tests.optim.test_overlap import train_windows
from tests.recipe_harness import REPO, working_tree_env
from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.optim import adamw8bit, fused_step
from torchtune_offload.optim.host_memory import optimizer_state_bytes

bnb = pytest.importorskip("bitsandbytes")
needs_cc = pytest.mark.skipif(fused_step.c_compiler() is None, reason="no C compiler to build the fused pass")

# The tiny model's weights (2304 and 15360 elements) get 8-bit states, the rest fp32 states.
MIN_8BIT = 2000


def _grads(n: int, steps: int, *, dtype: torch.dtype, seed: int = 0):
    """Gradients with the spread of real ones: each element keeps its own scale (log-normal, so
    blocks hold values a few decades apart) from step to step, with fresh noise each step."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.randn(n, generator=gen).exp() * 1e-2
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(steps)]


def _code_disagreement(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.int() - b.int()).abs()
    return f"codes up to {int(diff.max())} apart on {float((diff > 0).float().mean()):.2%} of elements"


def test_maps_are_bitsandbytes():
    assert torch.equal(adamw8bit.dynamic_map(signed=True), bnb.functional.create_dynamic_map(signed=True))
    assert torch.equal(adamw8bit.dynamic_map(signed=False), bnb.functional.create_dynamic_map(signed=False))


@needs_cc
@pytest.mark.parametrize("param_dtype, grad_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("numel", [256 * 40, 256 * 40 + 77])  # whole blocks; a partial last block
def test_fused_pass_matches_the_reference(param_dtype, grad_dtype, numel):
    """Each step from the same state: parameters, absmax and codes bit for bit (the issue allows
    codes one apart on 0.1% of elements; the C pass settles every lane near a midpoint against the
    reference's own midpoints, so none differs)."""
    assert adamw8bit.fused_available()
    start = torch.randn(numel).to(param_dtype)
    fused, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    for p in (fused, ref):
        p.grad_dtype = None  # the engine's gradient sums may be in another dtype than the parameter
    opts = [AdamW8bit([fused], lr=1e-3, fused=True), AdamW8bit([ref], lr=1e-3, fused=False)]
    for g in _grads(numel, 4, dtype=grad_dtype):
        if opts[1].state:  # the fused side starts each step from the reference's state
            for key in ("state1", "state2", "absmax1", "absmax2"):
                opts[0].state[fused][key].copy_(opts[1].state[ref][key])
            fused.data.copy_(ref.data)
        for p, opt in zip((fused, ref), opts):
            p.grad = g.clone()
            opt.step()
        a, b = opts[0].state[fused], opts[1].state[ref]
        assert torch.equal(fused, ref)
        assert torch.equal(a["absmax1"], b["absmax1"]) and torch.equal(a["absmax2"], b["absmax2"])
        for key in ("state1", "state2"):
            assert torch.equal(a[key], b[key]), (key, _code_disagreement(a[key], b[key]))


def _every_build():
    """Every build of the pass this CPU runs (``float_range.builds``: the AVX-512 loop, also without
    AVX512_BF16's conversion, the portable loop with the AVX2 quantizer, and without either), its
    table-check builds left to the float-range test."""
    builds = [extra for name, extra in float_range.builds("adamw8bit")[0] if "table checks" not in name]
    if len(builds) < 2:
        pytest.skip("this CPU runs only the portable loop: nothing to compare it with")
    return [float_range.load("adamw8bit", extra) for extra in builds]


@needs_cc
def test_portable_c_matches_the_avx512_c():
    """The portable C loop (with and without the AVX2 quantizer) and the AVX-512 one give identical
    bytes, also on zero and denormal parameters (which AVX512_BF16's conversion would flush)."""
    libraries = _every_build()
    numel = 256 * 64 + 5
    results = []
    for lib in libraries:
        p = torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16()
        p[::97] = 0.0
        p[1::89] = torch.tensor(1e-39).bfloat16()  # denormal in bf16 too
        blocks = -(-numel // 256)
        state = {"state1": torch.zeros(numel, dtype=torch.uint8), "state2": torch.zeros(numel, dtype=torch.uint8),
                 "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks)}
        for step, g in enumerate(_grads(numel, 3, dtype=torch.bfloat16), start=1):
            g[::97], g[1::89] = 0.0, 0.0  # so that those parameters only decay: zero, denormal results
            constants = adamw8bit.step_constants({"betas": (0.9, 0.999), "lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8},
                                                 step)
            assert adamw8bit.fused_step_8bit(p, g, state, constants, library=lib)
        results.append((p, state))
    (p_vec, s_vec), *others = results
    assert p_vec[1::89].float().abs().max() < 1.2e-38 and p_vec[1::89].float().abs().min() > 0
    for p_other, s_other in others:
        assert torch.equal(p_vec.view(torch.int16), p_other.view(torch.int16))
        assert all(torch.equal(s_vec[k], s_other[k]) for k in s_vec)


@needs_cc
def test_ties_and_near_ties_get_the_references_codes():
    """First moments exactly at a midpoint between two codes (where ratios of bf16 gradients often
    fall), one and two float steps either side of one, at the codes, zero, tiny and denormal: the C loops
    give the reference's codes, bit for bit (a tie goes to the lower code), in every build."""
    q1, q2 = adamw8bit.quantization_maps()
    inf = torch.tensor(float("inf"))
    mids = torch.cat([adamw8bit._midpoints(q1), adamw8bit._midpoints(q2)])
    up, down = mids.nextafter(inf), mids.nextafter(-inf)
    values = torch.cat([mids, up, down, up.nextafter(inf), down.nextafter(-inf), q1, -q2, -mids,
                        torch.tensor([0.0, -0.0, 2.0**-31, -(2.0**-31), 2.0**-40, 1e-40, -1e-40])])
    # Blocks of 255 values and a 1: with betas 0 the first moment is the gradient, scaled by 1. The
    # last block is filled up with zeros.
    values = torch.cat([values, torch.zeros(-len(values) % 255)]).view(-1, 255)
    g = torch.cat([torch.ones(len(values), 1), values], dim=1).reshape(-1)
    s = adamw8bit.step_constants({"betas": (0.0, 0.0), "lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8}, 1)
    expected = {"state1": torch.zeros(g.numel(), dtype=torch.uint8), "state2": torch.zeros(g.numel(), dtype=torch.uint8),
                "absmax1": torch.zeros(len(values)), "absmax2": torch.zeros(len(values))}
    p_ref = torch.zeros_like(g)
    adamw8bit.reference_step_8bit(p_ref, g, expected, s)
    for lib in _every_build():
        state = {k: torch.zeros_like(t) for k, t in expected.items()}
        p = torch.zeros_like(g)
        assert adamw8bit.fused_step_8bit(p, g, state, s, library=lib)
        assert torch.equal(p, p_ref)
        for key in expected:
            assert torch.equal(state[key], expected[key]), key


@needs_cc
@pytest.mark.streams_as_is  # the passes run in child processes
def test_every_build_over_the_float_range():
    """tests/optim/float_range.py's cases (gradients from 0 through the subnormal range to 1e30, zero
    blocks, single infinities and NaNs, partial blocks, both dtypes, clipping, absmax exactly at
    2**-126 and 2**-128) in child processes, on every build this CPU runs and on debug builds that
    check every table index: the reference's bits (NaN in the same places), no crash."""
    failures = float_range.run_in_children("adamw8bit")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@needs_cc
@pytest.mark.streams_as_is  # the passes run in child processes
def test_the_avx512_loop_compiles_where_this_cpu_cannot_run_it():
    """Where the CPU lacks AVX-512 (so the float-range test cannot run that loop), it is at least
    compiled, with the instruction sets it needs, so that a change that breaks it fails here too."""
    _, not_here = float_range.builds("adamw8bit")
    if not any("AVX-512" in reason for reason in not_here):
        pytest.skip("this CPU runs the AVX-512 loop: test_every_build_over_the_float_range covers it")
    library = adamw8bit.bind_kernel(fused_step.build_library(
        adamw8bit.SOURCE, flags=("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vbmi", "-mavx512bf16")))
    assert "AVX-512" in adamw8bit.build_paths(library)  # returns a constant: no AVX-512 instruction runs


#: One step of a 48-layer stack of bf16 Linear(1024, 1024) layers on the mean of its output: some
#: blocks of its gradients are so small that their second moments' absmax is below 2**-128. Before the block
#: scale was raised to bitsandbytes' 1e-38 clamp, the AVX-512 loop indexed its table with the
#: infinite scale's garbage and the process died (exit status 139).
DEEP_STACK = """
import copy
import torch
from torchtune_offload import AdamW8bit
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(48)]).bfloat16()
ref = copy.deepcopy(model)
x = torch.randn(8, 1024).bfloat16()
states = []
for m, fused in ((model, None), (ref, False)):
    m(x).float().mean().backward()
    opt = AdamW8bit(m.parameters(), fused=fused)
    opt.step()
    states.append(list(opt.state.values()))
smallest = min(float(st["absmax2"].min()) for st in states[1] if "absmax2" in st)
assert 0 < smallest < 2.0**-128, smallest  # blocks whose 1 / absmax overflows float32
assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
assert all(torch.equal(a[k], b[k]) for a, b in zip(*states) for k in a if k != "step")
n = 4096 * 1024
for scale in (1e-20, 1e-40, 1e30):
    start, g = torch.randn(n).bfloat16(), (torch.randn(n) * scale).bfloat16()
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    opts = [AdamW8bit([p], fused=f) for p, f in zip(params, (None, False))]
    for p, opt in zip(params, opts):
        p.grad = g.clone()
        opt.step()
    assert torch.equal(params[0], params[1]), scale
    for key in ("state1", "state2", "absmax1", "absmax2"):
        a, b = opts[0].state[params[0]][key], opts[1].state[params[1]][key]
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), key
print("stepped")
"""


@needs_cc
@pytest.mark.streams_as_is  # the passes run in child processes
def test_the_deep_stack_and_tiny_gradients_step_as_the_reference():
    """The reproductions of the crash (a 48-layer bf16 stack; one 4096 x 1024 parameter with
    gradients of randn times 1e-20, 1e-40 and 1e30) step in a child process with the reference's bits."""
    done = zygote.run([sys.executable, "-c", DEEP_STACK], cwd=REPO, env=working_tree_env(), capture_output=True,
                      text=True, timeout=300)
    assert done.returncode == 0 and "stepped" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_tiny_blocks_are_scaled_as_bitsandbytes_clamps_them():
    """A block whose absmax is below 1e-38 keeps its true absmax but is scaled by 1e38 (its
    reciprocal would overflow below about 2**-128 and code every element at the end of the map):
    at 2**-126 the largest element still codes as 1, at 2**-128 as the code nearest 2**-128 * 1e38
    (about 0.029); zeros stay zero, NaN codes 255, and every value dequantizes no larger than it was."""
    q1, q2 = adamw8bit.quantization_maps()
    for largest, code_of_largest in ((2.0**-126, 1.0), (2.0**-128, 2.0**-128 * 1e38), (1e-45, 1e-45 * 1e38)):
        values = torch.zeros(2, 256)
        values[:, 1:] = torch.rand(2, 255, generator=torch.Generator().manual_seed(0)) * largest
        values[:, 0] = largest
        values[1] = -values[1]
        values[:, 2] = 0.0
        for code, block in ((q1, values), (q2, values.abs()[:1])):
            codes, absmax = adamw8bit.quantize(block, code)
            assert torch.equal(absmax, block.abs().amax(dim=1))
            nearest = (code - code_of_largest).abs().argmin()
            assert int(codes[0, 0]) == int(nearest), (largest, int(codes[0, 0]), int(nearest))
            assert float(code[codes[0, 2].long()]) == 0.0
            back = adamw8bit.dequantize(codes, absmax, code)
            assert (back.abs() <= block.abs() * 1.0001 + 1e-45).all() or largest == 2.0**-126
    nan_block = torch.zeros(1, 256)
    nan_block[0, 5] = float("nan")
    codes, absmax = adamw8bit.quantize(nan_block, q1)
    assert absmax.isnan().all() and (codes == adamw8bit.NAN_CODE).all()


def _train_three(steps: int, dtype: torch.dtype, *, grads=None):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(64, 512, generator=gen).to(dtype)
    ps = [torch.nn.Parameter(start.clone()) for _ in range(3)]
    opts = [AdamW8bit([ps[0]], lr=1e-3), bnb.optim.AdamW8bit([ps[1]], lr=1e-3),
            torch.optim.AdamW([ps[2]], lr=1e-3)]
    for g in grads or _grads(start.numel(), steps, dtype=dtype, seed=1):
        for p, opt in zip(ps, opts):
            p.grad = g.view_as(p).clone()
            opt.step()
    return ps, opts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closer_to_bitsandbytes_than_bitsandbytes_is_to_fp32_adamw(dtype):
    """Gaussian gradients. (With per-element scales decades apart within a block, bitsandbytes' CPU
    backend rounds small second moments up to a code near 1.5e-5 of the block's absmax, through its
    65536-bin lookup table, where nearest rounding, ours and its CUDA kernel's, gives 0: there the
    two part more.)"""
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(64 * 512, generator=gen) * 1e-2).to(dtype) for _ in range(10)]
    (ours, theirs, fp32), _ = _train_three(10, dtype, grads=grads)
    to_bnb = (ours - theirs).detach().float().norm()
    bnb_to_fp32 = (theirs - fp32).detach().float().norm()
    assert to_bnb < 0.5 * bnb_to_fp32, (float(to_bnb), float(bnb_to_fp32))


def test_state_dict_loads_into_bitsandbytes_and_back():
    (ours, _, _), (opt, _, _) = _train_three(3, torch.float32)
    theirs = torch.nn.Parameter(ours.detach().clone())
    bnb_opt = bnb.optim.AdamW8bit([theirs], lr=5e-4)
    bnb_opt.load_state_dict(opt.state_dict())
    state = bnb_opt.state[theirs]
    assert state["step"] == 3 and state["qmap1"].dtype == torch.float32
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(state[key], opt.state[ours][key])
    assert bnb_opt.param_groups[0]["lr"] == 1e-3
    # bitsandbytes steps on from our state as it would from its own.
    g = _grads(ours.numel(), 1, dtype=torch.float32, seed=5)[0].view_as(ours)
    before = theirs.detach().clone()
    theirs.grad = g
    bnb_opt.step()
    ours.grad = g.clone()
    opt.step()
    torch.testing.assert_close(theirs - before, ours - before, rtol=0.05, atol=1e-6)
    # ... and back: bitsandbytes' (FSDP-wrapped) state dict into a fresh AdamW8bit.
    again = torch.nn.Parameter(theirs.detach().clone())
    ours_again = AdamW8bit([again], lr=1.0)
    ours_again.load_state_dict(bnb_opt.state_dict())
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(ours_again.state[again][key], bnb_opt.state[theirs][key])
    assert ours_again.state[again]["step"] == 4 and ours_again.param_groups[0]["lr"] == 1e-3


def test_bitsandbytes_state_dict_with_fp32_states_loads_without_a_cast():
    p = torch.nn.Parameter(torch.randn(100).bfloat16())  # below min_8bit_size: fp32 states
    theirs = bnb.optim.AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn(100).bfloat16()
    theirs.step()
    ours = AdamW8bit([p], lr=1e-3)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state[p]["state1"].dtype == torch.float32
    assert torch.equal(ours.state[p]["state2"], theirs.state[p]["state2"])


def test_state_dict_of_another_bitsandbytes_optimizer_is_refused():
    p = torch.nn.Parameter(torch.randn(100))
    sd = AdamW8bit([p]).state_dict()
    sd["param_groups"][0]["alpha"] = 5.0
    with pytest.raises(ValueError, match="alpha"):
        AdamW8bit([p]).load_state_dict(sd)


@pytest.mark.parametrize("kwargs, key", [
    ({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"), ({"is_paged": True}, "is_paged"),
    ({"lr": -1.0}, "lr"), ({"lr": "fast"}, "lr"), ({"lr": torch.tensor([1e-3, 1e-4])}, "lr"),
    ({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"betas": (0.9, 1.0)}, "betas"), ({"betas": 0.9}, "betas"), ({"min_8bit_size": -1}, "min_8bit_size"),
    ({"fused": "yes"}, "fused"),
])
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"optimizer.{key}"):
        AdamW8bit([torch.nn.Parameter(torch.randn(4))], **kwargs)


def test_bad_dtype_is_refused_before_any_state():
    with pytest.raises(ValueError, match="params: AdamW8bit steps bf16 and fp32"):
        AdamW8bit([torch.nn.Parameter(torch.randn(4).half())])


def test_fsdp2_sharded_parameters_are_refused_before_any_state():
    # Its C pass would read a DTensor's pointer as a plain tensor's (it crashed the process).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(64, 64))
        with pytest.raises(ValueError, match="params: an FSDP2-sharded parameter.*torch.optim.AdamW"):
            AdamW8bit(model.parameters())
    finally:
        dist.destroy_process_group()


def test_without_a_compiler_it_warns_and_steps_with_the_reference(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C compiler found (set CC, or put cc, gcc or clang on PATH)")

    monkeypatch.setattr(fused_step, "build_library", no_compiler)
    adamw8bit._library.cache_clear()
    try:
        start = torch.randn(256 * 20).bfloat16()
        p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        opts = [AdamW8bit([p], lr=1e-3, min_8bit_size=0), AdamW8bit([ref], lr=1e-3, min_8bit_size=0, fused=False)]
        with pytest.warns(UserWarning, match="could not be built .*no C compiler found.*pure-torch reference"):
            for g in _grads(start.numel(), 3, dtype=torch.bfloat16):
                for param, opt in zip((p, ref), opts):
                    param.grad = g.clone()
                    opt.step()
        assert not adamw8bit.fused_available()
        assert torch.equal(p, ref) and not torch.equal(p, start)
        assert all(torch.equal(opts[0].state[p][k], opts[1].state[ref][k]) for k in ("state1", "state2", "absmax1"))
    finally:
        adamw8bit._library.cache_clear()  # the next test builds the pass again


def test_lr_as_a_tensor():
    a, b = (torch.nn.Parameter(torch.ones(5000)) for _ in range(2))
    opts = [AdamW8bit([a], lr=1e-2), AdamW8bit([b], lr=torch.tensor(1e-2))]
    for p, opt in zip((a, b), opts):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    assert torch.equal(a, b)


def test_state_is_sized_exactly_on_meta_tensors():
    """The host pre-flight steps the optimizer on meta tensors and counts the state it makes."""
    shapes = [torch.empty(4096, 1000, device="meta"), torch.empty(1000, device="meta")]
    nbytes, notes = optimizer_state_bytes(AdamW8bit, shapes, {"lr": 1e-5})
    blocks = -(-4096 * 1000 // 256)
    assert nbytes == 2 * 4096 * 1000 + 2 * 4 * blocks + 2 * 4 * 1000
    assert notes == ()


# ---------------------------------------------------------------------------------- the engine


def _engine(model, **kwargs):
    return OffloadOptimizer(model.named_parameters(), "torchtune_offload.AdamW8bit", minimal_size=1000,
                            lr=1e-2, weight_decay=0.1, min_8bit_size=MIN_8BIT, **kwargs)


#: The engine's gradient path: (offload_gradients, grad_sum_on); the device sums only offloaded gradients.
GRADIENT_PATHS = {"on the device": (False, "host"), "host sums": (True, "host"), "device-added sums": (True, "device")}


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(GRADIENT_PATHS))
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_matches_adamw8bit_alone(dtype, path, grad_accum, clip, overlap):
    """bf16 with device-added sums, accumulation, clipping and overlap is the shipped 8B 8-bit config."""
    offload_gradients, grad_sum_on = GRADIENT_PATHS[path]
    ref = tiny_model().to(dtype)
    model = twin(ref)
    ref_opt = AdamW8bit(ref.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=MIN_8BIT)
    opt = _engine(model, offload_gradients=offload_gradients, overlap=overlap, grad_sum_on=grad_sum_on)
    if overlap:
        opt.register_forward_waits(model)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=4 * grad_accum)]
    ref_norms = train_windows(ref, ref_opt, data, grad_accum=grad_accum, clip=clip)
    norms = train_windows(model, opt, data, grad_accum=grad_accum, clip=clip)
    # With overlap the last window's host steps may still run: the weights are read after them.
    opt.synchronize()
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    if clip is None:
        assert_same_params(ref, model, rtol=0, atol=0)
    else:  # norms summed in another order may differ in the last bit, and so the clip coefficient
        assert_same_params(ref, model, rtol=1e-5, atol=1e-6)
    eight_bit = [s for s in opt._slots if s.offloaded and s.optimizer.state[s.step_param]["state1"].dtype == torch.uint8]
    assert len(eight_bit) == 2
    opt.close()


@needs_cc
@pytest.mark.parametrize("dtype, options", [
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.bfloat16, {"grad_sum_dtype": "fp32"}),
    (torch.bfloat16, {"master_dtype": "fp32"}),
    (torch.bfloat16, {"grad_sum_dtype": "fp32", "master_dtype": "fp32", "overlap": True}),
    (torch.bfloat16, {"grad_sum_on": "device", "overlap": True}),
], ids=["fp32", "bf16", "bf16, fp32 sums", "bf16, fp32 masters", "bf16, fp32 sums and masters, overlap",
        "bf16, device-added sums, overlap"])
@pytest.mark.parametrize("grad_accum", [1, 3])
def test_engine_checkpoint_resumes_bit_identically(dtype, options, grad_accum):
    """Saved through a file mid-run and resumed into a fresh engine: the straight run's bits."""
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=4 * grad_accum)]
    half = 2 * grad_accum

    def make(model):
        opt = _engine(model, offload_gradients=True, **options)
        opt.register_forward_waits(model)
        return opt

    ref = tiny_model().to(dtype)
    model = twin(ref)
    ref_opt, opt = make(ref), make(model)
    train_windows(ref, ref_opt, data, grad_accum=grad_accum, clip=0.5)
    train_windows(model, opt, data[:half], grad_accum=grad_accum, clip=0.5)
    saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed_model = tiny_model(seed=123).to(dtype)
    resumed_model.load_state_dict(saved["model"])
    resumed = make(resumed_model)
    resumed.load_state_dict(saved["opt"])
    train_windows(resumed_model, resumed, data[half:], grad_accum=grad_accum, clip=0.5)
    for o in (ref_opt, opt, resumed):
        o.close()
    assert_same_params(ref, resumed_model, rtol=0, atol=0)
    assert not torch.equal(ref[0].weight, model[0].weight), "the second half must have trained"


def test_memory_report_is_six_bytes_per_bf16_parameter_plus_absmax():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False)).bfloat16()
    opt = OffloadOptimizer(model.named_parameters(), "torchtune_offload.AdamW8bit", offload_gradients=True,
                           minimal_size=0, lr=1e-3)
    model(torch.randn(4, 256).bfloat16()).float().pow(2).sum().backward()
    opt.step()
    report = opt.memory_report()
    numel = sum(p.numel() for p in model.parameters())
    blocks = sum(-(-p.numel() // 256) for p in model.parameters())
    # copy 2 + gradient sum 2 + two 1-byte states, and two fp32 absmax per 256 elements
    assert report.host_bytes == 6 * numel + 8 * blocks
    assert report.device_bytes_saved == 2 * numel + 2 * numel + 8 * blocks  # states and gradients
    opt.close()

"""Host memory planned from shapes alone against what the optimizers really allocate."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.recipe_harness import working_tree_env
from tests.torchao_on_cpu import torchao_on_cpu
from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.optim.host_arena import pinned_allocation_bytes
from torchtune_offload.optim.host_memory import optimizer_state_bytes, plan_host_memory
from torchtune_offload.optim.host_memory import CONVERSION_BUFFERS, CPU_DEVICE_RING
from torchtune_offload.optim.staging import CHUNK_BYTES, NUM_CHUNKS, host_ring_chunks


def _model(device="cpu", dtype=torch.float32, width=64, depth=3):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device=device, dtype=dtype)


def _meta_twin(model):
    return _model_like(model).to("meta")


def _model_like(model):
    return type(model)(*[nn.Linear(m.in_features, m.out_features) for m in model]).to(next(model.parameters()).dtype)


def _train_once(model, opt, accum=1):
    for _ in range(accum):
        model(torch.randn(4, model[0].in_features, dtype=next(model.parameters()).dtype)).square().sum().backward()
    opt.step()


def test_pinned_allocations_round_up_to_a_power_of_two():
    mlp_8b = 14336 * 4096 * 2  # one 8B MLP weight in bf16: 112 MiB
    assert pinned_allocation_bytes(mlp_8b) == 128 * 2**20
    embedding_8b = 128256 * 4096 * 2  # the 8B token embedding in bf16: 1.05 GB, just under 1 GiB
    assert pinned_allocation_bytes(embedding_8b) == 2**30
    assert pinned_allocation_bytes(4096) == 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload_gradients, accum, sum_on", [(False, 1, "host"), (True, 1, "host"), (True, 3, "host"),
                                                              (True, 3, "device")])
def test_offload_plan_equals_what_the_engine_holds_on_cpu(dtype, offload_gradients, accum, sum_on):
    model = _model(dtype=dtype)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=offload_gradients,
                           minimal_size=1000, lr=1e-3, grad_sum_on=sum_on)
    _train_once(model, opt, accum=accum)
    plan = OffloadOptimizer.plan_host_memory(
        _meta_twin(model).named_parameters(), "torch.optim.AdamW", device="cpu",
        gradient_accumulation_steps=accum, offload_gradients=offload_gradients, minimal_size=1000, lr=1e-3,
        grad_sum_on=sum_on)
    report = opt.memory_report()
    if sum_on == "device" and accum > 1:
        # The device ring's chunks are the report's device staging; on this CPU-only machine the
        # device is the host, so the host plan counts them (all of them, the most the ring takes).
        assert report.device_staging_bytes == opt._staging.nbytes == NUM_CHUNKS * min(CHUNK_BYTES,
                                                                                      64 * 64 * dtype.itemsize)
        assert plan.parts.pop(CPU_DEVICE_RING) == opt._staging.nbytes
    elif accum > 1:
        # The ring allocates its chunks on first use; the plan counts all of them, the most it takes.
        chunk = min(CHUNK_BYTES, 64 * 64 * dtype.itemsize)
        assert plan.parts.pop("staging ring") == host_ring_chunks(chunk) * chunk == opt._staging.num_chunks * chunk
        report.host_bytes -= opt._staging.nbytes
    assert plan.total == report.host_bytes
    assert set(plan.parts) == {"parameter copies", "gradient buffers", "optimizer state"}


def test_the_device_ring_of_fp32_sums_without_an_accelerator_is_planned_as_host_memory():
    # fp32 sums of bf16 weights: the chunks are sized by the sums (4 bytes an element), not the weights.
    model = _model(dtype=torch.bfloat16)
    options = dict(offload_gradients=True, minimal_size=1000, lr=1e-3, grad_sum_on="device", grad_sum_dtype="fp32")
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", **options)
    _train_once(model, opt, accum=3)
    plan = OffloadOptimizer.plan_host_memory(_meta_twin(model).named_parameters(), "torch.optim.AdamW", device="cpu",
                                             gradient_accumulation_steps=3, **options)
    assert plan.parts[CPU_DEVICE_RING] == opt._staging.nbytes == NUM_CHUNKS * 64 * 64 * 4
    assert "staging ring" not in plan.parts


@pytest.mark.parametrize("optimizer_class, options, element_size", [
    ("torch.optim.AdamW", dict(grad_sum_dtype="fp32"), 2),
    ("torch.optim.AdamW", dict(grad_sum_dtype="fp32", master_dtype="fp32"), 0),
    ("torch.optim.AdamW", dict(master_dtype="fp32"), 0),
    ("torch.optim.AdamW", dict(master_dtype="fp32", fused_master_step=False), 4),
    ("torchtune_offload.AdamW8bit", dict(master_dtype="fp32"), 4),
], ids=["fp32 sums", "fp32 sums and masters", "masters, fused pass", "masters, unfused", "masters, AdamW8bit"])
def test_the_buffer_gradients_are_converted_into_is_planned(optimizer_class, options, element_size):
    # Host gradients of another dtype than their stepped copy are converted into one buffer as large
    # as the largest (slot_step.conversion_buffers): fp32 sums of bf16 weights without masters, bf16
    # gradients of fp32 masters that the fused pass does not step; the fused pass reads them as they are.
    model = _model(dtype=torch.bfloat16, width=96)
    options = dict(offload_gradients=True, minimal_size=1000, lr=1e-3, **options)
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, **options)
    _train_once(model, opt)
    plan = OffloadOptimizer.plan_host_memory(_meta_twin(model).named_parameters(), optimizer_class, device="cpu",
                                             gradient_accumulation_steps=1, **options)
    assert plan.total == opt.memory_report().host_bytes
    assert plan.parts.get(CONVERSION_BUFFERS, 0) == opt._stepper.conversion_bytes == 96 * 96 * element_size
    opt.close()


def test_a_groups_own_options_decide_whether_its_gradients_are_converted():
    # amsgrad in one group only: the fused pass does not step that group's masters, so their bf16
    # gradients are widened into the buffer; the other group's are read as they are.
    def groups(model):
        named = list(model.named_parameters())
        return [{"params": named[:2]}, {"params": named[2:], "amsgrad": True}]

    model = _model(dtype=torch.bfloat16, width=96)
    options = dict(offload_gradients=True, minimal_size=1000, lr=1e-3, master_dtype="fp32")
    opt = OffloadOptimizer(groups(model), "torch.optim.AdamW", **options)
    _train_once(model, opt)
    plan = OffloadOptimizer.plan_host_memory(groups(_meta_twin(model)), "torch.optim.AdamW", device="cpu",
                                             gradient_accumulation_steps=1, **options)
    assert plan.parts[CONVERSION_BUFFERS] == opt._stepper.conversion_bytes == 96 * 96 * 4
    assert plan.total == opt.memory_report().host_bytes
    opt.close()


def test_state_size_is_measured_not_assumed():
    params = [torch.empty(100, 10, device="meta"), torch.empty(7, device="meta")]
    adamw, notes = optimizer_state_bytes(torch.optim.AdamW, params, {"lr": 1.0, "fused": True})
    assert adamw == 2 * (1000 + 7) * 4 + 2 * 4 and not notes  # two moments and a step per parameter
    sgd, _ = optimizer_state_bytes(torch.optim.SGD, params, {"lr": 1.0, "momentum": 0.9})
    assert sgd == (1000 + 7) * 4
    plain, _ = optimizer_state_bytes(torch.optim.SGD, params, {"lr": 1.0})
    assert plain == 0


def test_an_optimizer_that_cannot_run_on_meta_is_assumed_adam_sized_and_says_so():
    class NeedsData(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("needs real data")

    size, notes = optimizer_state_bytes(NeedsData, [torch.empty(10, device="meta")], {"lr": 1.0})
    assert size == 80 and "NeedsData" in notes[0]


def test_plain_optimizers_hold_host_state_only_on_a_cpu_device():
    params = [torch.empty(10, 10, device="meta")]
    on_cpu = plan_host_memory(torch.optim.AdamW, params, device=torch.device("cpu"),
                              gradient_accumulation_steps=1, options={"lr": 1.0})
    on_gpu = plan_host_memory(torch.optim.AdamW, params, device=torch.device("cuda"),
                              gradient_accumulation_steps=1, options={"lr": 1.0})
    assert on_cpu.total == 2 * 400 + 4 and on_gpu.total == 0


def test_accelerator_plans_count_exact_pinned_bytes_ours_and_rounded_bytes_torchaos():
    params = [("w", nn.Parameter(torch.empty(1000, 3, device="meta")))]  # 12000 bytes
    ours = OffloadOptimizer.plan_host_memory(params, device="cuda", minimal_size=1, lr=1.0)
    # One page-locked block, each buffer at a page boundary: 12000 bytes take three 4 KiB pages.
    assert ours.parts["parameter copies (pinned)"] == ours.parts["gradient buffers (pinned)"] == 12288
    # torchao pins each buffer with torch's allocator, which rounds to a power of two; so do we on
    # accelerators where torch cannot lock memory in place.
    theirs = CPUOffloadOptimizer.plan_host_memory([p for _, p in params], device="cuda", minimal_size=1, lr=1.0)
    assert theirs.parts["parameter copies (pinned)"] == theirs.parts["gradient buffers (pinned)"] == 16384
    on_xpu = OffloadOptimizer.plan_host_memory(params, device="xpu", minimal_size=1, lr=1.0)
    assert on_xpu.parts == theirs.parts


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_torchaos_memory_report_is_its_plan_on_an_accelerator(monkeypatch, offload_gradients):
    """On a GPU torchao's buffers are pinned by torch's allocator, a power of two each: the report
    (logged as optimizer_pinned/optimizer_host) counts what the plan counts, not the tensors' sizes."""
    torchao_on_cpu(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: True)  # as torchao's buffers are there
    model = nn.Sequential(nn.Linear(24, 96), nn.Linear(96, 160), nn.Linear(160, 8))  # 2304 elements: not a power of 2
    opt = CPUOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=offload_gradients,
                              minimal_size=1000, lr=1e-2)
    model(torch.randn(4, 24)).sum().backward()
    opt.step()
    plan = CPUOffloadOptimizer.plan_host_memory(list(model.parameters()), "torch.optim.AdamW", device="cuda",
                                                offload_gradients=offload_gradients, minimal_size=1000, lr=1e-2)
    report = opt.memory_report()
    assert report.pinned_bytes == sum(v for k, v in plan.parts.items() if k.endswith("(pinned)"))
    assert report.host_bytes == plan.total
    assert report.pinned_bytes > sum(2 * p.numel() * 4 for p in model.parameters() if p.numel() >= 1000)


def test_pinned_bytes_for_llama_8b_are_within_two_percent_of_its_tensors():
    from torchtune.models.llama3_1 import llama3_1_8b

    with torch.device("meta"):
        model = llama3_1_8b().to(torch.bfloat16)
    tensors = sum(p.numel() * p.element_size() for p in model.parameters())
    for master_dtype, factor in ((None, 2), ("fp32", 4)):  # grads bf16 + copies (bf16 or fp32 masters)
        plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda", minimal_size=0,
                                                 master_dtype=master_dtype, lr=1.0)
        pinned = sum(v for k, v in plan.parts.items() if k.endswith("(pinned)"))
        buffers = tensors + tensors * factor // 2
        assert buffers <= pinned <= 1.02 * buffers
        rounded = CPUOffloadOptimizer.plan_host_memory(list(model.parameters()), device="cuda", minimal_size=0,
                                                       lr=1.0)
    assert sum(v for k, v in rounded.parts.items() if k.endswith("(pinned)")) > 1.08 * 2 * tensors


_RSS_PROBE = """
import gc, json, sys, psutil, torch
from torch import nn
from torchtune_offload import OffloadOptimizer
model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(24)])  # 100.7M params, fp32
accum = int(sys.argv[1])
offload_gradients = accum > 1
if not offload_gradients:  # the model's own gradients exist before and after, as in training
    model(torch.randn(2, 2048)).sum().backward()
gc.collect()
process = psutil.Process()
before = process.memory_info().rss
opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-3, offload_gradients=offload_gradients)
for _ in range(2):
    opt.zero_grad()
    for _ in range(accum):
        model(torch.randn(2, 2048)).sum().backward()
    opt.step()
print(json.dumps({"grown": process.memory_info().rss - before, "report": opt.memory_report().host_bytes,
                  "staging": opt._staging.nbytes}))
"""


# Without optim/host_allocator.py's fixed mmap threshold, the growth was 4-11% above the report
# here: glibc kept freed gradients in its heap between the optimizer's long-lived buffers.
@pytest.mark.parametrize("accum", [1, 3])
def test_rss_growth_of_a_100m_parameter_model_matches_the_report(accum):
    # A fresh process: memory other tests freed would otherwise blur the growth.
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(accum)], capture_output=True, text=True,
                         timeout=300, env=working_tree_env())
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    params = 24 * 2048 * 2048
    # Copy, gradient buffer and two moments (fp32), a step counter per parameter, and the ring.
    assert figures["report"] == 16 * params + 4 * 24 + figures["staging"]
    assert figures["staging"] <= NUM_CHUNKS * CHUNK_BYTES
    assert figures["grown"] == pytest.approx(figures["report"], rel=0.05)


def test_paged_optimizers_are_sized_without_probing():
    bnb = pytest.importorskip("bitsandbytes")
    params = [torch.empty(1000, device="meta")]
    size, notes = optimizer_state_bytes(bnb.optim.PagedAdamW8bit, params, {"lr": 1.0})
    assert size == 2000 and "not probed" in notes[0]
    size, _ = optimizer_state_bytes(bnb.optim.PagedAdamW, params, {"lr": 1.0})
    assert size == 8000


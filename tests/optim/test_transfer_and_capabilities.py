"""Unit tests of the engine's host/device copies (CPU path) and of the optimizer capability lookup."""

import dataclasses

import bitsandbytes.optim
import pytest
import torch

from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.optim import OptimizerCapabilities, capabilities_of
from torchtune_offload.optim.capabilities import PLAIN_CAPABILITIES
from torchtune_offload.optim.param_table import ParameterTable
from torchtune_offload.optim.stream_order import InOrderStream
from torchtune_offload.optim.transfer import TransferEngine


@pytest.mark.streams_as_is  # the CPU path without the checker: stand-in streams, copies synchronous
def test_cpu_transfer_copies_synchronously_into_separate_unpinned_buffers():
    engine = TransferEngine(torch.device("cpu"))
    assert not engine.is_accelerator and isinstance(engine.stream, InOrderStream) and engine.order.in_order
    src = torch.randn(3, 5)
    host = engine.host_empty_like(src)
    assert host.shape == src.shape and host.dtype == src.dtype and not host.is_pinned()
    assert host.data_ptr() != src.data_ptr()
    event = engine.to_host(host, src, release_source=True)
    # Complete on return: the host reads it before any wait.
    torch.testing.assert_close(host, src, rtol=0, atol=0)
    assert event.query()
    engine.wait(event)
    assert engine.copy_seconds()["grad"] >= 0
    dst = torch.zeros_like(src)
    engine.to_device_many([dst], [host * 2])
    engine.compute_waits_for_copies()
    torch.testing.assert_close(dst, src * 2, rtol=0, atol=0)


@pytest.mark.streams_as_is  # the CPU path without streams, copies synchronous
def test_to_device_casts_like_copy():
    engine = TransferEngine(torch.device("cpu"))
    master = torch.randn(4, dtype=torch.float32)
    dst = torch.empty(4, dtype=torch.bfloat16)
    engine.to_device_many([dst], [master])
    torch.testing.assert_close(dst, master.to(torch.bfloat16), rtol=0, atol=0)


def test_plain_torch_optimizers_get_the_defaults():
    for cls in (torch.optim.AdamW, torch.optim.SGD, torch.optim.Adam, torch.optim.LBFGS):
        caps = capabilities_of(cls)
        # Only elementwise_update and steps_tensors_apart differ (torch's classes cannot declare them; tables do).
        assert dataclasses.replace(caps, elementwise_update=False, steps_tensors_apart=False) == PLAIN_CAPABILITIES
        assert caps.elementwise_update == (cls is not torch.optim.LBFGS)
        assert caps.steps_tensors_apart == (cls in (torch.optim.Adam, torch.optim.AdamW))
        assert caps.can_clip and caps.runs_under_fsdp2 and caps.steps_in_backward
        assert not caps.offloads and caps.device_types is None


def test_bitsandbytes_comes_from_the_table():
    caps = capabilities_of(bitsandbytes.optim.PagedAdamW)
    assert not caps.runs_under_fsdp2 and "DTensor" in caps.why_not("runs_under_fsdp2")
    assert caps.can_clip and caps.steps_in_backward and not caps.offloads


def test_offload_optimizers_declare_their_own():
    ours = capabilities_of(OffloadOptimizer)
    assert ours is OffloadOptimizer.capabilities
    assert ours.offloads and ours.can_clip and ours.accumulates_offloaded_grads
    assert not ours.runs_under_fsdp2 and not ours.steps_in_backward and ours.device_types is None
    ao = capabilities_of(CPUOffloadOptimizer)
    assert ao.offloads and not ao.can_clip and not ao.accumulates_offloaded_grads
    assert ao.device_types == ("cuda", "xpu")
    for caps in (ours, ao):
        lacking = [f for f in ("can_clip", "accumulates_offloaded_grads", "runs_under_fsdp2", "steps_in_backward")
                   if not getattr(caps, f)]
        assert all(f in caps.reasons for f in lacking), "every missing capability says why"


def test_a_subclass_inherits_and_may_override_the_declaration():
    class Inherits(OffloadOptimizer):
        pass

    class Declares(torch.optim.SGD):
        capabilities = OptimizerCapabilities(can_clip=False, reasons={"can_clip": "because"})

    assert capabilities_of(Inherits) is OffloadOptimizer.capabilities
    assert not capabilities_of(Declares).can_clip and capabilities_of(Declares).why_not("can_clip") == "because"
    assert "does not declare" in capabilities_of(Declares).why_not("runs_under_fsdp2")


def test_capabilities_are_frozen():
    with pytest.raises(AttributeError):
        PLAIN_CAPABILITIES.can_clip = False


@pytest.mark.parametrize("base, options, accelerator, fused", [
    (torch.optim.AdamW, {}, True, True),
    (torch.optim.Adam, {}, True, True),
    (torch.optim.AdamW, {"fused": False}, True, False),  # the user's choice is kept
    (torch.optim.AdamW, {}, False, None),  # CPU-only: torch's default, as plain AdamW on the CPU
    (torch.optim.SGD, {"lr": 0.1}, True, None),
])
def test_on_an_accelerator_the_host_adamw_is_torchs_fused_kernel(base, options, accelerator, fused):
    """The host step runs torch's fused CPU AdamW where the model is on an accelerator (several
    times the per-tensor loop's speed, docs/precision.md); it cannot be tried without one."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    groups = [{"params": list(model.named_parameters())}]
    table = ParameterTable(groups, base_class=base, options=options, accelerator=accelerator, minimal_size=0,
                           master_dtype=None, grad_sum_dtype=None, pinning="none")
    assert table.slots and all(s.offloaded for s in table.slots)
    for slot in table.slots:
        assert slot.optimizer.param_groups[0].get("fused") == fused


@pytest.mark.parametrize("accelerator", [False, True])
def test_host_copies_of_an_accelerators_tensors_are_pinned(monkeypatch, accelerator):
    """Staging chunks and FP8 scales on the host: pinned where a device copies them asynchronously
    (unpinned memory would make every such copy synchronous, silently)."""
    transfer = TransferEngine(torch.device("cpu"))
    transfer.is_accelerator = accelerator
    made = []
    original = torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda *a, pin_memory=False, **k: made.append(pin_memory) or original(*a, **k))
    transfer.host_empty_like(torch.ones(4))
    assert made == [accelerator]

"""Host buffers carved out of one block and page-locked in place, against what the engine reports."""

import gc

import torch
from torch import nn

import torchtune_offload.optim.host_arena as host_arena
import torchtune_offload.optim.offload_optimizer as offload_optimizer
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim.host_arena import ALIGNMENT, IN_PLACE, host_buffers

SPECS = [((1000, 3), torch.bfloat16), ((7,), torch.float32), ((64, 64), torch.float32), ((0,), torch.float32),
         ((5, 5), torch.bfloat16)]


def test_buffers_share_one_block_at_page_aligned_offsets_without_overlap():
    buffers = host_buffers(SPECS, device=torch.device("cpu"))
    assert [(tuple(b.shape), b.dtype) for b in buffers] == [(s, d) for s, d in SPECS]
    assert all(b.is_contiguous() for b in buffers)
    storage = buffers[0].untyped_storage()
    assert all(b.untyped_storage().data_ptr() == storage.data_ptr() for b in buffers)
    sizes = [b.numel() * b.element_size() for b in buffers]
    assert storage.nbytes() == sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes)
    placed = [b for b in buffers if b.numel()]  # an empty tensor has no address of its own
    starts = [b.data_ptr() - storage.data_ptr() for b in placed]
    assert all(start % ALIGNMENT == 0 for start in starts)
    ends = [start + b.numel() * b.element_size() for start, b in zip(starts, placed)]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:]))
    for i, b in enumerate(buffers):  # each writable without touching the others
        b.fill_(i + 1)
    assert all(bool((b == i + 1).all()) for i, b in enumerate(buffers))


def _record_page_locks(monkeypatch):
    calls = []
    monkeypatch.setattr(host_arena.pin_memory_utils, "pin_memory", lambda ptr, size: calls.append(("lock", ptr, size)))
    monkeypatch.setattr(host_arena.pin_memory_utils, "unpin_memory", lambda ptr: calls.append(("unlock", ptr)))
    return calls


def test_on_cuda_the_block_is_locked_once_at_its_exact_size_and_unlocked_with_its_last_buffer(monkeypatch):
    calls = _record_page_locks(monkeypatch)
    buffers = host_buffers(SPECS, device=torch.device("cuda"))  # no CUDA needed: locking is recorded
    storage = buffers[0].untyped_storage()
    ptr, size = storage.data_ptr(), storage.nbytes()
    assert calls == [("lock", ptr, size)]
    del storage
    first = buffers.pop(0)
    del buffers
    gc.collect()
    assert calls == [("lock", ptr, size)]  # a buffer is still alive
    del first
    gc.collect()
    assert calls == [("lock", ptr, size), ("unlock", ptr)]


def test_engine_holds_exactly_what_it_plans_with_in_place_pinning(monkeypatch):
    # The engine on the CPU, its buffers made as on CUDA: one locked block, pinned bytes = plan.
    calls = _record_page_locks(monkeypatch)
    monkeypatch.setattr(host_arena, "pinning_of", lambda device: IN_PLACE)
    monkeypatch.setattr(offload_optimizer, "pinning_of", lambda device: IN_PLACE)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 24), nn.Linear(24, 24), nn.LayerNorm(24), nn.Linear(24, 1000)).bfloat16()
    for master_dtype in (None, "fp32"):
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype=master_dtype,
                               minimal_size=100, lr=1e-3)
        report = opt.memory_report()
        plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda", master_dtype=master_dtype,
                                                 minimal_size=100, lr=1e-3)
        pinned = sum(v for k, v in plan.parts.items() if k.endswith("(pinned)"))
        assert report.pinned_bytes == pinned == calls[-1][2]
        assert sum(t.numel() * t.element_size() for s in opt._slots if s.offloaded
                   for t in opt._host_buffers(s)) > pinned - ALIGNMENT * 3 * report.num_offloaded
        for slot in opt._slots:  # the host copies start as the parameters
            if slot.offloaded:
                assert torch.equal(slot.step_param.to(slot.param.dtype), slot.param.detach())
    assert [c[0] for c in calls].count("lock") == 2

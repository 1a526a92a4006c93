"""Host buffers carved out of blocks page-locked in place, against what the engine reports."""

import gc
import io

import pytest
import torch
from torch import nn

import torchtune_offload.optim.host_arena as host_arena
import torchtune_offload.optim.offload_optimizer as offload_optimizer
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim.host_arena import (
    ALIGNMENT,
    ALLOCATOR,
    IN_PLACE,
    NONE,
    aligned_bytes,
    host_buffers,
    pinned_allocation_bytes,
)

SPECS = [((1000, 3), torch.bfloat16), ((7,), torch.float32), ((64, 64), torch.float32), ((0,), torch.float32),
         ((5, 5), torch.bfloat16)]


def test_buffers_share_one_block_at_page_aligned_offsets_without_overlap():
    buffers = host_buffers(SPECS, pinning=NONE)
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
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append(("synchronize",)))
    return calls


def test_on_cuda_the_block_is_locked_once_at_its_exact_size_and_unlocked_with_its_last_buffer(monkeypatch):
    calls = _record_page_locks(monkeypatch)
    assert host_arena.pinning_of(torch.device("cuda")) == IN_PLACE
    buffers = host_buffers(SPECS, pinning=IN_PLACE)  # no CUDA needed: locking is recorded
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
    # Copies still in flight finish before the memory is unlocked and freed.
    assert calls == [("lock", ptr, size), ("synchronize",), ("unlock", ptr)]


def test_engine_holds_exactly_what_it_plans_with_in_place_pinning(monkeypatch):
    # The engine on the CPU, its buffers made as on CUDA: one locked block per purpose, pinned bytes = plan.
    calls = _record_page_locks(monkeypatch)
    monkeypatch.setattr(offload_optimizer, "pinning_of", lambda device: IN_PLACE)
    model = _model()
    for master_dtype, blocks in ((None, 2), ("fp32", 3)):  # copies, gradients (and bf16 results)
        calls.clear()
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype=master_dtype,
                               grad_sum_dtype=master_dtype, offload_gradients=True, minimal_size=100, lr=1e-3)
        report = opt.memory_report()
        plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda", master_dtype=master_dtype,
                                                 grad_sum_dtype=master_dtype, offload_gradients=True, minimal_size=100,
                                                 lr=1e-3)
        pinned = sum(v for k, v in plan.parts.items() if k.endswith("(pinned)"))
        locks = [c for c in calls if c[0] == "lock"]
        assert len(locks) == blocks and report.pinned_bytes == pinned == sum(size for _, _, size in locks)
        for slot in opt._slots:  # the host copies start as the parameters
            if slot.offloaded:
                assert torch.equal(slot.step_param.to(slot.param.dtype), slot.param.detach())
        opt.close()


def test_a_checkpoint_of_the_masters_holds_the_masters_and_their_state_only():
    # torch.save writes a view's whole storage: the masters' block must hold nothing else.
    model = _model()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32", minimal_size=100,
                           lr=1e-3)
    for slot in opt._slots:
        slot.step_param.grad = torch.zeros_like(slot.step_param)
        slot.optimizer.step()
        slot.step_param.grad = None
    masters = sum(aligned_bytes(s.step_param.numel() * 4) for s in opt._slots if s.offloaded)
    state = sum(t.numel() * t.element_size() for s in opt._slots for t in s.optimizer.state[s.step_param].values())
    small = sum(s.step_param.numel() * 4 for s in opt._slots if not s.offloaded)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    assert masters + state + small < saved.tell() < masters + state + small + 64 * 1024  # + pickled structure


def _refuse_page_locks(monkeypatch):
    """CUDA refuses to page-lock in place (as some hosts' drivers do); returns each torch.empty's pin_memory."""
    def refuse(ptr, size):
        raise RuntimeError("Registering memory failed with cudaError: 1.")

    monkeypatch.setattr(host_arena.pin_memory_utils, "pin_memory", refuse)
    monkeypatch.setattr(offload_optimizer, "pinning_of", lambda device: IN_PLACE)
    made = []
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: made.append(pin_memory) or _empty(*a, **k))
    return made


def test_a_refused_page_lock_falls_back_to_torchs_pinned_allocator_with_a_warning(monkeypatch):
    made = _refuse_page_locks(monkeypatch)
    with pytest.warns(UserWarning, match="could not be page-locked in place"):
        opt = OffloadOptimizer(_model().named_parameters(), minimal_size=100, lr=1e-3)
    buffers = [t for s in opt._slots if s.offloaded for t in s.host_buffers]
    assert opt._table.pinning == ALLOCATOR and made.count(True) == len(buffers)  # each buffer pinned on its own
    report = opt.memory_report()
    assert report.pinned_bytes == sum(pinned_allocation_bytes(t.numel() * t.element_size()) for t in buffers)


@pytest.mark.parametrize("optimizer_class, blocks", [("torch.optim.AdamW", 1), ("torchtune_offload.AdamW8bit", 2)])
def test_device_update_states_are_locked_in_place_as_planned(monkeypatch, optimizer_class, blocks):
    """update_on=device keeps only the states on the host, page-locked in one block per dtype (8-bit
    codes and their fp32 absmax in two): the locks are the report's pinned bytes and the plan's."""
    calls = _record_page_locks(monkeypatch)
    monkeypatch.setattr(offload_optimizer, "pinning_of", lambda device: IN_PLACE)
    options = dict(update_on="device", minimal_size=100, lr=1e-3)
    opt = OffloadOptimizer(_model().named_parameters(), optimizer_class, **options)
    plan = OffloadOptimizer.plan_host_memory(_model().named_parameters(), optimizer_class, device="cuda", **options)
    locks = [size for kind, *args in calls if kind == "lock" for size in args[1:]]
    assert len(locks) == blocks
    assert opt.memory_report().pinned_bytes == sum(locks) == sum(v for k, v in plan.parts.items()
                                                                 if k.endswith("(pinned)"))
    opt.close()


def test_device_update_states_fall_back_to_torchs_pinned_allocator_when_locking_is_refused(monkeypatch):
    made = _refuse_page_locks(monkeypatch)
    with pytest.warns(UserWarning, match="could not be page-locked in place"):
        opt = OffloadOptimizer(_model().named_parameters(), update_on="device", minimal_size=100, lr=1e-3)
    states = [t for held in opt._streamer._host.values() for t in held.values()]
    assert opt._streamer.pinning == ALLOCATOR and made.count(True) == len(states) > 0
    assert opt.memory_report().pinned_bytes == sum(pinned_allocation_bytes(t.numel() * t.element_size())
                                                   for t in states)
    opt.close()


def test_one_tensor_under_two_names_is_refused():
    weight = nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ValueError, match="one tensor is given as 'a' and as 'b'"):
        OffloadOptimizer([("a", weight), ("b", weight)], minimal_size=100, lr=1e-3)


_empty = torch.empty


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(1000, 24), nn.Linear(24, 24), nn.LayerNorm(24), nn.Linear(24, 1000)).bfloat16()

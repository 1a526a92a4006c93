"""``update_on="device"`` with whole slots stepped in runs: the parameters of one module whose
states fit one staging buffer together go up, are stepped by one call of the base optimizer and
come back together; side by side with the same optimizer without offload, bit for bit."""

import dataclasses

import pytest
import torch
from torch import nn

from tests.optim.side_by_side import read_saved_states, through_a_file
from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench.trace_summary import dispatched_aten_ops
from torchtune_offload.optim.capabilities import PLAIN_CAPABILITIES
from torchtune_offload.optim.state_streamer import StateStreamer
from torchtune_offload.optim.stream_check import StreamOrderError, checked_streams


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 32)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Layered(nn.Module):
    """Three layers of six parameters under ``layers``, and a head outside them whose weight's
    states set the staging buffers' size (as an embedding's do): a layer's fit one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])
        self.out = nn.Linear(32, 512)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def layered(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return Layered().to(dtype)


def batches(num: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 32, generator=g).to(dtype), torch.randn(4, 512, generator=g).to(dtype)) for _ in range(num)]


def device_opt(model, base="torch.optim.AdamW", **options) -> OffloadOptimizer:
    # Every parameter streamed; the default staging bound holds each tensor's states whole.
    return OffloadOptimizer(model.named_parameters(), base, update_on="device", minimal_size=1, **options)


def train(model, opt, data, *, grad_accum=2, clip=None):
    ours = isinstance(opt, OffloadOptimizer)
    for start in range(0, len(data), grad_accum):
        for x, y in data[start:start + grad_accum]:
            (((model(x) - y) ** 2).sum() / grad_accum).backward()
        if clip is not None:
            if ours:
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def runs(monkeypatch):
    """The slot keys of each run the streamer steps at once, as it steps them."""
    seen = []
    original = StateStreamer._run_batch

    def spy(self, slots, stream):
        seen.append([s.key for s in slots])
        return original(self, slots, stream)

    monkeypatch.setattr(StateStreamer, "_run_batch", spy)
    return seen


@pytest.mark.parametrize("base, options", [
    ("torch.optim.AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("torch.optim.Adam", dict(lr=1e-2, amsgrad=True)),
    ("torch.optim.SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("torch.optim.NAdam", dict(lr=1e-2)),
    ("torch.optim.RMSprop", dict(lr=1e-3, momentum=0.5, centered=True)),
    ("torch.optim.Adagrad", dict(lr=1e-2, initial_accumulator_value=0.1)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlap", [False, True])
def test_runs_of_a_modules_slots_match_the_plain_optimizer_bit_for_bit(runs, base, options, dtype, overlap):
    ref = layered(dtype=dtype)
    model = layered(dtype=dtype)
    cls = getattr(torch.optim, base.rsplit(".", 1)[1])
    ref_opt = cls(ref.parameters(), **options)
    opt = device_opt(model, base, overlap=overlap, **options)
    if overlap:
        opt.register_forward_waits(model)
    data = batches(8, dtype)
    train(ref, ref_opt, data, clip=0.5)
    train(model, opt, data, clip=0.5)
    opt.synchronize()  # the last step's updates wait for a forward that does not come
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    for (name, p), slot in zip(ref.named_parameters(), opt._slots):
        state = slot.optimizer.state[slot.param]
        assert set(state) == set(ref_opt.state[p]), name
        for key, value in ref_opt.state[p].items():
            assert torch.equal(state[key], value), (name, key)
    # In the last three steps (the first steps each slot alone where its base optimizer makes its
    # states), each layer's six parameters are one run, and the head's weight and bias (too large
    # together) two.
    later = runs[-3 * 5:]
    layers = [run for run in later if run[0].startswith("layers.")]
    assert len(layers) == 3 * 3 and all(len(run) == 6 and len({k.split(".")[1] for k in run}) == 1 for run in layers)
    assert [run for run in later if run not in layers] == [["out.weight"], ["out.bias"]] * 3


def test_a_run_fits_one_staging_buffer_and_the_step_count_advances_in_place(runs):
    model = layered()
    # Buffers of 32 KiB: the head's weight is sliced, a layer's 'up' and 'down' states (24576 bytes
    # each) no longer fit together.
    opt = device_opt(model, lr=1e-2, device_staging_mib=64 / 1024)
    capacity = opt._streamer._buffers[0].numel()
    data = batches(6)
    train(model, opt, data[:2])
    counts = {s.key: s.optimizer.state[s.param]["step"] for s in opt._slots}
    runs.clear()
    train(model, opt, data[2:])
    streamer = opt._streamer
    slot_of = opt._table.slot_of_key
    for run in filter(lambda run: len(run) > 1, runs):  # a sliced slot goes alone, slice by slice
        assert sum(streamer._views.run_bytes[slot_of[key].index] for key in run) <= capacity
    assert max(map(len, runs)) > 1 and len(runs) > 5 * 2
    for slot in opt._slots:  # the same tensors, two steps on: no copy of them is made per step
        assert slot.optimizer.state[slot.param]["step"] is counts[slot.key]
        assert float(counts[slot.key]) == 3


def test_resume_in_runs_is_bit_identical():
    data = batches(12)
    straight = layered()
    opt = device_opt(straight, lr=1e-2, overlap=True)
    opt.register_forward_waits(straight)
    train(straight, opt, data, clip=0.5)
    opt.synchronize()

    first = layered()
    opt = device_opt(first, lr=1e-2, overlap=True)
    opt.register_forward_waits(first)
    train(first, opt, data[:6], clip=0.5)
    saved = through_a_file({"model": first.state_dict(), "opt": opt.state_dict()})
    resumed = layered(seed=123)
    resumed.load_state_dict(saved["model"])
    opt = device_opt(resumed, lr=1e-2, overlap=True)
    opt.register_forward_waits(resumed)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, data[6:], clip=0.5)
    opt.synchronize()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose step over several parameters (a run's, never a first step's) raises once."""

    capabilities = dataclasses.replace(PLAIN_CAPABILITIES, elementwise_update=True)
    failed = False

    def step(self, closure=None):
        if len(self.param_groups[0]["params"]) > 1 and not FailingAdamW.failed:
            FailingAdamW.failed = True
            raise RuntimeError("boom")
        return super().step(closure)


def test_a_failed_run_leaves_each_optimizer_on_its_host_states():
    model = layered()
    FailingAdamW.failed = False
    opt = device_opt(model, FailingAdamW, lr=1e-2)
    data = batches(4)
    train(model, opt, data[:2])
    with pytest.raises(RuntimeError, match="boom"):
        train(model, opt, data[2:])
    for slot in opt._slots:
        (stepped,) = slot.optimizer.param_groups[0]["params"]
        assert stepped is slot.param
        state = slot.optimizer.state
        assert list(state) == [slot.param], slot.key
        host = opt._streamer._host[slot.index]
        assert all(state[slot.param][k] is host[k] for k in host), slot.key


def test_a_runs_ops_are_the_plain_steps_and_one_copy_each_way(runs):
    """The launching thread's cost: beside the base optimizer's own step, each run dispatches
    one upload and one download of all its states, and nothing per parameter."""
    ref, model = layered(), layered()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = device_opt(model, lr=1e-2)
    data = batches(6)
    train(ref, ref_opt, data[:4])
    train(model, opt, data[:4])
    for m in (ref, model):
        x, y = data[4]
        ((m(x) - y) ** 2).sum().backward()
    runs.clear()
    plain = dispatched_aten_ops(ref_opt.step)
    ours = dispatched_aten_ops(opt.step)
    assert len(runs) == 5
    assert sorted(ours) == sorted(plain + ["aten::_foreach_copy_"] * 2 * len(runs))


def _checked_run(drop=()):
    model = layered()
    with checked_streams(drop_waits=drop):
        opt = device_opt(model, lr=1e-2, overlap=True)
        opt.register_forward_waits(model)
        train(model, opt, batches(8), clip=0.5)
        read_saved_states(opt)
        opt.close()
    return model


@pytest.mark.streams_as_is
def test_runs_on_virtual_streams_give_the_emulations_results():
    reference = layered()
    opt = device_opt(reference, lr=1e-2, overlap=True)
    opt.register_forward_waits(reference)
    train(reference, opt, batches(8), clip=0.5)
    opt.close()
    for a, b in zip(_checked_run().parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.streams_as_is
@pytest.mark.parametrize("site", [
    "order.wait_event(stream, uploaded)",
    "order.wait_event(self._down, computed)",
    "order.wait_event(self._up, self._buffer_free[index])",
])
def test_each_wait_of_a_run_is_one_the_checker_needs(site):
    with pytest.raises(StreamOrderError):
        _checked_run(drop=[("state_streamer.py", site)])

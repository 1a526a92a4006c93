"""The stream checker (optim/stream_check.py): virtual streams on the CPU, CUDA's ordering rules,
and a calibration that shows every wait the engine makes is one some CPU test needs."""

import contextlib
import inspect
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch

from tests.optim.side_by_side import assert_same_params, batches, read_saved_states, tiny_model, train, twin
from tests.optim.test_overlap import train_windows
from tests.torchao_on_cpu import torchao_on_cpu
from torchtune_offload import CPUOffloadOptimizer
from torchtune_offload.optim import grad_norm, stream_check, virtual_device
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.optim.staging import DeviceSumRing
from torchtune_offload.optim.stream_check import StreamOrderError, checked_streams
from torchtune_offload.optim.transfer import TransferEngine

pytestmark = pytest.mark.streams_as_is

MINIMAL_SIZE = 1000  # weights offloaded or streamed, biases on the device
#: Small enough that each weight's states are staged in several slices through both buffers.
STAGING_MIB = 0.02


# ------------------------------------------------------------------------------- the rules

def test_a_side_stream_read_then_an_unordered_write_raises():
    a, b = torch.zeros(64), torch.empty(64)
    with pytest.raises(StreamOrderError) as raised:
        with checked_streams() as dev:
            s = dev.Stream()
            s.wait_stream(dev.current_stream())
            with dev.stream(s):
                b.copy_(a)
            a.add_(1)
    message = str(raised.value)
    # Both accesses are named, with the lines that made them.
    assert "read of bytes [0, 256)" in message and "write of bytes [0, 256)" in message
    assert "b.copy_(a)" in message and "a.add_(1)" in message


def test_an_event_recorded_on_the_side_stream_orders_the_write():
    a, b = torch.zeros(64), torch.empty(64)
    with checked_streams() as dev:
        s = dev.Stream()
        s.wait_stream(dev.current_stream())
        with dev.stream(s):
            b.copy_(a)
        done = dev.Event()
        done.record(s)
        dev.current_stream().wait_event(done)
        a.add_(1)
    assert torch.equal(b, torch.zeros(64)) and torch.equal(a, torch.ones(64))


def test_a_new_stream_is_ordered_after_nothing():
    with checked_streams() as dev:
        a = torch.ones(16) * 2  # written on the default stream
        s = dev.Stream()
        with pytest.raises(StreamOrderError):
            with dev.stream(s):
                a.sum()


def test_byte_ranges_of_one_storage_that_do_not_overlap_need_no_order():
    a = torch.zeros(64)
    with checked_streams() as dev:
        s = dev.Stream()
        with dev.stream(s):
            a[:32].add_(1)
        a[32:].add_(2)  # other bytes of the same storage
        with pytest.raises(StreamOrderError):
            a[16:48].add_(3)


def test_the_host_waits_for_a_copy_into_host_memory_only_by_synchronizing():
    src = torch.arange(8.0)

    def copy_then_double(*, synchronize: bool) -> torch.Tensor:
        with checked_streams() as dev:
            host = stream_check.host_tensor(torch.empty(8))
            s = dev.Stream()
            s.wait_stream(dev.current_stream())
            with dev.stream(s):
                host.copy_(src, non_blocking=True)
            if synchronize:
                s.record_event().synchronize()
            host.mul_(2)  # a host operation: without the synchronize, the copy may still be running
        return host

    with pytest.raises(StreamOrderError):
        copy_then_double(synchronize=False)
    assert torch.equal(copy_then_double(synchronize=True), src * 2)


def test_memory_freed_while_another_stream_used_it_needs_record_stream():
    def run(record: bool) -> None:
        with checked_streams() as dev:
            s = dev.Stream()
            grad = torch.ones(256) * 3  # allocated on the default stream
            s.wait_stream(dev.current_stream())
            with dev.stream(s):
                torch.empty(256).copy_(grad)
            if record:
                dev.record_stream(grad, s)
            del grad  # the caching allocator would hand the memory out again now

    run(record=True)
    with pytest.raises(StreamOrderError, match="record_stream"):
        run(record=False)


def test_a_worker_thread_is_ordered_by_its_submission_and_its_future():
    data = torch.zeros(32)
    with checked_streams():
        data = stream_check.host_tensor(torch.zeros(32))
        data.add_(1)
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = stream_check.submit(pool, data.mul_, 2)  # after the add: submitted after it
            future.result()
        data.sub_(1)  # after the worker's write: its result() was waited for
    assert torch.equal(data, torch.ones(32))


def test_a_worker_write_not_waited_for_raises():
    with checked_streams():
        data = stream_check.host_tensor(torch.zeros(32))
        started = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = stream_check.submit(pool, lambda: (data.add_(1), started.set()))
            started.wait()
            with pytest.raises(StreamOrderError):
                data.mul_(2)  # the worker's write is done, but nothing ordered this thread after it
            future.result()


def test_the_context_does_not_nest_and_leaves_no_virtual_device_behind():
    with checked_streams():
        assert stream_check.active()
        with pytest.raises(RuntimeError, match="does not nest"):
            with checked_streams():
                pass
    assert not stream_check.active()
    assert stream_check.device_module(torch.device("cpu")) is None


def _parameters(function) -> list:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "cls", "checker")]


@pytest.mark.parametrize("virtual, real", [
    (virtual_device.VirtualDevice, torch.cuda),
    (virtual_device.VirtualStream, torch.cuda.Stream),
    (virtual_device.VirtualEvent, torch.cuda.Event),
])
def test_the_virtual_device_takes_no_call_torch_cuda_would_refuse(virtual, real):
    """Engine code proven on the virtual device runs on CUDA: every call it offers exists in
    torch.cuda with the same leading parameters (a keyword the virtual device took and CUDA does not
    would fail at the first GPU step)."""
    names = [n for n, f in vars(virtual).items() if callable(f) and not n.startswith("_")]
    assert names
    for name in names:
        if name == "record_stream":  # the virtual device's stand-in for Tensor.record_stream (a builtin)
            assert callable(torch.Tensor.record_stream)
            continue
        theirs = getattr(real, name, None)
        assert theirs is not None, f"torch.cuda has no {virtual.__name__}.{name}"
        if isinstance(theirs, type):
            theirs = theirs.__new__
        mine = _parameters(getattr(virtual, name))
        assert mine == _parameters(theirs)[:len(mine)], name


def test_a_virtual_event_times_only_with_enable_timing():
    with checked_streams() as dev:
        untimed, timed = dev.Event(), dev.Event(enable_timing=True)
        for e in (untimed, timed):
            e.record()
        with pytest.raises(RuntimeError, match="enable_timing=True"):
            untimed.elapsed_time(timed)
        end = dev.Event(enable_timing=True)
        end.record()
        assert timed.elapsed_time(end) >= 0


def test_copies_still_in_flight_are_timed_at_a_later_call(monkeypatch):
    """On a GPU a copy's timing events may not have completed when a step's timings are read: its
    seconds are counted at the next call, once, and never lost (the virtual events are done at once,
    so one is held back here)."""
    busy = [True]

    def query(event):
        done, busy[0] = not busy[0], False
        return done

    with checked_streams():
        transfer = TransferEngine(torch.device("cpu"))
        src, dst = torch.randn(1 << 16), stream_check.host_tensor(torch.empty(1 << 16))
        transfer.to_host(dst, src).synchronize()
        monkeypatch.setattr(virtual_device.VirtualEvent, "query", query)
        first, second, third = (transfer.copy_seconds()["grad"] for _ in range(3))
    assert first == 0 and second > 0 and third == 0


# ---------------------------------------------------------------- the engine on virtual streams

def _host_engine(model, **options):
    return OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE, lr=1e-2,
                            **options)


def _sums_on_a_tiny_device_ring(model):
    """Later micro-batches added on the device through 3 chunks of 1 KiB: every weight's gradient is
    split, and the ring wraps many times a micro-batch (its chunks are reused)."""
    opt = _host_engine(model, offload_gradients=True, grad_sum_on="device")
    opt._grads.staging = DeviceSumRing(opt._transfer, device=opt.device, chunk_bytes=1024, num_chunks=3)
    return opt


def _device_update(model, **options):
    return _host_engine(model, update_on="device", device_staging_mib=STAGING_MIB, **options)


#: name -> (how the optimizer is built, accumulation, clipping, announce windows (overlap)).
SCENARIOS = {
    "serial": (lambda m: _host_engine(m), 1, None, False),
    "serial offload_gradients": (lambda m: _host_engine(m, offload_gradients=True), 2, 1.0, False),
    "overlap": (lambda m: _host_engine(m, overlap=True), 2, None, True),
    "overlap offload_gradients": (lambda m: _host_engine(m, offload_gradients=True, overlap=True), 3, 0.5, True),
    "serial sums on the device": (_sums_on_a_tiny_device_ring, 3, 1.0, False),
    "overlap sums on the device": (lambda m: _host_engine(m, offload_gradients=True, overlap=True,
                                                          grad_sum_on="device"), 3, 0.5, True),
    "device update": (lambda m: _device_update(m), 2, 1.0, False),
    "device update overlap": (lambda m: _device_update(m, overlap=True), 1, None, False),
    # Adagrad makes its states in its constructor: its first step uploads them into staging buffers
    # the compute stream allocated.
    "device update Adagrad": (lambda m: OffloadOptimizer(
        m.named_parameters(), "torch.optim.Adagrad", minimal_size=MINIMAL_SIZE, lr=1e-2, initial_accumulator_value=0.1,
        update_on="device", device_staging_mib=STAGING_MIB), 2, None, False),
}


def _run(scenario: str, *, drop=()) -> torch.nn.Module:
    build, grad_accum, clip, announce = SCENARIOS[scenario]
    model = tiny_model()
    data = batches(num=3 * grad_accum)
    # Host norms measured side by side even for the thin model's few bytes, so that their threads are checked.
    with mock.patch.object(grad_norm, "PARALLEL_MIN_BYTES", 0), checked_streams(drop_waits=drop):
        opt = build(model)
        if announce or opt.overlap:
            opt.register_forward_waits(model)
        train_windows(model, opt, data, grad_accum=grad_accum, clip=clip, announce=announce)
        # A checkpoint reads the host states and weights, as the recipes' saves do.
        read_saved_states(opt)
        opt.close()
    return model


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_engine_on_virtual_streams_gives_the_emulation_results_bit_for_bit(scenario):
    build, grad_accum, clip, announce = SCENARIOS[scenario]
    model = tiny_model()
    reference = twin(model)
    data = batches(num=3 * grad_accum)
    opt = build(reference)
    if announce or opt.overlap:
        opt.register_forward_waits(reference)
    train_windows(reference, opt, data, grad_accum=grad_accum, clip=clip, announce=announce)
    opt.close()
    checked = _run(scenario)
    for (name, a), b in zip(checked.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


#: Every wait of the engine's ordering code: (file, the call's source text) -> a scenario whose
#: checked run fails without it. docs/stream_check.md lists the same table.
WAITS = {
    ("transfer.py", "self.order.wait_stream(self.stream, self.order.current())"): "serial offload_gradients",
    ("transfer.py", "self.order.keep_for(src, self.stream)"): "serial offload_gradients",
    ("transfer.py", "self.order.wait_event(self.order.current(), event)"): "overlap offload_gradients",
    ("transfer.py", "self.order.wait_stream(compute, self.h2d_stream)"): "serial",
    ("transfer.py", "self.order.host_waits(event)"): "serial offload_gradients",
    ("staging.py", "self._transfer.wait(event)"): "serial offload_gradients",
    ("staging.py", "pending[1].result()"): "serial offload_gradients",
    ("grad_norm.py", "norms[i] = future.result()"): "serial offload_gradients",
    ("staging.py", "self._transfer.uploads_wait_for_compute()"): "serial sums on the device",
    ("staging.py", "order.wait_event(up, event)"): "serial sums on the device",
    ("staging.py", "order.wait_stream(down, order.current())"): "overlap sums on the device",
    ("staging.py", "order.wait_event(up, self._read_down[index])"): "serial sums on the device",
    ("staging.py", "order.wait_event(down, order.record(up))"): "overlap sums on the device",
    ("staging.py", "order.keep_for(read, down)"): "serial sums on the device",
    ("staging.py", "self._transfer.wait(newest[1])"): "overlap sums on the device",
    ("state_streamer.py", "order.wait_event(self._up, self._buffer_free[index])"): "device update",
    ("state_streamer.py", "order.wait_event(stream, self._buffer_free[index])"): "device update",
    ("state_streamer.py", "order.wait_event(stream, uploaded)"): "device update",
    ("state_streamer.py", "order.wait_event(self._down, computed)"): "device update",
    ("state_streamer.py", "self._streams.wait_stream(self._update_stream, self._streams.current())"): "device update overlap",
    ("state_streamer.py", "self._streams.keep_for(grad, self._update_stream)"): "device update overlap",
    ("state_streamer.py", "self._streams.wait_event(self._streams.current(), self._pending.pop(slot.index))"): "device update overlap",
    ("state_streamer.py", "self._streams.host_waits_stream(self._down)"): "device update",
    ("state_streamer.py", "self._streams.wait_stream(self._up, self._streams.current())"): "device update Adagrad",
    ("overlap_scheduler.py", "self._result(queued.landed,"): "overlap offload_gradients",
    ("overlap_scheduler.py", "self._transfer.compute_waits_for(queued.param_event)"): "overlap",
}


#: Waits no checked run needs, each with the reason (docs/stream_check.md says the same).
UNSEEN = {
    ("state_streamer.py", "self._streams.wait_event(self._up, self._downloaded.get(slot.index))"):
        "step() synchronizes first: StateStreamer.synchronize() blocks the host on the download stream",
    ("overlap_scheduler.py", "self._result(queued.done,"):
        "it orders Python state (the upload's event is read after it), not memory: the upload's event orders the forward",
    ("transfer.py", "self.order.wait_stream(compute, self.stream)"):
        "every gradient copied down is freed with record_stream or never written again on the compute stream",
    ("transfer.py", "self.order.host_waits_stream(self.stream)"):
        "host readers of host memory are ordered by the waits above in every configuration",
    ("transfer.py", "self.order.host_waits_stream(self.h2d_stream)"):
        "host readers of host memory are ordered by the waits above in every configuration",
    ("staging.py", "order.keep_for(norm, order.current())"):
        "each checked run reads the clipped total norm (float()) before a sum's norm is dropped, which orders "
        "the compute stream's read of it before its free",
}


@pytest.mark.parametrize("site", list(WAITS), ids=[f"{f}:{t}" for f, t in WAITS])
def test_each_wait_is_one_a_checked_test_needs(site):
    with pytest.raises(StreamOrderError):
        _run(WAITS[site], drop=[site])


def test_the_engines_profiler_ranges_order_nothing():
    """Under a running profiler the engine's ranges (step_timings.profiled) are operators that take
    no tensor: were they counted as work on a stream, the landing range around the host norm would
    order the threads and hide this dropped wait."""
    site = ("overlap_scheduler.py", "self._result(queued.landed,")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(StreamOrderError):
            _run(WAITS[site], drop=[site])


def test_the_staging_race_the_h100_showed_is_caught_with_its_fix_undone():
    fix = ("state_streamer.py", "order.wait_event(stream, self._buffer_free[index])")
    with pytest.raises(StreamOrderError, match="state_streamer.py"):
        _run("device update", drop=[fix])


@pytest.mark.parametrize("site", list(UNSEEN), ids=[f"{f}:{t}" for f, t in UNSEEN])
def test_the_waits_listed_as_unseen_are_unseen(site):
    """If the checker learns to see one of these, it moves to WAITS (and the docs' table)."""
    for scenario in SCENARIOS:
        _run(scenario, drop=[site])


@pytest.mark.parametrize("site", [*WAITS, *UNSEEN], ids=[f"{f}:{t}" for f, t in [*WAITS, *UNSEEN]])
def test_each_listed_wait_is_in_the_engine_as_written(site):
    """A renamed or moved wait would make its calibration drop nothing."""
    filename, text = site
    with open(os.path.join(os.path.dirname(stream_check.__file__), filename)) as f:
        assert text in f.read(), site


# ------------------------------------------------- what a later micro-batch waits for, summed on the device

def _side_streams_known(checker) -> dict:
    """How far into each side stream's work the compute stream and the calling (training) thread
    are ordered: what they have waited for, directly or through another thread."""
    side = [agent for agent in checker.clocks if agent is not checker.default_stream.agent
            and agent not in checker.hosts.values()]
    compute, host = checker.clock_of(checker.default_stream.agent), checker.clock_of(checker.host())
    return {agent.name: (compute.get(agent, 0), host.get(agent, 0)) for agent in side}


def _waits_in_later_passes(*, grad_sum_on: str, overlap: bool, grad_accum: int = 4) -> list:
    """Trains three windows; for each pass of the middle window that is neither its first nor its
    last, whether the compute stream or the training thread became ordered after more of the side
    streams' work (the copies, the ring's additions) during that pass's forward and backward."""
    model = tiny_model()
    data = batches(num=3 * grad_accum)
    grew = []
    with checked_streams():
        checker = stream_check._ACTIVE
        opt = _host_engine(model, offload_gradients=True, overlap=overlap, grad_sum_on=grad_sum_on)
        opt.register_forward_waits(model)
        for window in range(3):
            for i, (x, y) in enumerate(data[window * grad_accum : (window + 1) * grad_accum]):
                before = _side_streams_known(checker)
                loss = ((model(x) - y) ** 2).sum() / grad_accum
                if overlap and i == grad_accum - 1:
                    opt.expect_final_backward(clipping=True)
                loss.backward()
                if window == 1 and 0 < i < grad_accum - 1:
                    grew.append(_side_streams_known(checker) != before)
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        opt.close()
    return grew


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_later_micro_batches_summed_on_the_device_wait_for_none_of_the_sums(overlap):
    """With grad_sum_on=device the ring's uploads, additions and downloads are to run beside the
    next passes: a later micro-batch that is not the window's last orders neither the compute
    stream nor the training thread after any of them (on a GPU, such a wait would stall the passes
    until the sums' PCIe traffic caught up). The vector clocks say it, not a timing."""
    assert _waits_in_later_passes(grad_sum_on="device", overlap=overlap) == [False, False]


@pytest.mark.parametrize("wait", ["compute stream", "training thread"])
def test_the_later_pass_wait_measure_sees_a_wait_added_to_the_device_ring(wait, monkeypatch):
    """The measure above is calibrated: a wait for the ring's downloads added after each addition,
    by the compute stream or by the training thread, is seen in every later pass."""
    original = DeviceSumRing._add_many

    def add_then_wait(self, pairs, after, **kwargs):
        added = original(self, pairs, after, **kwargs)
        if wait == "compute stream":
            self._transfer.compute_waits_for_copies()
        else:
            self._transfer.synchronize()
        return added

    monkeypatch.setattr(DeviceSumRing, "_add_many", add_then_wait)
    assert _waits_in_later_passes(grad_sum_on="device", overlap=True) == [True, True]


# ------------------------------------------------------------ torchao's optimizer on virtual streams

def _torchao_against_plain_adamw(monkeypatch, *, offload_gradients: bool, grad_accum: int, drop=()) -> None:
    """torchao's own hooks and step (its side stream, events, record_stream), inside the wrapper,
    on virtual streams, trained beside plain AdamW (tests/torchao_on_cpu.py)."""
    reference = tiny_model()
    model = twin(reference)
    data = batches(num=3 * grad_accum)
    noop = lambda f: None  # noqa: E731 -- torchao cannot scale; the targets are scaled instead
    scaled = [(x, y / grad_accum**0.5) for x, y in data]
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True), scaled, grad_accum=grad_accum,
          clip=None, scale_grads=noop, clip_grads=None)
    with checked_streams(drop_waits=drop) as dev:
        with monkeypatch.context() as patch:
            torchao_on_cpu(patch, streams=dev)
            opt = CPUOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE,
                                      offload_gradients=offload_gradients, lr=1e-2)
            assert opt.d_opt is not None and opt.param_d2h_map  # both step paths
            train(model, opt, scaled, grad_accum=grad_accum, clip=None, scale_grads=noop, clip_grads=None)
    assert_same_params(reference, model, rtol=0, atol=0)


@pytest.mark.parametrize("offload_gradients, grad_accum", [(False, 1), (False, 3), (True, 1)])
def test_torchao_on_virtual_streams_orders_every_access_and_follows_plain_adamw(monkeypatch, offload_gradients,
                                                                                 grad_accum):
    _torchao_against_plain_adamw(monkeypatch, offload_gradients=offload_gradients, grad_accum=grad_accum)


@pytest.mark.parametrize("drop", [(), [("ao_offload.py", "event.synchronize()")]], ids=["as built", "wait undone"])
def test_torchaos_host_copies_are_waited_for_before_a_norm_reads_them(monkeypatch, drop):
    """A norm other than the 2-norm (measured on the device) is taken over torchao's host copies of
    the gradients, which its side stream is still writing after backward: the wrapper waits for
    each copy's event first. Without that wait the checker names the read."""
    model = tiny_model()
    with contextlib.ExitStack() as stack:
        dev = stack.enter_context(checked_streams(drop_waits=drop))
        torchao_on_cpu(stack.enter_context(monkeypatch.context()), streams=dev)
        opt = CPUOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE, lr=1e-2)
        x, y = batches(num=1)[0]
        ((model(x) - y) ** 2).sum().backward()
        if drop:
            stack.enter_context(pytest.raises(StreamOrderError))
        norm = opt.grad_norm(norm_type=math.inf)
        assert torch.equal(norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], math.inf))


def test_the_torchao_accumulation_race_the_h100_showed_is_caught_with_its_fix_undone(monkeypatch):
    """torchao copies each gradient down on its side stream after every micro-batch; the next
    micro-batch's backward adds into the same device gradient on the compute stream. The wrapper
    makes that addition wait for the copy; without the wait the checker names the pair, as
    TORCH_CUDA_SANITIZER did on the H100 (docs/gpu_results.md)."""
    with pytest.raises(StreamOrderError, match=r"(?s)copy_.*add_"):
        _torchao_against_plain_adamw(monkeypatch, offload_gradients=False, grad_accum=3,
                                     drop=[("ao_offload.py", "current_stream().wait_event(event)")])

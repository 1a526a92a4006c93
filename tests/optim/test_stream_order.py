"""``stream_order``: the one owner of the engine's stream ordering, and its in-order stand-in."""

import inspect
import os
import re

import pytest
import torch

import torchtune_offload.optim as optim_package
from torchtune_offload.optim.stream_check import StreamOrderError, checked_streams, host_tensor
from torchtune_offload.optim.stream_order import InOrderDevice, InOrderEvent, InOrderStream, StreamOrder
from torchtune_offload.optim.virtual_device import VirtualStream

pytestmark = pytest.mark.streams_as_is  # each test says whether it checks streams

OPTIM = os.path.dirname(optim_package.__file__)
#: The stream API of torch's device modules called directly (not on a StreamOrder: ``order``, ``self.order``,
#: ``self._streams``).
RAW_STREAM_CALL = re.compile(
    r"(?<!order)(?<!_streams)\.(wait_event|wait_stream|record_stream|current_stream|Stream|Event)\(|torch\.cuda\.")
#: Where the raw calls belong: the owner, the checker's virtual device, and code whose streams are not the engine's.
OUTSIDE_THE_ENGINE = {
    "stream_order.py": "the owner",
    "stream_check.py": "the checker",
    "virtual_device.py": "the checker's device",
    "happens_before.py": "the checker",
    "ao_offload.py": "torchao's wrapper waits for the events torchao's own hooks record",
    "host_arena.py": "unpinning synchronizes the whole device before the memory is freed",
    "driver_check.py": "reads the CUDA driver's version",
}


def test_the_engine_orders_streams_only_through_stream_order():
    offenders = []
    for name in sorted(os.listdir(OPTIM)):
        if not name.endswith(".py") or name in OUTSIDE_THE_ENGINE:
            continue
        with open(os.path.join(OPTIM, name)) as f:
            for number, line in enumerate(f, 1):
                code = line.split("#", 1)[0]
                if RAW_STREAM_CALL.search(code) or re.search(r"streams? is (not )?None", code):
                    offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_exceptions_are_files_that_exist():
    assert set(OUTSIDE_THE_ENGINE) <= set(os.listdir(OPTIM))


@pytest.mark.parametrize("stand_in, real", [
    (InOrderDevice, torch.cuda),
    (InOrderStream, torch.cuda.Stream),
    (InOrderEvent, torch.cuda.Event),
])
def test_the_stand_in_takes_no_call_torch_cuda_would_refuse(stand_in, real):
    """The CPU runs the accelerator's ordering code on the stand-in: each call it offers exists in
    torch.cuda with the same leading parameters."""
    names = [n for n, f in vars(stand_in).items() if callable(f) and not n.startswith("_")]
    assert names
    for name in names:
        if name == "record_stream":  # the stand-in for Tensor.record_stream
            continue
        theirs = getattr(real, name)
        if isinstance(theirs, type):
            theirs = theirs.__new__
        ours = [p for p in inspect.signature(getattr(stand_in, name)).parameters if p != "self"]
        theirs = [p for p in inspect.signature(theirs).parameters if p not in ("self", "cls")]
        assert ours == theirs[:len(ours)], name


def test_on_a_cpu_the_order_is_the_in_order_stand_in():
    order = StreamOrder(torch.device("cpu"))
    assert order.in_order
    side = order.new_stream()
    assert isinstance(side, InOrderStream) and side is not order.current()
    # Work "on" a side stream runs at once, on the calling thread.
    x = torch.zeros(3)
    with order.on(side):
        x.add_(1)
    event = order.record(side)
    assert event.query() and torch.equal(x, torch.ones(3))
    order.wait_event(order.current(), event)
    order.wait_event(order.current(), None)  # nothing issued yet: nothing to wait for
    order.wait_stream(side, order.current())
    order.keep_for(x, side)
    order.host_waits(event)
    order.host_waits(None)
    order.host_waits_stream(side)


def test_the_stand_ins_timing_events_time_what_runs_between_them():
    order = StreamOrder(torch.device("cpu"))
    begin = order.record(timing=True)
    sum(range(100000))
    end = order.record(timing=True)
    assert order.done(end) and order.elapsed_ms(begin, end) > 0
    untimed = order.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        order.elapsed_ms(untimed, end)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not kept"])
def test_inside_the_checker_the_order_is_the_virtual_device_and_keep_for_is_recorded(keep):
    def run():
        with checked_streams() as dev:
            order = StreamOrder(torch.device("cpu"))
            assert not order.in_order
            side = order.new_stream()
            assert isinstance(side, VirtualStream) and order.current() is dev.current_stream()
            # A device tensor freed on the compute stream while the side stream's read of it is not
            # ordered: the checker raises unless keep_for recorded the side stream's use.
            grad = torch.ones(4)
            host = host_tensor(torch.empty(4))
            order.wait_stream(side, order.current())
            with order.on(side):
                host.copy_(grad, non_blocking=True)
            if keep:
                order.keep_for(grad, side)
            del grad
            torch.ones(4)  # the next operation reports a free that was not ordered
            order.host_waits_stream(side)

    if keep:
        run()
    else:
        with pytest.raises(StreamOrderError):
            run()

"""torchao's ``CPUOffloadOptimizer`` built on a CPU-only machine, for tests of what stands around it.

torchao asserts a CUDA or XPU device, makes a side stream of it, pins a host copy and a gradient
buffer per parameter and orders the copies with events; ``torchtune_offload.CPUOffloadOptimizer``
refuses a machine without CUDA or XPU. Here, for one test, torchao's module sees a ``torch`` whose
streams are always done and whose ``empty_like`` does not pin, and the wrapper's module a ``torch``
whose accelerator is the CPU. On the CPU every copy is synchronous, so a stream with nothing pending
is exact: the arithmetic is torchao's own. Nothing outside the two modules changes, except
``Tensor.record_stream`` (which ``offload_gradients=True`` calls on the freed gradient), made a no-op.

Given the virtual device of ``stream_check.checked_streams()``, the streams, events and
``record_stream`` calls are the checker's instead, and the pinned buffers are host memory to it:
every access torchao's hooks and step make, and the recipe's around them, is checked against CUDA's
ordering rules (a missing wait raises ``StreamOrderError``), which the always-done streams cannot show.
"""

import contextlib
import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torchao.optim
import torchao.optim.cpu_offload

import torchtune_offload.optim.ao_offload
from torchtune_offload import CPUOffloadOptimizer
from torchtune_offload.optim import stream_check


class _DoneEvent:
    def synchronize(self) -> None:
        pass


class _DoneStream:
    """A stream with nothing pending: the CPU ran each copy when it was issued."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self) -> _DoneEvent:
        return _DoneEvent()

    def synchronize(self) -> None:
        pass


_STREAMS = SimpleNamespace(Stream=_DoneStream, current_stream=_DoneStream, stream=lambda s: contextlib.nullcontext())


class _HostTorch:
    """``torch`` as torchao's and the wrapper's modules see it here; every other name is torch's.
    ``streams``: the device module (always-done streams, or the checker's virtual device)."""

    accelerator = SimpleNamespace(is_available=lambda: True, current_accelerator=lambda: torch.device("cpu"))

    def __init__(self, streams: Any) -> None:
        self.cuda = self.cpu = streams
        # With the always-done streams nothing orders a copy: were a test run inside checked_streams()
        # (--also-checked-streams), its host memory would be read unordered. So it is all device memory.
        self._host_memory = streams is not _STREAMS

    def empty_like(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        # No pinned memory without an accelerator; on virtual streams what would be pinned is host memory.
        tensor = torch.empty_like(*args, **kwargs)
        return stream_check.host_tensor(tensor) if pin_memory and self._host_memory else tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _init_then_host_device(init):
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Past torchao's device assertion: its streams, and the wrapper's norm, on the CPU.
        self.device = "cpu"

    return wrapped


def torchao_on_cpu(monkeypatch: pytest.MonkeyPatch, *, streams: Any = None) -> None:
    """Lets ``torchtune_offload.CPUOffloadOptimizer`` (torchao's step) build and train on the CPU
    until ``monkeypatch`` is undone; the config check then accepts ``device=cpu`` for it.
    ``streams``: the virtual device ``checked_streams()`` yields, for torchao's streams and events."""
    host_torch = _HostTorch(_STREAMS if streams is None else streams)
    monkeypatch.setattr(torchao.optim.cpu_offload, "torch", host_torch)
    monkeypatch.setattr(torchao.optim.cpu_offload, "get_available_devices", lambda: ["cuda"])
    monkeypatch.setattr(torchao.optim.CPUOffloadOptimizer, "__init__",
                        _init_then_host_device(torchao.optim.CPUOffloadOptimizer.__init__))
    monkeypatch.setattr(torchtune_offload.optim.ao_offload, "torch", host_torch)
    caps = CPUOffloadOptimizer.capabilities
    monkeypatch.setattr(CPUOffloadOptimizer, "capabilities",
                        dataclasses.replace(caps, device_types=(*caps.device_types, "cpu")))
    if streams is None:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    else:
        monkeypatch.setattr(torch.Tensor, "record_stream", stream_check.record_stream)

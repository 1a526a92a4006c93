"""``grad_norm.host_norms``: host gradients measured on several threads, with the serial loop's bits."""

import threading
from unittest import mock

import pytest
import torch

from tests.concurrency import FirstWaitsForASecond
from torchtune_offload.optim import grad_norm
from torchtune_offload.optim.grad_norm import host_norms


def _grads():
    gen = torch.Generator().manual_seed(0)
    sizes = [7, 4096, 1, 100_003, 33, 65_536]
    dtypes = [torch.bfloat16, torch.float32]
    return [(torch.randn(n, generator=gen) * (i + 1)).to(dtypes[i % 2]) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norms_measured_side_by_side_are_the_serial_loops_bits_in_order(norm_type, monkeypatch):
    monkeypatch.setattr(grad_norm, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(grad_norm.torch, "get_num_threads", lambda: 3)
    grads = _grads()
    probe, original = FirstWaitsForASecond(), grad_norm.tensor_norm

    def spy(grad, **kwargs):
        probe()
        return original(grad, **kwargs)

    monkeypatch.setattr(grad_norm, "tensor_norm", spy)
    norms = host_norms(grads, norm_type=norm_type)
    assert len(norms) == len(grads)
    for norm, grad in zip(norms, grads):
        assert torch.equal(norm, original(grad, norm_type=norm_type))
    assert probe.saw_a_second is True and all(name.startswith("offload-norm") for name in probe.threads)


def test_few_bytes_or_one_thread_measure_on_the_calling_thread(monkeypatch):
    threads = set()
    original = grad_norm.tensor_norm

    def spy(grad, **kwargs):
        threads.add(threading.current_thread().name)
        return original(grad, **kwargs)

    monkeypatch.setattr(grad_norm, "tensor_norm", spy)
    host_norms(_grads())  # far below PARALLEL_MIN_BYTES
    monkeypatch.setattr(grad_norm, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(grad_norm.torch, "get_num_threads", lambda: 1)
    host_norms(_grads())
    assert threads == {threading.current_thread().name}


def test_no_gradients_no_norms():
    assert host_norms([]) == []


def test_an_error_in_a_norm_thread_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(grad_norm, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(grad_norm.torch, "get_num_threads", lambda: 2)

    def broken(grad, **kwargs):
        raise RuntimeError("norm failed")

    monkeypatch.setattr(grad_norm, "tensor_norm", broken)
    with pytest.raises(RuntimeError, match="norm failed"):
        host_norms(_grads())


def test_the_norms_of_a_group_are_each_tensors_own_bits():
    """tensor_norms takes a hand-off group's norms in one call: on the CPU each is vector_norm's, bit
    for bit (bf16 and fp32, contiguous or not, empty, subnormal, non-finite)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, generator=gen).bfloat16(), torch.randn(17, 9, generator=gen).t(),
             torch.randn(5000, generator=gen) * 1e-39, torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")]),
             torch.empty(0), torch.randn(64, generator=gen).bfloat16() * 1e30]
    for got, grad in zip(grad_norm.tensor_norms(grads), grads):
        want = torch.linalg.vector_norm(grad, 2.0)
        assert got.dtype == want.dtype and (torch.equal(got, want) or (got.isnan() and want.isnan()))
    assert grad_norm.tensor_norms([]) == []
    # Off the CPU (a GPU's tensors; meta ones here) each is its own vector_norm, not the foreach kernel's.
    with mock.patch.object(torch, "_foreach_norm", side_effect=AssertionError("a multi-tensor kernel")):
        on_meta = grad_norm.tensor_norms([torch.empty(3, device="meta"), torch.empty(2, 2, device="meta").bfloat16()])
    assert [(n.device.type, n.dtype, n.shape) for n in on_meta] == [("meta", torch.float32, ()), ("meta", torch.bfloat16, ())]

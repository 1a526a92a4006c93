"""The bounded staging ring: exact sums in micro-batch order, and memory that does not grow with the model."""

import contextlib
import threading
import time

import pytest
import torch
from torch import nn

from tests.optim.side_by_side import assert_same_params, batches, plain_hooks, tiny_model, train, twin
from tests.optim.test_overlap import cosine, offload, train_windows
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import grad_norm, host_grads, staging, stream_check
from torchtune_offload.optim.host_arena import aligned_bytes, pinned_allocation_bytes
from torchtune_offload.optim.staging import DeviceSumRing, StagingRing
from torchtune_offload.optim.stream_check import checked_streams
from torchtune_offload.optim.transfer import TransferEngine


def _add_through(ring, *, dtype: torch.dtype, sum_dtype: torch.dtype, chunk_bytes: int):
    """Sums four micro-batches of gradients of assorted shapes both ways: the first starts each sum,
    the other three are added with torch's ``add_`` and, undrained, through ``ring``. Returns
    (torch's sums, the ring's sums, the tokens ``add_into`` returned, the number of shapes)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (300,), (3, 4, 5), (1,), (129,)] + ([(70001,)] if chunk_bytes > 64 else [])
    micro_batches = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(4)]
    # Copies (``to`` returns the tensor itself when the dtype is already the sum's); the ring's sums
    # in host memory, as the engine's are.
    expected = [mb.to(sum_dtype, copy=True) for mb in micro_batches[0]]
    got = [stream_check.host_tensor(mb.to(sum_dtype, copy=True)) for mb in micro_batches[0]]
    tokens = []
    for mb in micro_batches[1:]:
        for e, gsum, grad in zip(expected, got, mb):
            e.add_(grad)
            tokens.append(ring.add_into(gsum, grad))
    return expected, got, tokens, len(shapes)


@pytest.mark.parametrize("dtype,sum_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("fused_add", [True, False])
@pytest.mark.parametrize("chunk_bytes", [64, 2**20])  # many one-thread additions; a few on every thread
def test_ring_sums_equal_in_order_adds_bit_for_bit(dtype, sum_dtype, fused_add, chunk_bytes):
    ring = StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=chunk_bytes, num_chunks=3,
                       fused_add=fused_add)
    expected, got, _, _ = _add_through(ring, dtype=dtype, sum_dtype=sum_dtype, chunk_bytes=chunk_bytes)
    ring.drain()
    for e, gsum in zip(expected, got):
        torch.testing.assert_close(gsum, e, rtol=0, atol=0)
    assert ring.nbytes == 3 * chunk_bytes  # however many elements went through


@pytest.mark.parametrize("chunk_bytes", [64, 200, 2**20])
def test_a_group_added_at_once_packs_its_pieces_into_chunks_and_sums_the_same_bits(chunk_bytes, monkeypatch):
    """add_many: a hand-off group's gradients (mixed dtypes and sizes) packed into chunks, each at a
    16-byte boundary, one copy call a chunk; the sums are add_'s, bit for bit,
    and each pair's token is that of the chunk holding its last piece."""
    g = torch.Generator().manual_seed(0)
    shapes = [((7, 5), torch.bfloat16), ((300,), torch.float32), ((3,), torch.bfloat16), ((1,), torch.float32),
              ((129,), torch.bfloat16)]
    transfer = TransferEngine(torch.device("cpu"))
    copy_calls = []
    to_host_many = transfer.to_host_many
    monkeypatch.setattr(transfer, "to_host_many", lambda dsts, srcs, **kw: copy_calls.append(
        sum(s.numel() * s.element_size() for s in srcs)) or to_host_many(dsts, srcs, **kw))
    ring = StagingRing(transfer, chunk_bytes=chunk_bytes, num_chunks=3)
    sums = [stream_check.host_tensor(torch.randn(s, generator=g).to(d)) for s, d in shapes]
    expected = [t.clone() for t in sums]
    for _ in range(3):
        grads = [torch.randn(s, generator=g).to(d) for s, d in shapes]
        for e, grad in zip(expected, grads):
            e.add_(grad)
        before = ring.issued
        tokens = ring.add_many(list(zip(sums, grads)))
        # Packed: each chunk holds at most chunk_bytes, pieces at 16-byte boundaries.
        assert ring.issued - before == len(copy_calls) and all(c <= chunk_bytes for c in copy_calls)
        if chunk_bytes == 2**20:
            assert copy_calls == [sum(t.numel() * t.element_size() for t in grads)]  # the whole group, once
        assert tokens == sorted(tokens) and tokens[-1] == ring.issued
        ring.drain_until(tokens[0])
        torch.testing.assert_close(sums[0], expected[0], rtol=0, atol=0)
        copy_calls.clear()
    ring.drain()
    for e, got in zip(expected, sums):
        torch.testing.assert_close(got, e, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"into"):
        ring.add_many([(sums[0], torch.zeros(3))])


def test_the_ring_sends_its_additions_to_the_adder_a_few_chunks_at_a_time(monkeypatch):
    """Chunks a narrow model's groups fill only in part go to the adder thread together: once all
    but one of the ring's chunks wait (a job per group would wake the thread per group), or once
    they hold CHUNK_BYTES (a full-size chunk goes at once), or when one of them is needed (a drain,
    the ring's coming back round to it), or at send() (the end of a backward); the sums are add_'s,
    bit for bit."""
    monkeypatch.setattr(staging, "CHUNK_BYTES", 1024)  # the ring's chunks are full-size ones
    jobs = []
    submit = stream_check.submit
    monkeypatch.setattr(stream_check, "submit", lambda pool, fn, chunks: jobs.append(len(chunks)) or submit(
        pool, fn, chunks))
    ring = StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=1024, num_chunks=4)
    total, expected = torch.zeros(25), torch.zeros(25)
    tokens = []
    for step in range(1, 7):  # 100 bytes a group, a chunk each
        grad = torch.full((25,), float(step))
        expected.add_(grad)
        tokens.append(ring.add_many([(total, grad)])[0])
    assert jobs == [3, 3]
    ring.add_many([(total, torch.ones(25))])  # one waits
    ring.drain_until(tokens[-1])  # needs only sent chunks
    assert jobs == [3, 3]
    ring.send()  # the end of a backward
    assert jobs == [3, 3, 1]
    big, big_expected = torch.zeros(256), torch.full((256,), 2.0)
    ring.add_many([(big, torch.full((256,), 2.0))])  # a full chunk: sent at once
    assert jobs == [3, 3, 1, 1]
    ring.add_many([(total, torch.ones(25))])
    ring.drain()
    assert jobs == [3, 3, 1, 1, 1]
    assert torch.equal(total, expected + 2) and torch.equal(big, big_expected)
    ring.close()


def test_a_host_ring_of_small_chunks_holds_more_of_them_within_four_full_ones():
    """Four chunks of CHUNK_BYTES (an 8B model's), more of smaller ones (up to MAX_CHUNKS), never
    more pinned bytes than four full ones: more of a narrow model's chunks wait to go to the adder together."""
    assert staging.host_ring_chunks(staging.CHUNK_BYTES) == staging.NUM_CHUNKS == 4
    assert staging.host_ring_chunks(staging.CHUNK_BYTES // 2) == 8
    assert staging.host_ring_chunks(128 * 2**10) == staging.MAX_CHUNKS == 16
    assert staging.host_ring_chunks(17 * 2**19) == 8  # 8.5 MiB chunks take 16 MiB pinned
    for chunk in (1, 2**10, 3 * 2**20, 17 * 2**19, staging.CHUNK_BYTES):  # as pinned memory takes them
        assert staging.host_ring_chunks(chunk) * pinned_allocation_bytes(chunk) <= staging.NUM_CHUNKS * staging.CHUNK_BYTES
    ring = StagingRing(TransferEngine(torch.device("cpu")), largest_bytes=2**20)
    assert ring.num_chunks == 16 and ring.chunk_bytes == 2**20
    assert StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=64, num_chunks=2).num_chunks == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_each_backward_ends_with_its_additions_started(overlap):
    """What a later micro-batch's backward leaves waiting in the ring goes to the adder thread as the
    backward ends (it adds beside the next forward, not at the next backward's first chunk)."""
    model = tiny_model()
    opt = offload(model, overlap=overlap, offload_gradients=True, minimal_size=0)
    for x, y in batches(num=2):
        ((model(x) - y) ** 2).sum().backward()
    assert opt._staging.issued > 0 and opt._staging._unsent == []
    opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_adds_a_later_micro_batchs_group_through_the_ring_at_once(overlap):
    """Each later micro-batch hands the host ring its group's gradients together, packed into chunks
    (one copy call each): the tiny model's six tensors make one group of 76,832
    bytes, two chunks of the ring's size (its largest tensor, 61,440 bytes), not one job a tensor."""
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True, overlap=overlap,
                           minimal_size=0, lr=1e-2)
    assert {opt._scheduler.handoff.group_of(s.index) for s in opt._slots} == {0}
    train(model, opt, batches(num=3), grad_accum=3, clip=None, scale_grads=opt.scale_grads_,
          clip_grads=opt.clip_grad_norm_)
    assert opt._staging.chunk_bytes == 96 * 160 * 4
    assert opt._staging.issued == 2 * 2  # micro-batches 2 and 3, two chunks each (one job a tensor: 2 x 6)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_adds_a_later_micro_batchs_group_through_the_device_ring_at_once(overlap):
    """The same with grad_sum_on=device: the group's six fp32 sums (76,832 bytes, the largest 61,440, the
    ring's chunk) go up, are added and come down in three chunks a micro-batch, not one a sum: the
    sums that arrive before the largest share one, the largest fills one, the two after it share one
    (a sum that fits a chunk is not cut)."""
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True, overlap=overlap,
                           grad_sum_on="device", minimal_size=0, lr=1e-2)
    train(model, opt, batches(num=3), grad_accum=3, clip=0.5, scale_grads=opt.scale_grads_,
          clip_grads=opt.clip_grad_norm_)
    assert opt._staging.chunk_bytes == 96 * 160 * 4
    assert opt._staging.issued == 2 * 3
    opt.close()


def test_ring_times_its_additions_on_its_own_thread(monkeypatch):
    """``added_seconds`` is the time inside the additions (what bench_accumulation.py reports as the
    host's work per micro-batch), cumulative, complete after a drain; ``waited_seconds`` the caller's
    waits for a chunk still being added."""
    ring = StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=64, num_chunks=2)
    calls = []

    ended, retired = [], []

    def slow_add(dst, src):
        calls.append(threading.current_thread().name)
        time.sleep(0.01)
        dst.add_(src)
        ended.append(time.perf_counter())

    def timed_retire(index, retire=ring._retire):
        retired.append(time.perf_counter())
        retire(index)

    monkeypatch.setattr(ring, "_add", slow_add)
    monkeypatch.setattr(ring, "_retire", timed_retire)
    assert ring.added_seconds == 0.0 and ring.waited_seconds == 0.0
    total = torch.zeros(40)
    ring.add_into(total, torch.ones(40))  # 160 bytes: 3 chunks of 64
    # The third piece needed the first chunk back: the caller waited from its retire call at least
    # until the first addition had ended (however the two threads were scheduled).
    assert ring.waited_seconds >= ended[0] - retired[2] and ring.waited_seconds > 0
    ring.drain()
    first = ring.added_seconds
    assert len(calls) == 3 and all(name.startswith("offload-staging-add") for name in calls)
    assert 0.03 <= first < 1.0
    ring.add_into(total, torch.ones(40))
    ring.drain()
    assert ring.added_seconds >= first + 0.03 and torch.equal(total, torch.full((40,), 2.0))
    ring.close()


@pytest.mark.parametrize("where", ["host", "device"])
def test_step_timings_report_each_steps_gradient_sums(where, monkeypatch):
    """With offload_gradients each step's record has the sums' seconds of that step alone (the ring's
    counters grow; the record is their growth), zero where a step had one micro-batch."""
    # Small chunks: each gradient is split, so the host ring's caller waits for its own additions.
    monkeypatch.setattr(staging, "CHUNK_BYTES", 256)
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                           grad_sum_on=where, minimal_size=1000, lr=1e-2)
    records = []
    for grad_accum in (3, 3, 1):
        train(model, opt, batches(num=grad_accum), grad_accum=grad_accum, clip=None,
              scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
        records.append(opt.step_timings())
    ring = opt._staging
    # The host's cores add on the host ring; the device ring's additions are the device's.
    if where == "host":
        assert records[0]["grad_sum_add_s"] > 0 and records[1]["grad_sum_add_s"] > 0
        assert records[1]["grad_sum_add_s"] < ring.added_seconds
    else:
        assert ring.added_seconds == 0
    # Each caller took the ring's lock (and, on the host ring, retired chunks): timed, however short.
    assert records[0]["grad_sum_wait_s"] > 0 and records[1]["grad_sum_wait_s"] > 0
    assert records[2]["grad_sum_add_s"] == 0 and records[2]["grad_sum_wait_s"] == 0
    # A serial step drains the ring before it returns: every addition is in some step's record.
    assert sum(r["grad_sum_add_s"] for r in records) == pytest.approx(ring.added_seconds, rel=1e-9)
    assert sum(r["grad_sum_wait_s"] for r in records) == pytest.approx(ring.waited_seconds, rel=1e-9)
    opt.close()

    other = tiny_model()
    plain = OffloadOptimizer(other.named_parameters(), "torch.optim.AdamW", minimal_size=1000, lr=1e-2)
    train(other, plain, batches(num=2), grad_accum=2, clip=None, scale_grads=plain.scale_grads_,
          clip_grads=plain.clip_grad_norm_)
    assert not {"grad_sum_wait_s", "grad_sum_add_s"} & set(plain.step_timings())


def test_a_drain_holding_the_lock_counts_as_the_callers_wait(monkeypatch):
    """With overlap a host worker drains the ring while backward goes on; the hook's add_into then
    waits for the lock, not for a chunk, and that wait is the caller's too."""
    ring = StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=64, num_chunks=4)
    ended, draining, release = [], threading.Event(), threading.Event()

    def slow_add(dst, src):
        release.wait(timeout=10)  # until 20 ms after the training thread asked for the lock
        dst.add_(src)
        ended.append(time.perf_counter())

    def retire(index, retire=ring._retire):
        if threading.current_thread().name == "drainer":
            draining.set()  # inside drain_until, holding the lock
        retire(index)

    class EnteredLock:
        """The ring's lock, noting when the training thread asks for it while the drain holds it."""

        def __init__(self, lock):
            self.lock, self.asked = lock, []

        def __enter__(self):
            if threading.current_thread() is threading.main_thread() and draining.is_set():
                self.asked.append(time.perf_counter())
                threading.Timer(0.02, release.set).start()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(ring, "_add", slow_add)
    monkeypatch.setattr(ring, "_retire", retire)
    monkeypatch.setattr(ring, "_lock", EnteredLock(ring._lock))
    total = torch.zeros(16)
    ring.add_into(total, torch.ones(16))  # one piece, its chunk free: no wait for a chunk
    before = ring.waited_seconds
    drainer = threading.Thread(target=ring.drain, name="drainer")
    drainer.start()
    assert draining.wait(timeout=10)
    ring.add_into(total, torch.ones(16))  # another free chunk: only the lock holds it up
    # The drain held the lock until the first addition had ended, at least 20 ms after the caller
    # asked for it: the caller waited that long, however the threads were scheduled.
    assert ring.waited_seconds - before >= ended[0] - ring._lock.asked[-1] >= 0.02
    drainer.join()
    ring.close()
    assert torch.equal(total, torch.full((16,), 2.0))


def test_ring_allocates_only_when_used_and_checks_its_inputs():
    ring = StagingRing(TransferEngine(torch.device("cpu")), chunk_bytes=64, num_chunks=2)
    assert ring.nbytes == 0
    ring.drain()  # nothing pending: a no-op
    with pytest.raises(ValueError, match="into"):
        ring.add_into(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="num_chunks"):
        StagingRing(TransferEngine(torch.device("cpu")), num_chunks=0)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulation_with_offloaded_gradients_through_a_tiny_ring(clip, monkeypatch):
    # Chunks far smaller than the weights: every gradient is split, and the ring wraps many times.
    monkeypatch.setattr(staging, "CHUNK_BYTES", 256)
    monkeypatch.setattr(staging, "NUM_CHUNKS", 3)
    ref = tiny_model()
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                           minimal_size=1000, lr=1e-2, weight_decay=0.1)
    data = batches(num=4 * 3)
    ref_scale, ref_clip = plain_hooks(ref)
    ref_norms = train(ref, ref_opt, data, grad_accum=3, clip=clip, scale_grads=ref_scale, clip_grads=ref_clip)
    norms = train(model, opt, data, grad_accum=3, clip=clip, scale_grads=opt.scale_grads_,
                  clip_grads=opt.clip_grad_norm_)
    assert_same_params(ref, model, rtol=0, atol=0)
    assert norms == ref_norms

    report = opt.memory_report()
    offloaded = [s for s in opt._slots if s.offloaded]
    tensors = sum(
        t.numel() * t.element_size()
        for s in offloaded
        for t in s.optimizer.state[s.step_param].values()
        if isinstance(t, torch.Tensor)
    ) + sum(aligned_bytes(t.numel() * t.element_size()) for s in offloaded for t in (s.step_param, s.host_grad))
    # Parameter copies and gradient sums (page-aligned, a block each), states, plus the ring: no
    # second gradient buffer.
    assert report.host_bytes == tensors + 3 * 256
    assert max(s.host_grad.numel() * 4 for s in offloaded) > 3 * 256, "the ring must be smaller than a gradient"


# ------------------------------------------------------------- sums added on the device (grad_sum_on)

@pytest.mark.parametrize("dtype,sum_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("chunk_bytes", [64, 2**20])
def test_device_ring_sums_equal_in_order_adds_bit_for_bit(dtype, sum_dtype, chunk_bytes):
    ring = DeviceSumRing(TransferEngine(torch.device("cpu")), device=torch.device("cpu"), chunk_bytes=chunk_bytes,
                         num_chunks=3)
    assert ring.nbytes == 0 and ring.on_device and not StagingRing.on_device
    expected, got, tokens, num_shapes = _add_through(ring, dtype=dtype, sum_dtype=sum_dtype, chunk_bytes=chunk_bytes)
    ring.drain_until(tokens[num_shapes - 1])
    ring.drain()
    for e, gsum in zip(expected, got):
        assert torch.equal(gsum, e)
    assert tokens == sorted(tokens) and ring.issued == tokens[-1]
    assert ring.nbytes == 3 * chunk_bytes  # however many elements went through
    ring.close()
    assert ring.nbytes == 0
    with pytest.raises(ValueError, match="into"):
        ring.add_into(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="num_chunks"):
        DeviceSumRing(TransferEngine(torch.device("cpu")), device=torch.device("cpu"), num_chunks=0)



@pytest.mark.streams_as_is
@pytest.mark.parametrize("checked", [False, True], ids=["emulated", "checked streams"])
def test_device_ring_adds_a_group_in_packed_chunks_cutting_only_sums_longer_than_one(checked, monkeypatch):
    """add_many_and_measure: a hand-off group's sums packed into chunks, one upload, one addition and
    one download call a chunk; a sum that fits a chunk is never cut (it starts the next chunk
    instead), so its norm is tensor_norm's bits; a longer one is cut at chunk boundaries, as alone.
    The sums are add_'s, bit for bit, and each pair's token is that of the chunk holding its last piece."""
    g = torch.Generator().manual_seed(0)
    chunk_bytes = 256
    numels = [10, 30, 40, 3, 64, 150, 1, 2]  # float32: 64 elements a chunk
    adds, downloads = [], []
    foreach_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda dsts, srcs: adds.append(len(dsts)) or foreach_add(dsts, srcs))
    with checked_streams() if checked else contextlib.nullcontext():
        transfer = TransferEngine(torch.device("cpu"))
        timed_copies = transfer.timed_copies
        monkeypatch.setattr(transfer, "timed_copies", lambda dsts, srcs, **kw: downloads.append(
            sum(d.numel() * d.element_size() for d in dsts)) or timed_copies(dsts, srcs, **kw))
        ring = DeviceSumRing(transfer, device=torch.device("cpu"), chunk_bytes=chunk_bytes, num_chunks=3)
        sums = [stream_check.host_tensor(torch.randn(n, generator=g)) for n in numels]
        for _ in range(2):
            grads = [torch.randn(n, generator=g) for n in numels]
            expected = [t + grad for t, grad in zip(sums, grads)]
            before = ring.issued
            tokens, norms = ring.add_many_and_measure(list(zip(sums, grads)))
            ring.drain()
            for got, want in zip(sums, expected):
                assert torch.equal(got, want)
            # 10+30 | 40+3 | 64 | 150 cut 64+64+22, then 1+2 after it
            assert ring.issued - before == len(downloads) == 6
            assert downloads == [40 + 120, 160 + 12, 256, 256, 256, 88 + 4 + 8]  # bytes copied down
            assert tokens == [before + i for i in (1, 1, 2, 2, 3, 6, 6, 6)]
            for numel, norm, want in zip(numels, norms, expected):
                if numel <= 64:
                    assert torch.equal(norm, torch.linalg.vector_norm(want))
                else:
                    pieces = [torch.linalg.vector_norm(p, dtype=torch.float32) for p in want.split(64)]
                    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack(pieces)))
            downloads.clear()
        assert adds == [2, 2, 3] * 2  # one call a chunk of several pieces
        with pytest.raises(ValueError, match="after"):
            ring.add_many([(sums[0], grads[0])], after=[None, None])
        ring.close()

@pytest.mark.streams_as_is
@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checked", [False, True], ids=["emulated", "checked streams"])
def test_device_ring_measures_each_sum_it_leaves(sum_dtype, checked):
    """add_many_and_measure: the 2-norm of the sum the addition leaves, from the chunks. A sum within one
    chunk gives tensor_norm's bits; a longer one its pieces' float32 norms combined, rounded once.
    On streams the norm is read only after drain_until(token), as the engine's clipping reads it."""
    g = torch.Generator().manual_seed(0)
    with checked_streams() if checked else contextlib.nullcontext():
        ring = DeviceSumRing(TransferEngine(torch.device("cpu")), device=torch.device("cpu"), chunk_bytes=256,
                             num_chunks=3)
        per_chunk = 256 // sum_dtype.itemsize
        for numel in (1, per_chunk, per_chunk + 1, 5 * per_chunk - 3):
            total = stream_check.host_tensor(torch.randn(numel, generator=g).to(sum_dtype))
            grad = torch.randn(numel, generator=g).to(sum_dtype)
            expected = total + grad
            (token,), (norm,) = ring.add_many_and_measure([(total, grad)])
            ring.drain_until(token)
            assert torch.equal(total, expected) and norm.dtype == sum_dtype and norm.dim() == 0
            if numel <= per_chunk:
                assert torch.equal(norm, torch.linalg.vector_norm(expected))
            else:
                pieces = [torch.linalg.vector_norm(p, dtype=torch.float32) for p in expected.split(per_chunk)]
                assert torch.equal(norm, torch.linalg.vector_norm(torch.stack(pieces)).to(sum_dtype))
                torch.testing.assert_close(norm.float(), torch.linalg.vector_norm(expected.float()),
                                           rtol=1e-2 if sum_dtype == torch.bfloat16 else 1e-6, atol=0)
        ring.close()


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("overlap", [False, True])
def test_sums_added_on_the_device_land_without_a_host_pass_for_their_norms(where, overlap, monkeypatch):
    """With grad_sum_on=device the norm clipping needs of a later micro-batch's sum comes from the
    device ring; the host's 2-norm of a whole host sum (one core at torch's rate: 2.4 s a step for
    the 8B on the H100 host) is never taken. The host ring (where="host") still takes it, which shows
    the check sees such a pass."""
    measured_on_host = []
    original, original_many = host_grads.tensor_norm, host_grads.tensor_norms

    def spy(grad, **kwargs):
        measured_on_host.append(grad.data_ptr())
        return original(grad, **kwargs)

    def spy_many(grads):
        measured_on_host.extend(grad.data_ptr() for grad in grads)
        return original_many(grads)

    # The landing threads measure through host_grads' tensor_norms, a serial window's clip through grad_norm's.
    monkeypatch.setattr(host_grads, "tensor_norm", spy)
    monkeypatch.setattr(host_grads, "tensor_norms", spy_many)
    monkeypatch.setattr(grad_norm, "tensor_norm", spy)
    model = tiny_model()
    ref = twin(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = offload(model, overlap=overlap, offload_gradients=True, grad_sum_on=where)
    data = batches(num=9)
    norms = train_windows(model, opt, data, grad_accum=3, clip=0.5)
    ref_norms = train_windows(ref, ref_opt, data, grad_accum=3, clip=0.5)
    sums = {slot.host_grad.data_ptr() for slot in opt._table.slots if slot.offloaded}
    opt.close()
    assert bool(sums & set(measured_on_host)) is (where == "host")
    # Each weight's sum fits one chunk here: the device ring's norms are the host's bits, and
    # the clipped run is plain AdamW's, as with the host ring.
    assert norms == ref_norms and max(norms) > 0.5
    assert_same_params(ref, model, rtol=0, atol=0)


@pytest.mark.parametrize("grad_accum", [2, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("with_scheduler", [False, True])
def test_sums_on_the_device_match_plain_adamw(grad_accum, clip, with_scheduler):
    ref = tiny_model()
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                           grad_sum_on="device", minimal_size=1000, lr=1e-2, weight_decay=0.1)
    assert isinstance(opt._staging, DeviceSumRing)
    data = batches(num=4 * grad_accum)
    ref_scale, ref_clip = plain_hooks(ref)
    ref_norms = train(ref, ref_opt, data, grad_accum=grad_accum, clip=clip,
                      scheduler=cosine(ref_opt) if with_scheduler else None, scale_grads=ref_scale, clip_grads=ref_clip)
    norms = train(model, opt, data, grad_accum=grad_accum, clip=clip, scheduler=cosine(opt) if with_scheduler else None,
                  scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
    assert_same_params(ref, model, rtol=0, atol=0)
    assert norms == ref_norms
    if clip is not None:
        assert max(ref_norms) > clip, "the clip threshold must bite"
    assert opt._staging.nbytes > 0, "later micro-batches must have gone through the device ring"
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("grad_sum_dtype", [None, "fp32"])
@pytest.mark.parametrize("master_dtype", [None, "fp32"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_sums_on_the_device_give_the_host_rings_results_bit_for_bit(overlap, grad_sum_dtype, master_dtype, clip):
    base = tiny_model().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(num=9)]
    runs = {}
    for where in ("host", "device"):
        model = twin(base)
        opt = offload(model, overlap=overlap, offload_gradients=True, grad_sum_on=where,
                      grad_sum_dtype=grad_sum_dtype, master_dtype=master_dtype)
        ring = DeviceSumRing if where == "device" else StagingRing
        assert type(opt._staging) is ring, f"grad_sum_on={where} must add through the {ring.__name__}"
        runs[where] = (model, train_windows(model, opt, data, grad_accum=3, clip=clip))
        assert opt._staging.nbytes > 0, "later micro-batches must have gone through the ring"
        opt.close()
    assert runs["host"][1] == runs["device"][1]
    if clip is not None:
        assert max(runs["host"][1]) > clip, "the clip threshold must bite"
    assert_same_params(runs["host"][0], runs["device"][0], rtol=0, atol=0)
    if grad_sum_dtype is None and master_dtype is None:
        # Pure bf16, as the shipped 8B configs train: plain bf16 AdamW's bits, either ring.
        ref = twin(base)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        assert train_windows(ref, ref_opt, data, grad_accum=3, clip=clip) == runs["device"][1]
        assert_same_params(ref, runs["device"][0], rtol=0, atol=0)


def test_the_memory_report_counts_the_device_ring_on_the_device():
    """The device ring's chunks are device memory: the host holds no ring, and the report says so."""
    reports = {}
    for where in ("host", "device"):
        model = tiny_model()
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                               grad_sum_on=where, minimal_size=1000, lr=1e-2)
        train(model, opt, batches(num=2), grad_accum=2, clip=None, scale_grads=opt.scale_grads_,
              clip_grads=opt.clip_grad_norm_)
        assert opt._staging.nbytes > 0
        reports[where] = (opt.memory_report(), opt._staging.nbytes)
        opt.close()
    (host, host_ring), (device, device_ring) = reports["host"], reports["device"]
    assert device.device_staging_bytes == device_ring and host.device_staging_bytes == 0
    assert host.host_bytes == device.host_bytes + host_ring


@pytest.mark.parametrize("options,match", [
    (dict(grad_sum_on="gpu", offload_gradients=True), "grad_sum_on='gpu'"),
    (dict(grad_sum_on="device"), "offload_gradients=True"),
    (dict(grad_sum_on="device", offload_gradients=False, update_on="device"),
     r"optimizer\.update_on=device with optimizer\.grad_sum_on=device: .* Remove it \(~optimizer\.grad_sum_on\)"),
])
def test_grad_sum_on_refuses_what_cannot_work(options, match):
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer(tiny_model().named_parameters(), "torch.optim.AdamW", minimal_size=1000, **options)


@pytest.mark.streams_as_is
def test_device_ring_keeps_a_non_contiguous_gradients_flat_copy_until_the_device_read_it():
    """A gradient with a parameter's transposed strides is flattened into a copy on the compute
    stream; the additions on the download stream read that copy, so it is kept as the gradient is."""
    with checked_streams():
        transfer = TransferEngine(torch.device("cpu"))
        ring = DeviceSumRing(transfer, device=torch.device("cpu"), chunk_bytes=64, num_chunks=2)
        total = stream_check.host_tensor(torch.zeros(8, 6))
        grad = torch.randn(6, 8).t()
        expected = grad.contiguous()
        assert not grad.is_contiguous()
        ring.add_into(total, grad)
        del grad
        ring.drain()
        assert torch.equal(total, expected)
        ring.close()


def test_device_ring_chunks_hold_fp32_sums_of_odd_sized_bf16_parameters():
    """Chunks are sized from the largest host sum (fp32 here, twice the bf16 parameter) and rounded
    to 16 bytes, so any dtype can view them."""
    runs = {}
    for where in ("host", "device"):
        torch.manual_seed(0)
        model = nn.Linear(4097, 1, bias=False).to(torch.bfloat16)
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                               grad_sum_dtype="fp32", grad_sum_on=where, minimal_size=1000, lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(3):
                model(torch.randn(4, 4097, generator=g).to(torch.bfloat16)).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs[where] = model.weight.detach().clone()
        if where == "device":
            assert opt._staging.chunk_bytes % 16 == 0 and opt._staging.chunk_bytes >= 4097 * 4
        opt.close()
    assert torch.equal(runs["host"], runs["device"])

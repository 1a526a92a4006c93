"""A bounded landing area for gradients that are added into host sums.

With gradients offloaded during backward and accumulated, the first micro-batch's gradient is copied
straight into the parameter's host sum; every later one has to land somewhere on the host before it
can be added. A second full-size buffer per parameter would double the gradients' host memory (about
16 GB for an 8B model in bf16): later micro-batches go through a small ring of fixed-size pinned
chunks instead, copied chunk by chunk, each added into its sum by a host thread of the ring's own.

That thread adds in the order the chunks were issued, so each element's additions come in the order
of the micro-batches, as the device's own accumulation does: the same bits. Chunks go to it a few at
a time, once those waiting hold :data:`CHUNK_BYTES` or all but one of the ring's chunks, or one is
needed (waking the thread for each of a narrow model's part-filled chunks cost the launching thread
more than the additions). The training thread (adding; a host worker may drain at once) only issues
the copies, and waits only for a chunk still being added; on an H100 host the additions outlast a
batch-1 pass's GPU work, and :class:`DeviceSumRing` adds on the device instead (docs/accumulation.md).
Each addition is one pass of ``host_add.add_`` over all host cores (torch's ``add_`` of a bf16 chunk
into an fp32 sum converted the chunk first, 5 to 10 times slower).
"""

import collections
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_offload.optim.grad_norm import tensor_norms
from torchtune_offload.optim.host_arena import pinned_allocation_bytes
import torchtune_offload.optim.host_add as host_add
from torchtune_offload.optim.step_timings import profiled
import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.transfer import TransferEngine, copy_all

#: Bytes of one chunk, and how many chunks the ring holds: the bound on staging memory.
CHUNK_BYTES = 32 * 2**20
NUM_CHUNKS = 4
#: The most chunks a host ring of small chunks holds (see :func:`host_ring_chunks`).
MAX_CHUNKS = 16
#: Where in a chunk a piece may start: a multiple of this many bytes, so that any dtype views it.
CHUNK_ALIGN = 16


def host_ring_chunks(chunk_bytes: int) -> int:
    """How many chunks a :class:`StagingRing` of ``chunk_bytes`` chunks holds by default:
    :data:`NUM_CHUNKS`, and for chunks smaller than :data:`CHUNK_BYTES` (a model whose largest tensor
    is smaller) more, up to :data:`MAX_CHUNKS` and within the bytes of :data:`NUM_CHUNKS` full-size
    ones as pinned memory takes them (a power of two each), so that more wait to go to the adder together."""
    return max(NUM_CHUNKS, min(MAX_CHUNKS, NUM_CHUNKS * CHUNK_BYTES // pinned_allocation_bytes(chunk_bytes)))


def device_ring_bytes(*, largest_bytes: int) -> int:
    """The device bytes a :class:`DeviceSumRing` of the default size holds once used, for host sums
    of at most ``largest_bytes``."""
    return NUM_CHUNKS * DeviceSumRing.chunk_size(largest_bytes=largest_bytes)


def _torch_add(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _add_all(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dsts[i].add_(srcs[i])`` for each i, launched as one operation where there are several (the
    same roundings: each addition in float32, then to ``dsts[i]``'s dtype)."""
    if len(dsts) == 1:
        dsts[0].add_(srcs[0])
    else:
        torch._foreach_add_(dsts, srcs)


def _aligned(offset: int) -> int:
    """``offset`` rounded up to :data:`CHUNK_ALIGN`: where the next piece in a chunk starts, so that any dtype views it."""
    return -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN


class _Piece(NamedTuple):
    """Where one piece of a pair's tensors is staged: the pair's position in its call, the first
    element and the length of the piece, and its view of the chunk."""

    pair: int
    start: int
    length: int
    staged: torch.Tensor


class _ChunkRing:
    """What both rings share: a few chunks allocated on first use, cycled in order, and the tokens
    of the additions started through them."""

    #: Whether the chunks, and the additions, are on the device.
    on_device = False

    def __init__(self, transfer: TransferEngine, *, chunk_bytes: Optional[int], num_chunks: Optional[int],
                 largest_bytes: Optional[int]) -> None:
        chunk_bytes = self.chunk_size(chunk_bytes=chunk_bytes, largest_bytes=largest_bytes)
        num_chunks = NUM_CHUNKS if num_chunks is None else num_chunks
        if chunk_bytes < 16 or num_chunks < 1:
            raise ValueError(f"{type(self).__name__}: chunk_bytes={chunk_bytes} (>= 16), num_chunks={num_chunks} (>= 1)")
        self._transfer = transfer
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        # Allocated on first use: a run without accumulation never needs them.
        self._chunks: List[torch.Tensor] = []
        # Views of the chunks, made once: each as each dtype a piece of it was staged in (_typed),
        # and each piece staged in it by place, length and shape (_staged).
        self._views: Dict[tuple, torch.Tensor] = {}
        self._next = 0
        self._issued = 0
        # Seconds the add_into caller was held up inside it (the ring's lock, a chunk still being
        # added), and seconds the host's cores spent adding (cumulative; one writer of each: the
        # add_into caller, and the ring's adder thread or, without one, the add_into caller).
        self._waited_seconds = 0.0
        self._added_seconds = 0.0
        # Orders the add_into caller's use of a chunk, or of the ring's records, after another
        # thread's drain of them.
        self._lock = stream_check.HostLock()

    @staticmethod
    def chunk_size(*, chunk_bytes: Optional[int] = None, largest_bytes: Optional[int] = None) -> int:
        """The chunk size a ring takes: ``chunk_bytes`` (default :data:`CHUNK_BYTES`), at most ``largest_bytes``."""
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        return chunk_bytes if largest_bytes is None else max(16, min(chunk_bytes, largest_bytes))

    @property
    def num_allocated(self) -> int:
        """Chunks allocated so far (they are allocated on first use)."""
        return len(self._chunks)

    @property
    def issued(self) -> int:
        """The token of the newest addition started (see ``add_into``)."""
        return self._issued

    @property
    def waited_seconds(self) -> float:
        """Seconds the callers of ``add_into`` (the backward hooks) were held up inside it, since
        the ring was made: waiting for the ring's lock (a drain on another thread may hold it while
        it waits for additions) or for a chunk still in use. On an accelerator, time the backward's
        kernel launches stopped."""
        return self._waited_seconds

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the ring's lock for an ``add_into`` call, the wait for it counted as the caller's."""
        start = time.perf_counter()
        with contextlib.ExitStack() as held:
            with profiled("sum: wait for the ring's lock"):
                held.enter_context(self._lock)
            self._waited_seconds += time.perf_counter() - start
            yield

    @property
    def added_seconds(self) -> float:
        """Seconds the host's cores spent adding, since the ring was made (cumulative; complete for
        the additions finished by a :meth:`drain`): :class:`StagingRing`'s adder thread, the host
        work of a later micro-batch, which on an accelerator overlaps the device's (the copies are
        DMA there); none for :class:`DeviceSumRing`, whose additions are the device's."""
        return self._added_seconds

    @property
    def nbytes(self) -> int:
        """Bytes the ring holds: host memory (pinned on an accelerator), or device memory where
        :attr:`on_device`."""
        return len(self._chunks) * self.chunk_bytes

    def _check(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Refuses to add ``src`` into a ``dst`` of another shape (before anything is issued)."""
        if dst.shape != src.shape:
            raise ValueError(f"{type(self).__name__}.add_into: {src.dtype}{list(src.shape)} into "
                             f"{dst.dtype}{list(dst.shape)}")

    def _claim(self) -> int:
        """The next chunk in the ring, counted as a new addition (:attr:`issued`); each ring adds
        what must precede its reuse."""
        index = self._next
        self._next = (index + 1) % self.num_chunks
        self._issued += 1
        return index

    def _layout(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], dtypes: Sequence[torch.dtype],
                tokens: List[int], *, unbroken: bool) -> Iterator[Tuple[int, List[_Piece]]]:
        """Packs the pieces of each ``(dst, src)`` pair, staged as ``dtypes[i]``, into as few chunks as
        they fill, in order: yields each chunk's index and pieces once the chunk is full (claiming the
        next only after the caller has issued it), and appends each pair's token to ``tokens``.

        With ``unbroken``, a pair that does not fit in what is left of a chunk starts a new one: a
        pair that fits one chunk is one piece, and a longer one is cut at chunk boundaries."""
        index: Optional[int] = None
        used = 0
        pieces: List[_Piece] = []
        for number, ((_, src), dtype) in enumerate(zip(pairs, dtypes)):
            size, start, numel = dtype.itemsize, 0, src.numel()
            fresh = unbroken and used > 0 and _aligned(used) + numel * size > self.chunk_bytes
            while start < numel:
                offset = _aligned(used)
                if index is None or fresh or offset + size > self.chunk_bytes:
                    fresh = False
                    if pieces:
                        yield index, pieces
                    index, offset, pieces = self._claim(), 0, []
                length = min((self.chunk_bytes - offset) // size, numel - start)
                # A whole tensor is staged in its shape (fewer ops than flat slices of it and its sum).
                shape = src.shape if length == numel else None
                pieces.append(_Piece(number, start, length, self._staged(index, dtype, offset // size, length, shape)))
                used, start = offset + length * size, start + length
            tokens.append(self._issued)
        if pieces:
            yield index, pieces

    def _staged(self, index: int, dtype: torch.dtype, first: int, length: int,
                shape: Optional[torch.Size]) -> torch.Tensor:
        """Elements ``first`` to ``first + length`` of chunk ``index`` as ``dtype``, viewed as
        ``shape`` (if given), made once: a model's groups come back in the same layout every
        micro-batch, and a view kept costs the launching thread no op."""
        key = (index, dtype, first, length, shape)
        view = self._views.get(key)
        if view is None:
            view = self._typed(index, dtype)[first : first + length]
            view = self._views[key] = view if shape is None else view.view(shape)
        return view

    @staticmethod
    def _parts(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], piece: _Piece,
               flats: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ``(sum, gradient)`` parts a piece covers: the tensors themselves for a whole one,
        else slices of their flattened selves (made once per pair in ``flats``; a gradient that is
        not contiguous is flattened into a copy)."""
        dst, src = pairs[piece.pair]
        if piece.length == src.numel():
            return dst, src
        flat = flats.get(piece.pair)
        if flat is None:
            flat = flats[piece.pair] = (dst.view(-1), src.reshape(-1))
        return flat[0][piece.start : piece.start + piece.length], flat[1][piece.start : piece.start + piece.length]

    def _chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index``, allocated on first use; each ring says where."""
        raise NotImplementedError

    def _typed(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Chunk ``index`` viewed as ``dtype`` (its whole elements), made once: a piece staged in it
        is one slice of this, fewer ops on the launching thread than a view of the bytes."""
        typed = self._views.get((index, dtype))
        if typed is None:
            chunk = self._chunk(index)
            whole = chunk.numel() // dtype.itemsize * dtype.itemsize
            typed = self._views[index, dtype] = chunk[:whole].view(dtype)
        return typed

    def drain(self) -> None:
        """Finishes every addition started."""
        self.drain_until(None)

    def send(self) -> None:
        """Starts the additions issued and not yet started (the end of a backward); each ring says how."""

    def drain_until(self, token: Optional[int]) -> None:
        """Finishes the additions started up to the one ``add_into`` returned ``token`` for (every
        one if ``None``); each ring says how."""
        raise NotImplementedError


class StagingRing(_ChunkRing):
    """Adds device gradients into host tensors through a few reusable pinned chunks.

    Args:
        transfer: the engine's host/device copier.
        chunk_bytes: the size of one chunk, in bytes (default :data:`CHUNK_BYTES`).
        num_chunks: how many chunks may be in flight at once (default :func:`host_ring_chunks`).
        largest_bytes: the largest tensor that will pass through; chunks are no larger, so a
            small model keeps a small ring.
        fused_add: add with ``host_add.add_`` (default); False uses torch's ``add_``, the path
            before it, kept for ``scripts/bench/bench_accumulation.py`` to time side by side.
    """

    def __init__(self, transfer: TransferEngine, *, chunk_bytes: Optional[int] = None, num_chunks: Optional[int] = None,
                 largest_bytes: Optional[int] = None, fused_add: bool = True) -> None:
        if num_chunks is None:
            num_chunks = host_ring_chunks(self.chunk_size(chunk_bytes=chunk_bytes, largest_bytes=largest_bytes))
        super().__init__(transfer, chunk_bytes=chunk_bytes, num_chunks=num_chunks, largest_bytes=largest_bytes)
        self._add = host_add.add_ if fused_add else _torch_add
        # Per chunk: (sequence number, the addition's future, or None until its job is sent) until
        # the addition is joined.
        self._pending: List[Optional[Tuple[int, Optional[Future]]]] = [None] * self.num_chunks
        # Chunks issued whose additions are not yet sent to the adder thread (chunk index, the
        # pieces' (sum, staged) pairs, the copy's event), and their staged bytes.
        self._unsent: List[Tuple[int, List[Tuple[torch.Tensor, torch.Tensor]], object]] = []
        self._unsent_bytes = 0
        # One thread, so the additions run in the order they were issued (started on first use);
        # it is the only writer of _added_seconds, read after a drain (which orders the writes).
        self._adder: Optional[ThreadPoolExecutor] = None

    def _chunk(self, index: int) -> torch.Tensor:
        while len(self._chunks) <= index:
            self._chunks.append(self._transfer.host_empty_like(torch.empty(self.chunk_bytes, dtype=torch.uint8)))
        return self._chunks[index]

    def _finish(self, chunks: List[Tuple[List[Tuple[torch.Tensor, torch.Tensor]], object]]) -> None:
        """On the adder thread: each chunk in order, its copy waited for, then its pieces added into their sums."""
        for pieces, event in chunks:
            with profiled("sum: wait for chunk copy"):
                self._transfer.wait(event)
            start = time.perf_counter()
            with profiled("sum: add"):
                for dst, staged in pieces:
                    self._add(dst, staged)
            self._added_seconds += time.perf_counter() - start

    def send(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        """Sends the additions of the chunks issued so far to the adder thread, as one job."""
        if not self._unsent:
            return
        if self._adder is None:
            self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-staging-add")
        future = stream_check.submit(self._adder, self._finish, [(work, event) for _, work, event in self._unsent])
        for index, _, _ in self._unsent:
            self._pending[index] = (self._pending[index][0], future)
        self._unsent, self._unsent_bytes = [], 0

    def _retire(self, index: int) -> None:
        """Waits for the chunk's addition (sent first if it waits to be sent; its error raised)."""
        if self._pending[index] is not None and self._pending[index][1] is None:
            self._send()
        pending, self._pending[index] = self._pending[index], None
        if pending is not None:
            pending[1].result()

    @torch.no_grad()
    def add_into(self, dst: torch.Tensor, src: torch.Tensor, *, after: Optional[object] = None) -> int:
        """Starts adding device tensor ``src`` into host tensor ``dst``; :meth:`drain` finishes it.

        Args:
            dst: a contiguous host tensor (a gradient sum).
            src: a device tensor of the same shape (the sum may be kept in a wider dtype); the
                caller may drop it at once.
            after: the event of the copy that last wrote ``dst``, if any: no wait here, as that copy ran
                before this ring's on their stream, and its additions wait for their copies.

        Returns:
            A token for :meth:`drain_until`: the addition is complete once that returns.
        """
        del after  # see above
        return self.add_many([(dst, src)])[0]

    @torch.no_grad()
    def add_many(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[int]:
        """:meth:`add_into` of each ``(dst, src)`` (a hand-off group's gradients), packed into as
        few chunks as they fill (per chunk one copy call and one event), under one hold of the ring's lock.

        Returns:
            Each pair's token for :meth:`drain_until`.
        """
        for dst, src in pairs:
            self._check(dst, src)
        with self._locked():
            return self._add_many(pairs)

    def _claim(self) -> int:
        """The next chunk, once its previous addition is done (the wait counted as the caller's)."""
        index = super()._claim()
        start_wait = time.perf_counter()
        with profiled("sum: wait for a chunk"):
            self._retire(index)
        self._waited_seconds += time.perf_counter() - start_wait
        return index

    def _add_many(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[int]:
        """Per chunk of the pairs' pieces: one copy call down into it and one event; the additions go
        to the adder thread once :data:`CHUNK_BYTES` or all but one chunk wait (or one is needed)."""
        tokens: List[int] = []
        flats: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for index, pieces in self._layout(pairs, [src.dtype for _, src in pairs], tokens, unbroken=False):
            parts = [self._parts(pairs, piece, flats) for piece in pieces]
            event = self._transfer.to_host_many([piece.staged for piece in pieces], [src for _, src in parts],
                                                release_source=True)
            self._unsent.append((index, [(dst, piece.staged) for (dst, _), piece in zip(parts, pieces)], event))
            self._unsent_bytes += sum(piece.staged.nbytes for piece in pieces)
            self._pending[index] = (self._issued, None)
            if self._unsent_bytes >= CHUNK_BYTES or len(self._unsent) >= self.num_chunks - 1:
                self._send()
        return tokens

    def drain_until(self, token: Optional[int]) -> None:
        """Finishes the additions started up to the one :meth:`add_into` returned ``token`` for
        (every one if ``None``), oldest first."""
        with self._lock:
            for offset in range(self.num_chunks):
                index = (self._next + offset) % self.num_chunks
                pending = self._pending[index]
                if pending is not None and token is not None and pending[0] > token:
                    break
                self._retire(index)

    def close(self) -> None:
        """Finishes every addition started and stops the adder thread (a later use starts a new one)."""
        self.drain()
        with self._lock:
            if self._adder is not None:
                self._adder.shutdown(wait=True)
                self._adder = None


class DeviceSumRing(_ChunkRing):
    """Adds device gradients into host sums *on the device* (``OffloadOptimizer(grad_sum_on="device")``).

    Per chunk of a later micro-batch's gradient, the host sum's chunk goes up into a device chunk
    (upload stream), the gradient chunk is added there and the result comes back down into the host
    sum (download stream): the host's cores do nothing, and its memory moves two bytes per sum byte
    (the DMA's read and write) where :class:`StagingRing` moves four; the PCIe link carries the sum
    both ways at once. The device rounds as torch's host ``add_`` does (one float32 addition, then the
    sum's dtype): the same bits. Every order is a stream wait; the host waits only in :meth:`drain_until`.

    Args:
        transfer: the engine's host/device copier (its download stream copies down and adds, its
            upload stream copies up).
        device: the device the chunks live on.
        chunk_bytes: the size of one chunk, in bytes (default :data:`CHUNK_BYTES`).
        num_chunks: how many chunks are in flight at once (default :data:`NUM_CHUNKS`).
        largest_bytes: the largest host sum that will pass through (in the sum's dtype); chunks are
            no larger, rounded up to 16 bytes so that any dtype can view them.
    """

    on_device = True

    def __init__(self, transfer: TransferEngine, *, device: torch.device, chunk_bytes: Optional[int] = None,
                 num_chunks: Optional[int] = None, largest_bytes: Optional[int] = None) -> None:
        super().__init__(transfer, chunk_bytes=chunk_bytes, num_chunks=num_chunks, largest_bytes=largest_bytes)
        self._device = torch.device(device)
        # Per chunk: the event of the download that last read it (its next upload waits for it).
        self._read_down: List[Optional[object]] = [None] * self.num_chunks
        # Per host sum (its data pointer): the event of the last download into it.
        self._written: Dict[int, object] = {}
        # (token, download event) of the additions not yet waited for, oldest first.
        self._pending: Deque[Tuple[int, Optional[object]]] = collections.deque()

    @staticmethod
    def chunk_size(*, chunk_bytes: Optional[int] = None, largest_bytes: Optional[int] = None) -> int:
        """:meth:`StagingRing.chunk_size` rounded up to 16 bytes: the chunks hold pieces of sums
        that may be wider than the gradients the size was taken from, and any dtype must view them."""
        return -(-_ChunkRing.chunk_size(chunk_bytes=chunk_bytes, largest_bytes=largest_bytes) // 16) * 16

    def _chunk(self, index: int) -> torch.Tensor:
        while len(self._chunks) <= index:
            self._chunks.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self._device))
            # Allocated on the compute stream, whose queued kernels may still use the memory
            # the allocator hands out: the upload that first writes it comes after them.
            self._transfer.uploads_wait_for_compute()
        return self._chunks[index]

    @torch.no_grad()
    def add_into(self, dst: torch.Tensor, src: torch.Tensor, *, after: Optional[object] = None) -> int:
        """Starts adding device tensor ``src`` into host tensor ``dst`` on the device;
        :meth:`drain` finishes it.

        Args:
            dst: a contiguous host tensor (a gradient sum), page-locked on an accelerator.
            src: a device tensor of the same shape, made on the current stream; the caller may
                drop it at once.
            after: the event of a copy that last wrote ``dst`` outside this ring (the window's
                first micro-batch), if any: the first upload waits for it.

        Returns:
            A token for :meth:`drain_until`: the addition is in ``dst`` once that returns.
        """
        return self.add_many([(dst, src)], after=[after])[0]

    @torch.no_grad()
    def add_many(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], *,
                 after: Optional[Sequence[Optional[object]]] = None) -> List[int]:
        """:meth:`add_into` of each ``(dst, src)`` (a hand-off group's gradients, ``after[i]`` the
        event of ``dst``'s last writer outside this ring, if any), packed into as few chunks as they
        fill: per chunk one upload call, one addition call and one download call.

        Returns:
            Each pair's token for :meth:`drain_until`.
        """
        return self._add_checked(pairs, after, measure=False)[0]

    @torch.no_grad()
    def add_many_and_measure(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], *,
                             after: Optional[Sequence[Optional[object]]] = None
                             ) -> Tuple[List[int], List[torch.Tensor]]:
        """:meth:`add_many`, and the 2-norm of each sum it leaves, measured on the device from the
        chunks as the additions leave them, without a pass over the host sums (on an H100's host, torch's
        2-norm of 16 GB of bf16 sums took 2.4 s a step on one core, docs/gpu_results.md). A sum that fits
        one chunk is measured as :func:`tensor_norm` measures the host sum (a chunk's whole sums in one
        :func:`tensor_norms` call); a longer one from its pieces' norms, combined in float32 and rounded
        to the sum's dtype once. A GPU reduces in another order than the host: the norm may differ from
        the host ring's in the last bits; the sums do not.

        Returns:
            ``(tokens, norms)``: the tokens as :meth:`add_many`'s; each norm a 0-dim device tensor, ready
            for the host once :meth:`drain_until` of its token returns (on the device, for any stream after).
        """
        return self._add_checked(pairs, after, measure=True)

    def _add_checked(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                     after: Optional[Sequence[Optional[object]]], *, measure: bool) -> Tuple[List[int], List]:
        after = [None] * len(pairs) if after is None else list(after)
        if len(after) != len(pairs):
            raise ValueError(f"{type(self).__name__}.add_many: {len(after)} events after for {len(pairs)} pairs")
        for dst, src in pairs:
            self._check(dst, src)
        with self._locked():
            return self._add_many(pairs, after, measure=measure)

    def _add_many(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], after: List[Optional[object]], *,
                  measure: bool) -> Tuple[List[int], List]:
        transfer, order = self._transfer, self._transfer.order
        up, down = transfer.h2d_stream, transfer.stream
        # The sums' last writers, before their first chunk goes up.
        for (dst, _), first in zip(pairs, after):
            for event in (first, self._written.get(dst.data_ptr())):
                order.wait_event(up, event)
        tokens: List[int] = []
        norms: List[Optional[torch.Tensor]] = [None] * len(pairs)
        split_norms: Dict[int, List[torch.Tensor]] = {}  # a split sum's pieces' norms so far
        flats: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # a split pair's flattened tensors
        # Unbroken: a sum's norm is that of its pieces, which the host's does not equal where
        # it need not be cut.
        for index, pieces in self._layout(pairs, [dst.dtype for dst, _ in pairs], tokens, unbroken=True):
            parts = [self._parts(pairs, piece, flats) for piece in pieces]
            hosts, grads = [host for host, _ in parts], [grad for _, grad in parts]
            chunks = [piece.staged for piece in pieces]
            # The chunk's previous download must have read it before this upload overwrites it.
            order.wait_event(up, self._read_down[index])
            with order.on(up):
                copy_all(chunks, hosts)
            order.wait_event(down, order.record(up))
            # The gradients are made on the compute stream (a flat copy of a split one just now).
            order.wait_stream(down, order.current())
            with order.on(down), profiled("sum: add"):
                _add_all(chunks, grads)
                if measure:
                    # A sum's norm is complete before its last piece's download: the event the host
                    # waits for in drain_until comes after it.
                    self._measure(pairs, pieces, norms, split_norms)
            end = transfer.timed_copies(hosts, chunks, kind="grad", stream=down)
            self._read_down[index] = end
            self._pending.append((self._issued, end))
            for piece in pieces:
                self._written[pairs[piece.pair][0].data_ptr()] = end
        # The caller drops the gradients (and a flat copy of one that was not contiguous): keep the
        # memory the additions read until they have read it.
        for read in [src for _, src in pairs] + [flat for _, flat in flats.values()]:
            order.keep_for(read, down)
        for norm in norms if measure else ():
            # Made on the download stream, read on the compute stream (clipping): its memory
            # waits for that reader before the allocator hands it out again.
            order.keep_for(norm, order.current())
        return tokens, norms

    @staticmethod
    def _measure(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], pieces: List[_Piece],
                 norms: List[Optional[torch.Tensor]], split_norms: Dict[int, List[torch.Tensor]]) -> None:
        """The pieces of one chunk, just added: each whole sum's norm into ``norms``, a split sum's
        piece norm kept in ``split_norms`` and, at its last piece, the sum's norm from them (see
        :meth:`add_many_and_measure`)."""
        whole = [piece for piece in pieces if piece.length == pairs[piece.pair][1].numel()]
        for piece, norm in zip(whole, tensor_norms([piece.staged for piece in whole])):
            norms[piece.pair] = norm
        for piece in pieces:
            dst, src = pairs[piece.pair]
            if piece.length == src.numel():
                continue
            parts = split_norms.setdefault(piece.pair, [])
            parts.append(torch.linalg.vector_norm(piece.staged, dtype=torch.float32))
            if piece.start + piece.length == src.numel():
                norms[piece.pair] = torch.linalg.vector_norm(torch.stack(parts)).to(dst.dtype)

    def drain_until(self, token: Optional[int]) -> None:
        """Blocks the host until the additions started up to the one :meth:`add_into` returned
        ``token`` for (every one if ``None``) are in their host sums."""
        with self._lock:
            newest = None
            for entry in self._pending:
                if token is not None and entry[0] > token:
                    break
                newest = entry
        if newest is None:
            return
        # The downloads run in order on one stream: the newest one's end is all of theirs. Waited
        # for outside the lock, so that the training thread's next additions are not held up.
        self._transfer.wait(newest[1])
        with self._lock:
            while self._pending and self._pending[0][0] <= newest[0]:
                self._pending.popleft()

    def close(self) -> None:
        """Finishes every addition started and frees the chunks (a later use allocates them again)."""
        self.drain()
        with self._lock:
            self._chunks.clear()
            self._views.clear()
            self._read_down = [None] * self.num_chunks
            self._written.clear()

"""Chunked, multi-threaded coding into frames (``format/frames.py``), and decoding them.

Encoding reads the source memory chunk by chunk (no copy of the tensor).
:func:`encode_items` codes a *stream* of items: it keeps up to ``window``
chunks in flight in the pool, taken from the item being written and the items
after it, so small tensors (most are one chunk or less) are coded in parallel
and ahead of the writer, and yields each item's framed bytes in order. The
consuming thread codes too, whenever it would otherwise wait: the pool and the
consumer share a :class:`Backlog` of chunk codings, and whoever is free runs
the oldest one not yet started. Memory is bounded by the window, never by an
item's size. Codecs write each payload into a buffer the pipeline hands them
(``Codec.encode_into``); with a :class:`BufferPool` those buffers are reused
instead of allocated per chunk.

Decoding (:func:`decode_frames`) reads chunk records through a callback, checks
each chunk's checksum and bounds against the trusted sizes from the manifest,
and writes each chunk straight into its slice of the destination, chunk by
chunk on a thread pool. zstd and numpy release the GIL, so threads really
overlap.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import xxhash

from ..errors import TIMEOUT_ENV, WaitTimeoutError, timeout_s
from ..format import frames
from ..format.tensor_bytes import pieces
from .base import MIN_CODED_BYTES, Codec
from .delta import DELTA_SURE, xor_into

__all__ = [
    "BufferPool",
    "EncodeJob",
    "ReferenceSource",
    "decode_frames",
    "encode_chunk",
    "encode_frames",
    "encode_items",
]


Part = bytes | memoryview


class BufferPool:
    """Payload buffers reused across chunks (thread-safe).

    Every chunk needs a payload buffer about its size; a fresh one per chunk
    (0.25-1 MiB) is mapped, page-faulted and unmapped by the allocator each
    time, which takes a large share of the coding time and serializes the
    coding threads. Keeps at most ``keep_bytes`` of idle buffers.
    """

    def __init__(self, keep_bytes: int = 32 << 20) -> None:
        self._free: list[np.ndarray] = []
        self._kept = 0
        self._keep = keep_bytes
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """An idle buffer of ``size`` to ``2 * size`` bytes, else a new one (uninitialized)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if size <= len(buf) <= 2 * size:
                    self._kept -= len(buf)
                    return self._free.pop(i)
        return _empty(size)

    def give(self, buf: np.ndarray) -> None:
        """Hand ``buf`` back once nothing reads it any more."""
        with self._lock:
            if self._kept + len(buf) <= self._keep:
                self._free.append(buf)
                self._kept += len(buf)


def _empty(size: int) -> np.ndarray:
    # Not a bytearray: that zero-fills memory every payload overwrites anyway.
    return np.empty(size, dtype=np.uint8)


def encode_chunk(
    codec: Codec,
    chunk: memoryview,
    width: int,
    rotate: int,
    buffers: BufferPool | None = None,
    into: memoryview | None = None,
    ref: memoryview | Callable[[memoryview], None] | None = None,
    sure: float = DELTA_SURE,
) -> tuple[bytes, Part, np.ndarray | None]:
    """One framed chunk: ``(record, payload, buffer)``.

    The payload is raw (a view of ``chunk``) when coding does not pay, else a
    view of where it was coded: ``into`` when given (at least
    ``codec.payload_bound`` bytes; buffer None), else ``buffer``, taken from
    ``buffers`` (to give back once the payload is consumed) or fresh.
    ``ref``: the reference's raw bytes at the same place (as long as
    ``chunk``), or a function that writes them into a buffer (called here, on
    the coding thread): the chunk is then also coded as a delta against them, and the
    smallest of raw, coded and delta is kept (``delta.py``); a delta coded
    to at most ``sure`` of the chunk's size is kept without coding it whole.
    """
    if ref is not None and len(chunk) >= MIN_CODED_BYTES:
        return _encode_delta_chunk(codec, chunk, width, rotate, buffers, ref, sure)
    buf = None
    if len(chunk) < MIN_CODED_BYTES:  # an item's short tail, or a tool's tiny tensor
        n = None
    else:
        if into is None:
            size = codec.payload_bound(len(chunk), width)
            buf = buffers.take(size) if buffers is not None else _empty(size)
            into = memoryview(buf)
        n = codec.encode_into(chunk, width, rotate, into)
    if n is None or n >= len(chunk):  # coded but no smaller: raw reads faster
        if buffers is not None and buf is not None:
            buffers.give(buf)
        method, payload, buf = frames.METHOD_RAW, chunk, None
    else:
        method, payload = frames.METHOD_CODED, into[:n]  # type: ignore[index]
    return _framed(method, len(chunk), payload), payload, (buf if buffers is not None else None)


def _encode_delta_chunk(
    codec: Codec,
    chunk: memoryview,
    width: int,
    rotate: int,
    buffers: BufferPool | None,
    ref: memoryview | Callable[[memoryview], None],
    sure: float,
) -> tuple[bytes, Part, np.ndarray | None]:
    """:func:`encode_chunk` with a reference: the smallest of raw, delta and whole coding."""
    take = buffers.take if buffers is not None else _empty
    give = buffers.give if buffers is not None else (lambda buf: None)
    size = codec.payload_bound(len(chunk), width)
    scratch = take(len(chunk))
    diff = memoryview(scratch)[: len(chunk)]
    if callable(ref):  # the reference's bytes straight into the buffer of the XOR
        ref(diff)
        xor_into(chunk, diff, diff)
    else:
        xor_into(chunk, ref, diff)
    delta = take(size)
    n = codec.encode_into(diff, width, rotate, memoryview(delta))
    give(scratch)
    # (method, payload length, buffer holding it): raw unless a coding is smaller.
    best: tuple[int, int, np.ndarray | None] = (frames.METHOD_RAW, len(chunk), None)
    coded = [(frames.METHOD_DELTA, n, delta)]
    if n is None or n > sure * len(chunk):  # coding it whole might be smaller
        whole = take(size)
        m = codec.encode_into(chunk, width, rotate, memoryview(whole))
        coded.append((frames.METHOD_CODED, m, whole))
    for method, length, buf in coded:
        if length is not None and length < best[1]:
            best = (method, length, buf)
    for _, _, buf in coded:
        if buf is not best[2]:
            give(buf)
    method, n, buf = best
    if buf is None:
        return _framed(method, len(chunk), chunk), chunk, None
    payload = memoryview(buf)[:n]
    return _framed(method, len(chunk), payload), payload, (buf if buffers is not None else None)


def _framed(method: int, raw_len: int, payload: Part) -> bytes:
    """The chunk record for ``payload``."""
    return frames.pack_chunk(method, raw_len, len(payload), xxhash.xxh3_64_intdigest(payload))


class ReferenceSource(Protocol):
    """The reference's raw bytes of one item, in order (``checkpoint/reference.py``).

    The pipeline calls ``take_into`` or ``skip`` once per chunk, in chunk order, on
    the thread that submits chunks, then ``finish`` (which raises if the
    reference's bytes were not what they should be: the item must not be
    stored then). It sets ``used`` when a chunk was stored as a delta.
    """

    used: bool
    #: What the reference item's own coding achieved (stored / raw), or None:
    #: a delta at least that small is kept without coding the chunk whole too.
    ratio: float | None

    def take_into(self, n: int) -> Callable[[memoryview], None]:
        """Read the next ``n`` raw bytes' worth now, in order; the function returned
        writes them into the ``n``-byte buffer it is given, so the coding or
        decoding thread that calls it does the decoding, with no buffer of its own."""
        ...

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` raw bytes."""
        ...

    def finish(self) -> None:
        """Every byte was taken or skipped: check what was read."""
        ...


@dataclass(frozen=True)
class EncodeJob:
    """One item to store: ``layout`` ``(width, rotate)`` to frame it, or None to store it as is.

    ``name`` says what the item is in error notes (e.g. ``"item 'w' of data/0-0.bin"``).
    ``reference``: the same item's bytes in a reference checkpoint (framed
    items only): each chunk may then be stored as a delta against them.
    ``observe``: called with each raw chunk of a framed item just before it is
    coded, on the coding thread (the bytes are then in cache for the coder).
    ``count_rule``: the caller's, carried along (how it inspects a raw item).
    """

    key: Any
    view: memoryview
    layout: tuple[int, int] | None
    name: str = "item"
    reference: ReferenceSource | None = None
    observe: Callable[[memoryview], None] | None = None
    count_rule: Any = None


@dataclass
class _Item:
    job: EncodeJob
    starts: range
    next_chunk: int = 0  # first chunk not yet submitted
    tasks: deque[Task] = field(default_factory=deque)

    @property
    def submitted_all(self) -> bool:
        return self.next_chunk == len(self.starts)


def encode_items(
    jobs: Iterable[EncodeJob],
    codec: Codec | None,
    *,
    chunk_size: int,
    pool: Executor | None,
    window: int,
    buffers: BufferPool | None = None,
) -> Iterator[tuple[EncodeJob, Iterator[Part]]]:
    """Yield ``(job, parts)`` per job, in order; ``parts`` are the bytes to store.

    ``pool`` holds the worker threads besides the consuming one, which codes
    the oldest chunk not yet started whenever it would wait for one: a pool
    of ``threads - 1`` workers makes ``threads`` coding threads. Without a
    pool, every chunk is coded in the consuming thread.
    Each ``parts`` iterator must be consumed before the next item is taken.
    With ``buffers``, payload buffers are reused: a part is valid only until
    the next one is pulled, so the consumer must write or copy each part first
    (as a file's ``write`` does); without, parts stay valid.
    ``jobs`` is pulled lazily, while the items queued behind the one being
    consumed hold under ``window`` chunks' worth of bytes (what the caller
    does to produce a job, e.g. DCP's ``resolve_data``, runs in the consuming
    thread). An error from a job or a chunk is raised by the ``parts`` (or
    the iteration) where it surfaces; chunks not yet started are then dropped.
    """
    source = iter(jobs)
    backlog = Backlog(pool) if pool is not None else None
    queue: deque[_Item] = deque()  # items taken from ``source`` and not yet consumed
    feed = 0  # index in ``queue`` of the first item with chunks left to submit
    in_flight = 0  # submitted chunks not yet taken by the consumer
    behind = 0  # bytes of the items queued behind the one being consumed
    exhausted = False
    # Bounded in bytes, not items: most items of a model are biases and norms
    # with nothing to code, and a bound of ``window`` items left two or three
    # small chunks in flight between MiniLM's layers (seen in a trace).
    lookahead = window * max(chunk_size, MIN_CODED_BYTES)

    def take(job: EncodeJob) -> None:
        nonlocal behind
        if queue:
            behind += len(job.view)
        queue.append(_item(job, chunk_size))

    def fill() -> None:
        """Submit chunks, in item order, until ``window`` are in flight."""
        nonlocal feed, in_flight, exhausted
        while pool is not None and in_flight < window:
            if feed == len(queue):
                # Also bounds what items resolved ahead hold (a planner may copy).
                if exhausted or behind >= lookahead:
                    return
                job = next(source, None)
                if job is None:
                    exhausted = True
                    return
                take(job)
                continue
            item = queue[feed]
            if item.submitted_all:
                feed += 1
                continue
            start = item.starts[item.next_chunk]
            width, rotate = item.job.layout  # type: ignore[misc]  # framed items only
            chunk = item.job.view[start : start + item.starts.step]
            ref = _reference_chunk(item, item.next_chunk, len(chunk))
            args = (codec, chunk, width, rotate, buffers, None, ref, _sure(item.job))
            code = _observed(item.job.observe)
            item.tasks.append(backlog.submit(code, *args))  # type: ignore[union-attr]
            item.next_chunk += 1
            in_flight += 1

    def parts(item: _Item) -> Iterator[Part]:
        nonlocal in_flight
        view, layout = item.job.view, item.job.layout
        if layout is None:
            yield from pieces(view)
            return
        width, rotate = layout
        step = item.starts.step
        yield frames.pack_header(width, rotate, step, len(view))
        for index, start in enumerate(item.starts):
            if pool is not None:
                if index == item.next_chunk:  # not submitted yet: this item is the one fed
                    fill()
                task = item.tasks.popleft()
                in_flight -= 1
                fill()  # keep the pool busy while this chunk is waited for and written
            try:
                if pool is None:
                    chunk = view[start : start + step]
                    ref = _reference_chunk(item, index, len(chunk))
                    args = (codec, chunk, width, rotate, buffers, None, ref, _sure(item.job))
                    record, payload, buf = _observed(item.job.observe)(*args)  # type: ignore[arg-type]
                else:
                    record, payload, buf = backlog.result(task)  # type: ignore[union-attr]
            except Exception as e:
                e.add_note(f"while coding chunk {index} of {item.job.name}")
                raise
            if record[0] == frames.METHOD_DELTA:
                item.job.reference.used = True  # type: ignore[union-attr]
            yield record
            yield payload
            if buf is not None:  # the consumer is done with the payload: reuse its buffer
                del payload
                buffers.give(buf)  # type: ignore[union-attr]
        yield frames.pack_chunk(frames.METHOD_RAW, 0, 0, 0)

    try:
        while True:
            fill()
            if not queue:
                job = None if exhausted else next(source, None)
                if job is None:
                    return
                take(job)
            item = queue[0]
            yield item.job, parts(item)
            queue.popleft()
            if queue:
                behind -= len(queue[0].job.view)
            feed = max(0, feed - 1)
    finally:
        if backlog is not None:
            backlog.cancel()


def _observed(observe: Callable[[memoryview], None] | None) -> Callable[..., Any]:
    """:func:`encode_chunk`, calling ``observe`` with the raw chunk first (when given)."""
    if observe is None:
        return encode_chunk

    def code(codec: Codec, chunk: memoryview, *rest: Any) -> tuple[bytes, Part, np.ndarray | None]:
        observe(chunk)
        return encode_chunk(codec, chunk, *rest)

    return code


def _sure(job: EncodeJob) -> float:
    """Up to which share of a chunk's size its delta is kept without coding it whole:
    what the reference's own coding of the item achieved, at least DELTA_SURE."""
    ratio = None if job.reference is None else job.reference.ratio
    return DELTA_SURE if ratio is None else max(DELTA_SURE, ratio)


def _reference_chunk(item: _Item, index: int, n: int) -> Callable[[memoryview], None] | None:
    """The reference's bytes for the item's chunk ``index`` (``n`` bytes), or None.

    Called once per chunk in chunk order; after the last one the reference
    is finished (checked), so an item whose reference was bad fails here,
    before its last chunk is stored.
    """
    source = item.job.reference
    if source is None:
        return None
    if n >= MIN_CODED_BYTES:
        ref = source.take_into(n)
    else:  # a short tail is stored raw (encode_chunk)
        source.skip(n)
        ref = None
    if index == len(item.starts) - 1:
        source.finish()
    return ref


def _item(job: EncodeJob, chunk_size: int) -> _Item:
    if job.layout is None:
        return _Item(job, range(0))
    size = chunk_size - chunk_size % job.layout[0]
    return _Item(job, range(0, len(job.view), size))


def encode_frames(
    view: memoryview,
    codec: Codec,
    *,
    width: int,
    rotate: int,
    chunk_size: int,
    pool: Executor | None,
    window: int,
    buffers: BufferPool | None = None,
    reference: ReferenceSource | None = None,
) -> Iterator[Part]:
    """Yield the framed encoding of one item (header, chunks, terminator), in order.

    ``buffers``: as for :func:`encode_items` (parts then valid until the next).
    ``reference``: as :class:`EncodeJob`'s.
    """
    job = EncodeJob(None, view, (width, rotate), reference=reference)
    coded = encode_items(
        [job], codec, chunk_size=chunk_size, pool=pool, window=window, buffers=buffers
    )
    for _, parts in coded:
        yield from parts


class Task:
    """One call to run, by a pool thread or by the consumer, whichever comes first."""

    __slots__ = ("args", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        # Everything, as concurrent.futures does: the consumer raises it where it surfaces.
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.done.set()


class Backlog:
    """Chunks submitted and not yet started, taken oldest first by pool threads and the consumer.

    Whenever the consumer would wait for a chunk, it codes the oldest chunk
    no thread has started instead. With a pool of ``threads`` workers and a
    consumer that only waited and wrote, one thread more than the coding
    threads was runnable. With as many cores as coders, a pool of one thread
    fewer plus a consumer that codes keeps every core coding and none waiting
    for one: it saves checkpoints somewhat faster than a full pool beside a
    consumer that waits, and a full pool beside a coding consumer is no
    faster than that (``benchmarks/bench_codecs.py`` times the saves).
    """

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._tasks: deque[Task] = deque()
        self._lock = threading.Lock()
        self._bound = timeout_s()  # read once: result() runs per chunk

    def submit(self, fn: Callable[..., Any], *args: Any) -> Task:
        """Queue ``fn(*args)``; a pool thread or :meth:`result` runs it."""
        task = Task(fn, args)
        with self._lock:
            self._tasks.append(task)
        self._pool.submit(self._run_oldest)
        return task

    def _take_oldest(self) -> Task | None:
        with self._lock:
            return self._tasks.popleft() if self._tasks else None

    def _run_oldest(self) -> None:
        task = self._take_oldest()
        if task is not None:  # else the consumer took it, or the coding was cancelled
            task.run()

    def result(self, task: Task) -> Any:
        """``task``'s result (or error); runs it here when no thread has started it."""
        # Code the oldest chunks not yet started (``task`` first, if it is one)
        # rather than wait for ``task``.
        while not task.done.is_set():
            other = self._take_oldest()
            if other is None:  # a pool thread runs it
                if not task.done.wait(self._bound):
                    raise WaitTimeoutError(
                        f"a coding thread has not finished its chunk after {self._bound:g} s "
                        f"({TIMEOUT_ENV}); the codec's call never returned"
                    )
                break
            other.run()
        if task.error is not None:
            raise task.error
        return task.result

    def cancel(self) -> None:
        """Drop every chunk not yet started (the pool's calls then return at once)."""
        with self._lock:
            self._tasks.clear()


def _decode_chunk(
    codec: Codec,
    rec: frames.ChunkRecord,
    payload: memoryview,
    out: memoryview,
    header,
    ref: Callable[[memoryview], None] | None,
    pool: Executor | None = None,
) -> None:
    if rec.method == frames.METHOD_RAW:
        out[:] = payload
    elif ref is None:
        codec.decode(payload, out, header.width, header.rotate)
    elif pool is None:  # a delta chunk: the reference's bytes, then the XOR undone onto them
        ref(out)
        codec.decode_xor(payload, out, header.width, header.rotate)
    else:  # the same, the reference decoding on the pool while this thread decodes the delta
        writing = pool.submit(ref, out)
        try:
            codec.decode_xor(payload, out, header.width, header.rotate, ready=writing.result)
        finally:
            wait([writing])  # never leave a task writing into out


def decode_frames(
    read: Callable[[int], memoryview],
    out: memoryview,
    codec: Codec,
    *,
    stored_length: int,
    pool: Executor | None,
    window: int,
    on_chunk_error: Callable[[int, str], Exception],
    reference: ReferenceSource | None = None,
) -> None:
    """Decode one item's frames, ``stored_length`` bytes pulled with ``read(n)``, into ``out``.

    ``read(n)`` returns the next ``n`` stored bytes (exactly ``n``; it is never
    asked for bytes past ``stored_length``), in a buffer that stays valid
    while decoding runs. ``len(out)`` and ``stored_length`` are the trusted
    sizes (from the manifest): the frames must decode to exactly ``len(out)``
    bytes and end exactly at ``stored_length``. ``on_chunk_error(index, why)``
    builds the exception to raise for a corrupt chunk (index -1: the header,
    -2: the framing as a whole), so messages can name checkpoint, file and item.
    ``reference``: the item's bytes in the checkpoint its delta chunks were
    coded against (None: a delta chunk is corrupt framing); it is read or
    skipped chunk by chunk on this thread (decoded by the thread that decodes
    the chunk) and finished (checked) last.
    """
    consumed = 0
    pull = read

    def read(n: int) -> memoryview:
        nonlocal consumed
        if consumed + n > stored_length:
            raise on_chunk_error(-2, f"frames run past the item's {stored_length} stored bytes")
        consumed += n
        return pull(n)

    try:
        header = frames.read_header(read, len(out))
    except frames.FrameError as e:
        raise on_chunk_error(-1, str(e)) from None
    pending: deque[Future] = deque()
    pos = 0
    index = 0
    try:
        while True:
            try:
                rec, payload = frames.read_chunk(read, header, len(out) - pos)
            except frames.FrameError as e:
                raise on_chunk_error(index, str(e)) from None
            if payload is None:
                break
            target = out[pos : pos + rec.raw_len]
            ref = None
            if rec.method == frames.METHOD_DELTA:
                if reference is None:
                    raise on_chunk_error(index, "a delta chunk in an item stored without one")
                ref = reference.take_into(rec.raw_len)  # decoded where the chunk is
            elif reference is not None:
                reference.skip(rec.raw_len)
            # The last chunk (the only one, for most tensors) is decoded here:
            # this thread would only wait for it, and a hand-off adds a wake-up.
            # A delta's reference then decodes on the pool meanwhile.
            if pool is None or pos + rec.raw_len == len(out):
                _decode_checked(
                    codec, rec, payload, target, header, ref, index, on_chunk_error, pool
                )
            else:
                # The payload buffer must outlive the task: read() returns a fresh one.
                pending.append(
                    pool.submit(
                        _decode_checked,
                        *(codec, rec, payload, target, header, ref, index, on_chunk_error),
                    )
                )
                if len(pending) >= window:
                    pending.popleft().result()
            pos += rec.raw_len
            index += 1
        while pending:
            pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
    if pos != len(out):
        raise on_chunk_error(index, f"frames end after {pos} of {len(out)} bytes")
    if consumed != stored_length:
        raise on_chunk_error(-2, f"{stored_length - consumed} stored bytes follow the last frame")
    if reference is not None:
        reference.finish()


def _decode_checked(
    codec, rec, payload, target, header, ref, index, on_chunk_error, pool=None
) -> None:
    try:
        _decode_chunk(codec, rec, payload, target, header, ref, pool)
    except ValueError as e:
        raise on_chunk_error(index, str(e)) from None

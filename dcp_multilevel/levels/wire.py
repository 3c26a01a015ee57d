"""Bytes between nodes: files and member streams, verified as they are sent.

The node levels (partner copies, erasure parity) and the restore move
checkpoint bytes point to point over a gloo group of their own
(``_dist.new_group``), never the trainer's. Every transfer here is a
*stream* of a length both sides know beforehand (from the manifest or a
group's description), cut in fixed blocks, followed by one status word:

    sender     stream.write(view) ... stream.finish(ok)   blocks of ``block`` bytes,
                                                          zero padding up to the
                                                          length, then the status
    receiver   for view in receive(...)                   the same blocks, then
                                                          True when the sender
                                                          vouched for the bytes

The sender verifies what it sends while it reads (every item against the
manifest's checksum, every parity chunk against its own), so a damaged
source costs one transfer, never a wrong copy: on a failure mid-way it pads
the stream to its length (the receiver is never left waiting) and sends a
bad status, and the receiver discards what it got.

Both sides must walk their transfers in one agreed order (the callers build
the same list on every rank), which is what keeps blocking sends and
receives from deadlocking.

A send blocks until the receiver took the block, so a sender that read each
block only after the last one was taken, and a receiver that wrote each
block before taking the next, would add their disk times to the wire's:
senders read ahead on a thread (:func:`read_ahead`) and receivers write
behind on one (:class:`WriteBehind`), a few blocks at most, so the reads,
the transfer and the writes overlap. gloo calls stay on the caller's thread;
errors cross back to it, and closing either stops its thread.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from .. import _dist
from ..checkpoint import ItemRef, StoredCheckpoint
from ..checkpoint.items import truncated, verify
from ..errors import DcpMultilevelError, TruncatedDataError
from ..format import Hasher
from ..stores import Store

__all__ = [
    "READ_AHEAD",
    "SOURCE_ERRORS",
    "WIRE_BLOCK",
    "FileVerifier",
    "OutStream",
    "WriteBehind",
    "file_blocks",
    "range_blocks",
    "read_ahead",
    "receive",
    "recv_file",
    "recv_ranges",
    "send_file",
    "send_ranges",
    "status",
]


logger = logging.getLogger(__name__)

#: Bytes per send of a file transfer.
WIRE_BLOCK = 16 << 20

_OK, _BAD = b"\x01" * 8, b"\x00" * 8

#: The failures that condemn one source (the transfer itself goes on, padded).
SOURCE_ERRORS = (OSError, DcpMultilevelError)


class OutStream:
    """The sending end of one stream of ``length`` bytes to ``dst`` (see the module docstring)."""

    def __init__(self, length: int, dst: int, group: Any, block: int = WIRE_BLOCK) -> None:
        self.length = length
        self.dst = dst
        self.group = group
        self._buf = bytearray(max(1, min(block, length)))
        self._fill = 0
        self.sent = 0

    def write(self, view: memoryview | bytes) -> None:
        """Append ``view`` to the stream (sent in whole blocks).

        The caller may change ``view``'s bytes once this returns."""
        view = memoryview(view).cast("B")
        block = len(self._buf)
        # Whole blocks (and the stream's last bytes) go out from the caller's buffer:
        # copying them into ours first would cost a pass over every byte. Not from
        # a read-only one (bytes): torch wraps what it sends as a tensor, which
        # may be written, and warns into the user's log; those go through ours.
        while (
            not self._fill
            and not view.readonly
            and (len(view) >= block or (view and self.sent + len(view) == self.length))
        ):
            n = min(block, len(view))
            if self.sent + n > self.length:
                break  # more than the stream's length: the loop below says so
            _dist.send_bytes(view[:n], self.dst, self.group)
            self.sent += n
            view = view[n:]
        while len(view):
            n = min(len(self._buf) - self._fill, len(view), self.length - self.sent - self._fill)
            if n <= 0:
                raise DcpMultilevelError(
                    f"stream to rank {self.dst} got more than its {self.length} bytes"
                )
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == len(self._buf) or self.sent + self._fill == self.length:
                self._flush()

    def _flush(self) -> None:
        if self._fill:
            _dist.send_bytes(memoryview(self._buf)[: self._fill], self.dst, self.group)
            self.sent += self._fill
            self._fill = 0

    def finish(self, ok: bool) -> None:
        """Pad the stream to its length with zeros, then send the status (``ok``)."""
        self._flush()
        if self.sent < self.length:
            ok = False  # a short stream is never vouched for
            zeros = memoryview(bytearray(len(self._buf)))  # writable: sent as it is
            while self.sent < self.length:
                self.write(zeros[: self.length - self.sent])
        _dist.send_bytes(bytearray(_OK if ok else _BAD), self.dst, self.group)


def receive(
    length: int, src: int, group: Any, block: int = WIRE_BLOCK, buffers: int = 1
) -> Iterator[memoryview]:
    """The blocks of a stream from ``src`` (views of ``buffers`` reused buffers, in
    turn: a block stays valid until ``buffers - 1`` more were received).

    Use :func:`status` after the last block for the sender's verdict.
    """
    bufs = [memoryview(bytearray(max(1, min(block, length)))) for _ in range(buffers)]
    got = 0
    for i in range(-(-length // len(bufs[0]))):
        buf = bufs[i % buffers]
        view = buf[: min(len(buf), length - got)]
        _dist.recv_bytes(view, src, group)
        got += len(view)
        yield view


def status(src: int, group: Any) -> bool:
    """The sender's verdict on the stream just received: True when it vouched for every byte."""
    word = bytearray(8)
    _dist.recv_bytes(word, src, group)
    return bytes(word) == _OK


class FileVerifier:
    """Checks every item of one data file against the manifest as its bytes stream by.

    Feed the file's bytes in order (:meth:`feed`); each item's checksum is
    checked as soon as its last byte went by (``checkpoint/items.py``'s check
    and messages), and :meth:`finish` checks that every item was seen. Bytes no
    item covers are not checked (none are vouched for). With ``ranges``
    (sorted ``(offset, end)`` pairs) only the items inside them are expected,
    and only their bytes are fed.
    """

    def __init__(
        self, ckpt: StoredCheckpoint, file: str, ranges: Sequence[tuple[int, int]] | None = None
    ) -> None:
        manifest = ckpt.manifest()
        self.ckpt = ckpt
        self.file = file
        self.size = manifest.files[file]
        refs = (ItemRef(ckpt.url, i.fqn, loc) for i, loc in manifest.locations.items())
        mine = [r for r in refs if r.loc.file == file]
        if ranges is not None:
            mine = [r for r in mine if _inside(r.loc.offset, r.loc.offset + r.loc.length, ranges)]
        self._items = sorted(mine, key=lambda r: r.loc.offset)
        self._next = 0  # the item being hashed (items do not overlap: one at a time)
        self._hasher = Hasher()
        self._fed = 0  # bytes seen so far

    def feed(self, pos: int, view: memoryview) -> None:
        """Bytes ``pos .. pos+len(view)`` of the file (called in file order)."""
        end = pos + len(view)
        self._fed = max(self._fed, end)
        while self._next < len(self._items):
            ref = self._items[self._next]
            start, stop = ref.loc.offset, ref.loc.offset + ref.loc.length
            if start >= end and stop > end:
                return  # starts after this view (empty items at its end are done here)
            lo, hi = max(pos, start), min(end, stop)
            if hi > lo:
                self._hasher.update(view[lo - pos : hi - pos])
            if stop > end:
                return  # goes on in the next view
            verify(self._hasher, ref)
            self._hasher = Hasher()
            self._next += 1

    def finish(self) -> None:
        """Raise TruncatedDataError unless every item of the file went by."""
        if self._fed == self.size:
            self.feed(self.size, memoryview(b""))  # empty items at the very end
        if self._next < len(self._items):
            raise truncated(self._items[self._next], self._fed)


def _inside(start: int, end: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether ``[start, end)`` lies within one of ``ranges`` (sorted, disjoint)."""
    i = bisect.bisect_right([a for a, _ in ranges], start) - 1
    return i >= 0 and end <= ranges[i][1]


def file_blocks(ckpt: StoredCheckpoint, file: str, block: int = WIRE_BLOCK) -> Iterator[memoryview]:
    """The bytes of data file ``file`` of ``ckpt`` in blocks (one reused buffer), each
    item verified against the manifest once its last byte was read.

    Raises:
        CorruptCheckpointError: an item does not match its checksum.
        TruncatedDataError: the file is missing or has the wrong size.
        OSError: the store could not be read.
    """
    return range_blocks(ckpt, file, None, block)


def range_blocks(
    ckpt: StoredCheckpoint,
    file: str,
    ranges: Sequence[tuple[int, int]] | None,
    block: int = WIRE_BLOCK,
    buffers: int = 1,
) -> Iterator[memoryview]:
    """The bytes of ``ranges`` of data file ``file`` (None: all of it), in order, in
    blocks (``buffers`` reused buffers, in turn: a block stays valid until
    ``buffers - 1`` more were read), each item inside them verified once its last
    byte was read.

    Raises: as :func:`file_blocks`.
    """
    verifier = FileVerifier(ckpt, file, ranges)
    spans = [(0, verifier.size)] if ranges is None else ranges
    with ckpt.open_data(file, "(a transfer)") as handle:
        size = max(1, min(block, max((b - a for a, b in spans), default=1)))
        bufs = [memoryview(bytearray(size)) for _ in range(buffers)]
        turn = 0
        for start, end in spans:
            pos = start
            while pos < end:
                buf = bufs[turn % buffers]
                turn += 1
                view = buf[: min(len(buf), end - pos)]
                if handle.read_into(pos, view) != len(view):
                    raise TruncatedDataError(
                        f"data file {file!r} of {ckpt.url} ended at byte {pos}",
                        checkpoint=ckpt.url,
                        file=file,
                    )
                verifier.feed(pos, view)
                yield view
                pos += len(view)
    verifier.finish()


def send_file(ckpt: StoredCheckpoint, file: str, dst: int, group: Any) -> bool:
    """Send ``file`` of ``ckpt`` to ``dst``, verified on the way; False if it was damaged."""
    return send_ranges(ckpt, file, None, dst, group)


def send_ranges(
    ckpt: StoredCheckpoint,
    file: str,
    ranges: Sequence[tuple[int, int]] | None,
    dst: int,
    group: Any,
) -> bool:
    """Send the bytes of ``ranges`` of ``file`` (None: all of it) to ``dst`` (one
    stream, ranges in order), verified on the way; False if they were damaged."""
    length = ckpt.manifest().files[file] if ranges is None else sum(b - a for a, b in ranges)
    out = OutStream(length, dst, group)
    try:
        blocks = range_blocks(ckpt, file, ranges, buffers=READ_AHEAD + 2)
        for view in read_ahead(blocks, copy=False):
            out.write(view)
    except SOURCE_ERRORS as e:
        what = "" if ranges is None else "parts of "
        logger.warning("dcp_multilevel: not sending %s%s of %s: %s", what, file, ckpt.url, e)
        out.finish(False)
        return False
    out.finish(True)
    return True


def recv_ranges(
    path: str,
    size: int,
    ranges: Sequence[tuple[int, int]],
    src: int,
    group: Any,
    block: int = WIRE_BLOCK,
) -> bool:
    """Receive what :func:`send_ranges` sends into the local file ``path`` (made
    ``size`` bytes long; other ranges it holds are kept), each range at its own
    offset; False when the sender found its copy damaged (the bytes written are
    then not vouched for: readers check every item they take from the file)."""
    starts = [0]  # stream position of each range
    for a, b in ranges:
        starts.append(starts[-1] + b - a)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def write(piece: tuple[int, memoryview]) -> None:
        pos, view = piece
        while len(view):
            i = bisect.bisect_right(starts, pos) - 1
            into = pos - starts[i]
            n = min(len(view), starts[i + 1] - pos)
            written = os.pwrite(fd, view[:n], ranges[i][0] + into)
            view, pos = view[written:], pos + written

    stream = receive(starts[-1], src, group, block, buffers=READ_AHEAD + 2)
    vouched: bool | None = None
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)  # the ranges not received read as zeros: a hole
        with WriteBehind(write) as behind:
            pos = 0
            for view in stream:
                behind.put((pos, view))
                pos += len(view)
        vouched = status(src, group)
        if behind.error is not None:
            raise behind.error
    except OSError:
        for _ in stream:  # the sender must not be left blocked (see recv_file)
            pass
        if vouched is None:
            status(src, group)
        raise
    finally:
        os.close(fd)
    return vouched


def recv_file(
    store: Store, file: str, size: int, src: int, group: Any, block: int = WIRE_BLOCK
) -> bool:
    """Receive ``file`` (``size`` bytes, sent in ``block``-byte pieces) from ``src`` into
    ``store``; False (nothing kept) when the sender found its copy damaged."""

    class _Damaged(Exception):
        pass

    stream = receive(size, src, group, block, buffers=READ_AHEAD + 2)
    vouched: bool | None = None
    try:
        with store.open_write(file) as out:
            with WriteBehind(out.write) as behind:
                for view in stream:
                    behind.put(view)
            vouched = status(src, group)
            if behind.error is not None:
                raise behind.error  # this side's write failed, not the sender's bytes
            if not vouched:
                raise _Damaged  # leaves the block: the temporary file is removed
    except _Damaged:
        return False
    except OSError:
        # This side failed (a full disk): take the rest of the stream anyway, so
        # the sender is not left blocked until the group's timeout, then report.
        for _ in stream:
            pass
        if vouched is None:
            status(src, group)
        raise
    return True


#: Blocks a sender's reads run ahead of its sends, and a receiver's writes behind
#: its receives (each block a buffer of its own: memory is ``READ_AHEAD + 2`` blocks).
READ_AHEAD = 2

_END = object()


class _Raised:
    """An error of a worker thread, carried to the thread that consumes its results."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` on ``q`` unless ``stop`` is set first; whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def read_ahead(
    chunks: Generator[memoryview | bytes, None, None],
    depth: int = READ_AHEAD,
    copy: bool = True,
) -> Iterator[memoryview]:
    """The pieces of ``chunks``, produced by a thread of its own up to ``depth`` pieces
    ahead of the caller, so that a sender's reads and checks overlap its sends.

    With ``copy``, each piece is copied into one of ``depth + 2`` buffers (the
    source may reuse its own buffer, as ``file_blocks`` does): the thread fills
    one while the queue holds at most ``depth`` and the caller still uses the
    last piece it got, which stays valid until it asks for the next. Without
    it the pieces are passed on as they are: the source must keep each valid
    until ``depth + 1`` more were produced (``range_blocks(buffers=depth + 2)``).
    An error the source raises is raised here, in the caller, after the pieces
    before it. Leaving early (closing this generator) stops the thread and
    closes ``chunks``.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    buffers: list[bytearray] = [bytearray() for _ in range(depth + 2)]

    def produce() -> None:
        try:
            for i, piece in enumerate(chunks):
                view = memoryview(piece).cast("B")
                if not copy:
                    if not _put(q, view, stop):
                        return
                    continue
                n = len(view)
                slot = i % len(buffers)
                if len(buffers[slot]) < n:
                    buffers[slot] = bytearray(n)
                out = memoryview(buffers[slot])[:n]
                out[:] = view
                if not _put(q, out, stop):
                    return
        except Exception as e:  # noqa: BLE001 - raised again in the caller, in order
            _put(q, _Raised(e), stop)
            return
        finally:
            chunks.close()
        _put(q, _END, stop)

    thread = threading.Thread(target=produce, name="dcp-ml-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


class WriteBehind:
    """Calls ``write(piece)`` for every piece :meth:`put` on it, in order, on a thread
    of its own, at most ``depth`` pieces behind the caller, so that a receiver's
    disk writes overlap its receives.

    The caller must not change a piece it put until ``depth + 1`` more were put
    (or the writer closed): a receiver receives into ``depth + 2`` buffers in
    turn (``receive(..., buffers=READ_AHEAD + 2)``). The first error of
    ``write`` stops the writes (later pieces are taken and dropped, so the
    caller never blocks) and is kept in :attr:`error`; leaving the ``with``
    block waits for the writes, on an error too.
    """

    def __init__(self, write: Callable[[Any], Any], depth: int = READ_AHEAD) -> None:
        self._write = write
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        #: The first error ``write`` raised (None: none so far).
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="dcp-ml-write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._q.get()) is not _END:
            if self.error is None:
                try:
                    self._write(piece)
                except Exception as e:  # noqa: BLE001 - the caller reads it after close()
                    self.error = e

    def put(self, piece: Any) -> None:
        """Queue ``piece`` for writing (blocks while ``depth`` pieces wait)."""
        self._q.put(piece)

    def close(self) -> Exception | None:
        """Wait for every queued write; the first error, if any."""
        if self._thread.is_alive():
            self._q.put(_END)
            self._thread.join()
        return self.error

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

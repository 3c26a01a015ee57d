"""Overlapping slow reads and writes with the wire: a bounded read-ahead thread and a
write-behind thread, a few pieces deep.

A sender that read each block only after the last one was taken, and a
receiver that wrote each block before taking the next, would add their disk
times to the wire's: :func:`read_ahead` reads on a thread of its own and
:class:`WriteBehind` writes on one, so reads, transfers and writes overlap.
Errors cross back to the caller's thread; closing either stops its thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

__all__ = ["READ_AHEAD", "WriteBehind", "read_ahead"]


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

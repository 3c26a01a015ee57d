"""A read handle that serves small reads from larger ranged requests.

Compressed items are read frame record by frame record; on an object store
each read would be one ranged GET. Stores that say ``prefers_large_reads``
are read through a :class:`CoalescingReader`, which also fetches the next
block while the current one is decoded.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .base import ReadHandle

__all__ = ["COALESCE_BYTES", "CoalescingReader"]

#: Largest block a CoalescingReader fetches at once (its memory per open file
#: is two of them: the block being read and the next one being fetched).
COALESCE_BYTES = 32 << 20

#: Fetches of next blocks, for every open reader (I/O only: a task never waits
#: on another, so a shared pool cannot deadlock).
_AHEAD = ThreadPoolExecutor(4, thread_name_prefix="dcp-ml-read-ahead")


class CoalescingReader:
    """A :class:`ReadHandle` that serves small reads from larger ranged requests.

    Compressed items are read frame record by frame record; on an object
    store each read would be one ranged GET. This wrapper fetches up to
    :data:`COALESCE_BYTES` (never past ``limit``) and serves the following
    reads from memory, so adjacent items and frames cost one request. Once a
    block is fetched, the next one (up to ``limit``) is fetched in the
    background, so the transfer goes on while the caller decodes; a read
    that does not start inside it waits for it, then drops it. Reads at
    least as large as a block go straight to the handle (no copy).
    Not thread-safe: one per reading thread. :meth:`close` waits for a fetch
    under way (the opener calls it before closing the wrapped handle).
    """

    __slots__ = ("_ahead", "_buf", "_handle", "_limit", "_start", "requests")

    def __init__(self, handle: ReadHandle, limit: int | None) -> None:
        self._handle = handle
        self._limit = handle.size if limit is None else min(limit, handle.size)
        self._buf = memoryview(b"")
        self._start = 0
        #: (offset, size, fetch) of the next block, fetched or being fetched
        self._ahead: tuple[int, int, Future[memoryview]] | None = None
        self.requests = 0

    @property
    def size(self) -> int:
        """The wrapped handle's size in bytes."""
        return self._handle.size

    def read_into(self, offset: int, out: memoryview) -> int:
        """As :meth:`ReadHandle.read_into`, from the buffered blocks or one larger request."""
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(out)
        done = 0
        while done < n:
            pos = offset + done
            if self._start <= pos < self._start + len(self._buf):
                at = pos - self._start
                take = min(n - done, len(self._buf) - at)
                out[done : done + take] = self._buf[at : at + take]
                done += take
                continue
            if self._take_ahead(pos):
                continue
            block = min(COALESCE_BYTES, max(0, self._limit - pos))
            if n - done >= block:
                self.requests += 1
                return done + self._handle.read_into(pos, out[done:])
            self._buf, self._start = self._fetch(pos, block), pos
            if not len(self._buf):  # the file ends here
                return done
            self._read_ahead()
        return n

    def close(self) -> None:
        """Wait for a fetch under way (its error is dropped: nothing needed its bytes)."""
        self._drop_ahead()

    def _take_ahead(self, pos: int) -> bool:
        """Make the block fetched ahead the buffered one if it holds ``pos`` (waiting for
        it; its error is this read's), else drop it. Whether it held ``pos``."""
        if self._ahead is None:
            return False
        start, size, fetch = self._ahead
        if not start <= pos < start + size:
            self._drop_ahead()
            return False
        self._ahead = None
        self._buf, self._start = fetch.result(), start
        if len(self._buf) and pos < start + len(self._buf):
            self._read_ahead()
            return True
        return False

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead[2].cancel():
            try:
                ahead[2].result()  # it reads from the handle: not past its close
            except Exception:  # noqa: BLE001 - bytes that nobody needed
                pass

    def _fetch(self, offset: int, size: int) -> memoryview:
        # Uninitialized: the read overwrites it (a bytearray zero-fills the
        # whole block first, CPU time spent on bytes the read replaces).
        buf = memoryview(np.empty(size, dtype=np.uint8))
        self.requests += 1
        got = self._handle.read_into(offset, buf)
        return buf[:got]

    def _read_ahead(self) -> None:
        nxt = self._start + len(self._buf)
        if self._ahead is None and nxt < self._limit:
            size = min(COALESCE_BYTES, self._limit - nxt)
            self._ahead = (nxt, size, _AHEAD.submit(self._fetch, nxt, size))

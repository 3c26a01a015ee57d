"""A read handle that serves small reads from larger ranged requests.

Compressed items are read frame record by frame record; on an object store
each read would be one ranged GET. Stores that say ``prefers_large_reads``
are read through a :class:`CoalescingReader`.
"""

from __future__ import annotations

from .base import ReadHandle

__all__ = ["COALESCE_BYTES", "CoalescingReader"]

#: Largest block a CoalescingReader fetches at once (its memory per open file).
COALESCE_BYTES = 32 << 20


class CoalescingReader:
    """A :class:`ReadHandle` that serves small reads from larger ranged requests.

    Compressed items are read frame record by frame record; on an object
    store each read would be one ranged GET. This wrapper fetches up to
    :data:`COALESCE_BYTES` (never past ``limit``) and serves the following
    reads from memory, so adjacent items and frames cost one request. Reads
    at least as large as a block go straight to the handle (no copy).
    Not thread-safe: one per reading thread.
    """

    __slots__ = ("_buf", "_handle", "_limit", "_start", "requests")

    def __init__(self, handle: ReadHandle, limit: int | None) -> None:
        self._handle = handle
        self._limit = handle.size if limit is None else min(limit, handle.size)
        self._buf = memoryview(b"")
        self._start = 0
        self.requests = 0

    @property
    def size(self) -> int:
        """The wrapped handle's size in bytes."""
        return self._handle.size

    def read_into(self, offset: int, out: memoryview) -> int:
        """As :meth:`ReadHandle.read_into`, from the buffered block or one larger request."""
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(out)
        end = offset + n
        if self._start <= offset and end <= self._start + len(self._buf):
            out[:] = self._buf[offset - self._start : end - self._start]
            return n
        block = min(COALESCE_BYTES, max(0, self._limit - offset))
        if n >= block:
            self.requests += 1
            return self._handle.read_into(offset, out)
        buf = memoryview(bytearray(block))
        self.requests += 1
        got = self._handle.read_into(offset, buf)
        self._buf, self._start = buf[:got], offset
        take = min(n, got)
        out[:take] = self._buf[:take]
        return take

"""Write local files with ``O_DIRECT``: the bytes go to the disk, not the page cache.

Why: an ordinary write copies every byte into the page cache, allocates and
later reclaims those pages, and the kernel's writeback walks them again. For
a checkpoint that is CPU time taken from training while an async save runs.
Written with ``O_DIRECT``, a save costs several times less CPU than through
the page cache (ours or stock ``FileSystemWriter``), and less wall time too;
nearly all of the difference is kernel time (``benchmarks/bench_direct_io.py``
measures it).

How: :class:`DirectWriteHandle` gathers the caller's bytes in a page-aligned
bounce buffer (reused across files) and writes each full buffer with one
``pwrite`` on a second descriptor of the same file, opened with ``O_DIRECT``.
Big pieces go to the disk as they are, without the bounce copy, where the
file's end and the piece's address are the same distance past a block
boundary (``pad_for`` puts the file there): the few bytes before the piece's
first whole page complete the gathered block, then its whole pages are
written from the caller's memory. So a synchronous save, or an async save
written from the live state, copies none of its big tensors, and an async
save's staged tensors are copied once, into staging. Of the CPU a save
written this way costs, the bounce copy is the largest part, several times
the ``O_DIRECT`` writes themselves and more than the checksum.
The end of the file that is not a whole block goes through the ordinary
descriptor, and the caller's ``fsync`` on that descriptor covers both (the
file's data and the device's cache): ``O_DIRECT`` alone is not durable.

Where the file system refuses ``O_DIRECT`` (at open, or ``EINVAL`` on a
write: some network and FUSE file systems), the handle writes the rest of
the file the ordinary way; the file's bytes are the same either way.

On a file system in memory (tmpfs, ramfs: ``/dev/shm``) there is no page
cache to skip, only the bounce copy to add, and the same save is slower with
it: leave it off there (:func:`memory_backed` tells where that is).

The local store writes through the page cache unless its storage option
``direct_io=True`` asks for this: a checkpoint is usually read back soon (a
restart on the same node, the drains to higher levels), from the cache.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading

import numpy as np

__all__ = [
    "ALIGN",
    "BOUNCE_BYTES",
    "DIRECT_MIN",
    "DirectWriteHandle",
    "available",
    "memory_backed",
    "open_direct",
]

#: Alignment of the buffer's address, the file offsets and the lengths of
#: direct writes: 4 KiB covers 512-byte and 4K-sector devices alike.
ALIGN = 4096

#: Bytes gathered per direct write. Large enough that the device sees big
#: requests (the kernel splits them, so several are in flight), small enough
#: to be no memory to speak of.
BOUNCE_BYTES = 16 << 20

#: Pieces at least this large, at an address as far past a page as the file's
#: end is past a block (``DirectWriteHandle.pad_for``), are written straight
#: from the caller's memory (no bounce copy) but for the bytes before their
#: first page. Smaller ones are not worth up to ALIGN - 1 zeros in the file.
DIRECT_MIN = 1 << 20

#: Idle bounce buffers kept for the next files (each BOUNCE_BYTES).
_KEEP = 2
_idle: list[mmap.mmap] = []
_idle_lock = threading.Lock()


def available() -> bool:
    """Whether this platform has ``O_DIRECT`` at all (Linux, some BSDs)."""
    return hasattr(os, "O_DIRECT")


def open_direct(path: str | os.PathLike[str]) -> int | None:
    """A second, ``O_DIRECT`` descriptor on the existing file ``path``; None where refused."""
    if not available():
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


#: ``statfs(2)`` magic numbers of file systems that live in memory.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def _statfs_type(path: str | os.PathLike[str]) -> int | None:
    """The file system type (``f_type``) of ``path``; None where it cannot be read."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if fn(os.fsencode(path), buf) != 0:
        return None
    # f_type is the struct's first field, a word wide.
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def memory_backed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (an existing directory or file) is on tmpfs or ramfs (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    return _statfs_type(path) in _MEMORY_FS


def _take() -> mmap.mmap:
    with _idle_lock:
        if _idle:
            return _idle.pop()
    return mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned


def _give(buf: mmap.mmap) -> None:
    with _idle_lock:
        if len(_idle) < _KEEP:
            _idle.append(buf)
            return
    buf.close()


def _address(view: memoryview) -> int:
    # numpy reads the address of read-only buffers too (bytes, read-only tensors).
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class DirectWriteHandle:
    """A :class:`~.base.WriteHandle` that writes whole blocks with ``O_DIRECT``.

    Call order::

        h = DirectWriteHandle(fd, direct_fd)   # fd: the ordinary descriptor
        h.pad_for(data)                        # optional, before a big piece: zeros
        h.write(data)                          #   that let it go uncopied; repeatedly
        h.finish()                             # the rest of the bytes; then fsync(fd)
        h.close()                              # always (also on error): direct_fd, buffer

    Neither descriptor's file position is used: every write is a ``pwrite``.
    """

    __slots__ = ("_buf", "_cap", "_direct", "_fd", "_fill", "_mv", "_pos", "_written")

    def __init__(self, fd: int, direct_fd: int | None, *, bounce: memoryview | None = None) -> None:
        """``bounce``: the caller's buffer (a multiple of ALIGN, at an aligned
        address); by default one from the shared pool, handed back at ``close``."""
        self._fd = fd
        self._direct = direct_fd
        self._buf = _take() if bounce is None else None
        self._mv = memoryview(self._buf) if bounce is None else bounce.cast("B")
        if len(self._mv) % ALIGN or not self._mv:
            raise ValueError(f"bounce buffer of {len(self._mv)} bytes: not a multiple of {ALIGN}")
        self._cap = len(self._mv)
        self._fill = 0  # bytes gathered in the buffer
        self._written = 0  # bytes of the file already written (a multiple of ALIGN while direct)
        self._pos = 0

    @property
    def direct(self) -> bool:
        """Whether whole blocks still go out with ``O_DIRECT`` (False after a fallback)."""
        return self._direct is not None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append all of ``data`` (not kept: what is not written at once is copied)."""
        mv = memoryview(data).cast("B")
        n = len(mv)
        if not n:
            return
        src = _address(mv)
        done = 0
        if self._direct is not None and n >= DIRECT_MIN and (src - self._pos) % ALIGN == 0:
            # The caller's bytes sit as far past a page as the file's end is past a
            # block: the bytes before their first page complete the gathered block,
            # and their whole pages go to the disk as they are.
            done = -src % ALIGN
            self._gather(src, done)
            if self._fill:
                self._flush(self._fill)  # a whole number of blocks now
            whole = (n - done) - (n - done) % ALIGN
            if self._write_direct(mv[done : done + whole]):
                self._written += whole
                done += whole
        self._gather(src + done, n - done)
        self._pos += n

    def _gather(self, src: int, n: int) -> None:
        """Copy ``n`` bytes at address ``src`` into the bounce buffer, writing it out when full."""
        dst = _address(self._mv)
        done = 0
        while done < n:
            take = min(n - done, self._cap - self._fill)
            # ctypes releases the GIL for the copy: training threads keep running.
            ctypes.memmove(dst + self._fill, src + done, take)
            self._fill += take
            done += take
            if self._fill == self._cap:
                self._flush(self._cap)

    def tell(self) -> int:
        """Bytes written through this handle so far."""
        return self._pos

    def pad_for(self, data: bytes | bytearray | memoryview) -> int:
        """Before ``data`` is written: zeros until the file's end is as far past a
        block boundary as ``data``'s address is past a page, if that lets ``data``
        go to the disk without a copy; the number of zeros written (< ALIGN).

        Only for big ``data`` while direct writes are on; the zeros belong to no
        item (readers go by offsets, copies keep them).
        """
        mv = memoryview(data).cast("B")
        if self._direct is None or len(mv) < DIRECT_MIN:
            return 0
        gap = (_address(mv) - self._pos) % ALIGN
        if gap:
            self.write(bytes(gap))
        return gap

    def finish(self) -> None:
        """Write what is gathered: whole blocks directly, the last partial block ordinarily."""
        whole = self._fill - self._fill % ALIGN
        if whole:
            self._flush(whole)
        if self._fill:
            self._pwrite(self._fd, self._mv[: self._fill], self._written)
            self._written += self._fill
            self._fill = 0

    def close(self) -> None:
        """Close the direct descriptor and hand the bounce buffer back (idempotent)."""
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        self._mv.release()  # idempotent; the caller's own bounce view stays theirs
        if self._buf is not None:
            _give(self._buf)
            self._buf = None

    def _flush(self, nbytes: int) -> None:
        """Write the first ``nbytes`` gathered (a multiple of ALIGN) and keep the rest."""
        chunk = self._mv[:nbytes]
        if not self._write_direct(chunk):
            self._pwrite(self._fd, chunk, self._written)
        self._written += nbytes
        rest = self._fill - nbytes
        if rest:
            self._mv[:rest] = self._mv[nbytes : self._fill]
        self._fill = rest

    def _write_direct(self, data: memoryview) -> bool:
        """Write ``data`` at the end of what is written, with ``O_DIRECT``; False
        (and ordinary writes from then on) where direct writes are off or refused."""
        if self._direct is None:
            return False
        try:
            self._pwrite(self._direct, data, self._written)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # The file system takes O_DIRECT at open but not these writes.
            os.close(self._direct)
            self._direct = None
            return False
        return True

    @staticmethod
    def _pwrite(fd: int, data: memoryview, offset: int) -> None:
        while data:
            n = os.pwrite(fd, data, offset)  # releases the GIL; may write less
            data = data[n:]
            offset += n

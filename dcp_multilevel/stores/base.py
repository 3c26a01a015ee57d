"""The byte-store interface: a place that holds checkpoint files.

A store knows files, not DCP: it stores byte files under a root and publishes
each one atomically. Writers and readers decide what goes where.

Call order for one checkpoint (any rank may be a writer; one rank commits)::

    every writing rank:  with store.open_write(path) as f: f.write(...)  # repeatedly
                         (a file appears at ``path`` only when the block exits
                          without error; on error nothing appears)
    committing rank:     store.write_atomic("manifest.json", bytes)  # last: the commit
                         store.remove_tree(<old data>)             # only after the commit
    discovery (a root):  store.listdir(""), then store.existing(["step-<N>/manifest.json", ...])
    every reading rank:  store.read_bytes("manifest.json")
                         with store.open_read(path) as r: r.read_into(offset, buffer)

Implementations must be safe to call from several threads at once on
different paths; two writers on the same path is a caller bug.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from . import _writeback

__all__ = ["FdWriteHandle", "ReadHandle", "Store", "WriteHandle"]


@runtime_checkable
class WriteHandle(Protocol):
    """A file being written; bytes become visible only when its context exits cleanly."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append all of ``data`` (never a partial write).

        ``data`` may be reused by the caller once this returns (the writer
        recycles coded-chunk buffers): copy it, never keep a reference.
        """
        ...

    def tell(self) -> int:
        """Bytes written so far."""
        ...


@runtime_checkable
class ReadHandle(Protocol):
    """An open, committed file."""

    @property
    def size(self) -> int:
        """Size of the file in bytes, as stored."""
        ...

    def read_into(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``offset``; return the bytes read (fewer only at end of file)."""
        ...


class FdWriteHandle:
    """A :class:`WriteHandle` over an open file descriptor (local files and spool files).

    With ``early_writeback``, the kernel is asked to start writing each
    completed :data:`~._writeback.WRITEBACK_STRIDE` of the file to disk while
    the rest is still being written, so the final fsync waits less (see
    ``_writeback.py``).
    """

    __slots__ = ("_early", "_fd", "_flushed", "_pos")

    def __init__(self, fd: int, *, early_writeback: bool = False) -> None:
        self._fd = fd
        self._pos = 0
        self._flushed = 0  # writeback requested for [0, _flushed)
        self._early = early_writeback and _writeback.available()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at the end (``os.write`` until done; ``data`` is not kept)."""
        mv = memoryview(data).cast("B")
        while mv:
            # os.write releases the GIL and may write less than asked.
            n = os.write(self._fd, mv)
            mv = mv[n:]
            self._pos += n
        if self._early and self._pos - self._flushed >= _writeback.WRITEBACK_STRIDE:
            _writeback.start_writeback(self._fd, self._flushed, self._pos - self._flushed)
            self._flushed = self._pos

    def tell(self) -> int:
        """Bytes written through this handle so far."""
        return self._pos


class Store(abc.ABC):
    """Bytes stored below one root location (a directory, a bucket prefix, ...).

    Paths given to methods are relative POSIX paths below the root, already
    validated by the caller (see ``format.layout.validate_relpath``).

    Construction (how :func:`~dcp_multilevel.stores.store_for` builds every
    store, built-in or registered)::

        cls(location, *, sync=True, **options)

    ``location`` is a local path for the ``file`` scheme, the whole URL for
    every other. ``sync=False`` lets a store skip making files durable before
    publishing them (scratch data); a store whose uploads are durable when
    they return accepts and ignores it. ``options`` are the user's
    ``storage_options``; a store refuses ones it does not know with
    :class:`~dcp_multilevel.errors.ConfigError`.
    """

    #: True when publishing a file is an atomic rename (a crash never leaves a
    #: half-written file visible under its final name). Object stores: False,
    #: so their commit is "manifest written last" plus a size check.
    supports_atomic_rename: bool = False

    #: True when every read request costs a round trip (an HTTP ranged GET):
    #: readers then fetch adjacent small pieces with one larger request.
    prefers_large_reads: bool = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The root of this store, as a URL (``file:///...``, ``s3://...``)."""

    @abc.abstractmethod
    def open_write(self, path: str) -> AbstractContextManager[WriteHandle]:
        """Open ``path`` for writing; publish it on clean exit, discard it on error."""

    @abc.abstractmethod
    def open_read(self, path: str) -> AbstractContextManager[ReadHandle]:
        """Open the committed file ``path``; FileNotFoundError when it does not exist."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """True when a committed file or directory exists at ``path``."""

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly below directory ``path`` (sorted); empty when it does not exist."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove file or directory ``path`` and everything below it; missing is fine."""

    # Conveniences built on the primitives above; backends may override for speed.

    def existing(self, paths: Iterable[str]) -> set[str]:
        """Those of ``paths`` where :meth:`exists` is true, asked all at once.

        Discovery asks this for the manifest of every step below a root. The
        default asks one path at a time; a store where every lookup is a round
        trip sends them concurrently (still one request per path), so that
        10,000 steps cost the latency of a few lookups, not 10,000 of them.
        """
        return {path for path in paths if self.exists(path)}

    def write_atomic(self, path: str, data: bytes) -> None:
        """Publish ``data`` at ``path`` in one step (used for manifests)."""
        with self.open_write(path) as f:
            f.write(data)

    def put_file(self, local_path: str | os.PathLike[str], path: str) -> None:
        """Publish the local file ``local_path`` at ``path`` (used to copy between stores)."""
        with open(local_path, "rb") as src, self.open_write(path) as dst:
            while block := src.read(16 << 20):
                dst.write(block)

    def local_path(self, path: str) -> str | None:
        """A local file system path of the committed file ``path``, or None.

        Stores in a local directory return one, so that copies to another store
        can upload the file directly (``put_file``) instead of streaming it.
        """
        return None

    def sweep(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove this store's abandoned temporary data (crash leftovers); return what went.

        Only data older than ``older_than_s`` seconds is touched, so files that
        a live writer (another rank, another job) is producing are left alone.
        With ``dry_run``, remove nothing and return what would go (``gc --dry-run``
        lists exactly what ``gc`` removes). The default has nothing to sweep.
        """
        return []

    def read_bytes(self, path: str) -> bytes:
        """The whole content of the committed file ``path``."""
        with self.open_read(path) as r:
            buf = bytearray(r.size)
            n = r.read_into(0, memoryview(buf))
            return bytes(buf[:n])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

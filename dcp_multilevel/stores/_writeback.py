"""Start writing a file's dirty pages to disk while the file is still being written.

A save ends with fsync, which waits for every page written since the file was
opened. Left alone, the kernel starts writeback late (at its dirty-page
thresholds or after ~30 s), so the disk idles while a checkpoint is copied
into the page cache and then works alone through the whole file at fsync.
Asking for writeback of each completed stretch as the file grows overlaps the
two: the disk writes while the rest of the file is produced, and the fsync
that ends a save waits only for the last stretches, coded or not.

Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts writeback without
waiting for it and keeps the pages cached; Python's ``os`` has no binding, so
it is called through ctypes (which releases the GIL). Elsewhere, or where the
call fails (a file system or file type that does not support it), nothing
happens: it is a hint, and the final fsync still makes the file durable.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["WRITEBACK_STRIDE", "available", "start_writeback"]

#: Bytes written between two writeback requests: large enough that the calls
#: cost nothing, small enough that the disk starts early.
WRITEBACK_STRIDE = 16 << 20

_SYNC_FILE_RANGE_WRITE = 2


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols, libc's included: find_library would run
        # ldconfig in a subprocess at import.
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def available() -> bool:
    """Whether writeback can be started early on this platform."""
    return _sync_file_range is not None


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd``; True if it took it.

    Never waits for the disk and never raises: a refusal only means the final
    fsync does all the work, as without this call.
    """
    if _sync_file_range is None or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0

"""Per-thread byte buffers reused across chunks.

A fresh buffer per chunk (0.25-4 MiB) is mapped, page-faulted and unmapped
by the allocator every time; coding and decoding threads keep theirs.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["scratch"]

_local = threading.local()


def scratch(name: str, nbytes: int) -> np.ndarray:
    """This thread's buffer ``name``, at least ``nbytes`` long (uninitialized), as ``nbytes``."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]

"""Host scratch for copies to and from CUDA devices, page-locked, and its release.

A copy between the host and a device runs at full speed, and without waiting,
only from page-locked memory. The reader's CUDA destinations
(``destinations.py``) and the writer's synchronous copies from a device
(``sources.tensor_of``) take it from torch's caching host allocator, which
reuses a block item after item and save after save (page-locking costs far
more than a copy into memory already locked), but keeps every block it ever
made. So the bytes
taken are counted, and :func:`release_pinned` hands the cached blocks back
to the driver: the reader after each load, a writer when it is closed.
"""

from __future__ import annotations

import torch

__all__ = ["host_scratch", "release_pinned"]

#: Page-locked bytes taken since the last :func:`release_pinned` (one per process).
_taken = [0]


def host_scratch(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, pinned: bool
) -> torch.Tensor:
    """An uninitialized host tensor; ``pinned``: page-locked (counted for release)."""
    t = torch.empty(shape, dtype=dtype, pin_memory=pinned)
    if pinned:
        _taken[0] += t.nbytes
    return t


def release_pinned() -> int:
    """Give the page-locked blocks cached since the last call back to the driver
    (pinned memory is what users run out of). Only cached blocks go: those still
    in use elsewhere (a DataLoader's, a copy not yet done) stay. Returns the bytes
    taken since the last call; without any, nothing is done."""
    taken, _taken[0] = _taken[0], 0
    empty = getattr(torch.accelerator, "empty_host_cache", None)  # torch >= 2.9
    if taken and empty is not None:
        empty()
    return taken

"""Page-locked host memory of exactly the size asked, for the staging buffer sets.

``torch.empty(n, pin_memory=True)`` goes through CUDA's caching host
allocator, which rounds every request up to a power of two: a 4.3 GB set
would pin 8.6 GB, and a budget of N bytes could pin up to 2N per set
(pytorch/pytorch#150517). The buffer sets live as long as the writer, so
that allocator's caching buys them nothing: :func:`pinned_empty` takes
ordinary host memory, page-aligned, and registers exactly its pages with
CUDA (``cudaHostRegister``), falling back to the caching allocator where
registering fails. The registration is undone when the returned set is
collected, before its memory can be freed (:func:`unpin_when_collected`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

__all__ = ["pinned_empty", "registered_bytes", "unpin_when_collected"]

log = logging.getLogger(__name__)

PAGE = 4096
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class _Registered:
    """Bytes registered by this module and not yet unregistered (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n


_registered = _Registered()


def registered_bytes() -> int:
    """Host bytes this process page-locked for buffer sets, not counted by
    ``torch.cuda.host_memory_stats()`` (for metrics and benchmarks)."""
    return _registered.bytes


def pinned_empty(nbytes: int) -> tuple[torch.Tensor, int]:
    """A page-aligned ``uint8`` host tensor of ``nbytes``, page-locked, and the pointer
    registered with CUDA (0: it came from the caching allocator instead; nothing
    to undo). Pass both to :func:`unpin_when_collected`."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    flat = raw[start : start + nbytes]
    try:
        # Portable: pinned for every device's context, as torch's pinned memory is
        # (a process may stage tensors of several GPUs). torch's binding marks a
        # failure handled (CUDA's last error is cleared).
        err: Any = int(
            torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, _REGISTER_PORTABLE)
        )
    except Exception as e:  # noqa: BLE001 - no CUDA runtime here: torch's pinning says why
        err = e
    if err != 0:
        log.info("cudaHostRegister of %d bytes failed (%s): pinning through torch", nbytes, err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), 0
    _registered.add(nbytes)
    return flat, flat.data_ptr()


def unpin_when_collected(owner: Any, ptr: int, nbytes: int) -> None:
    """Undo ``pinned_empty``'s registration of ``ptr`` when ``owner`` (which holds the
    tensor) is collected: weak-reference callbacks run before its attributes are
    released, so the pages are unregistered before the memory can be freed."""
    if ptr:
        weakref.finalize(owner, _unregister, ptr, nbytes)


def _unregister(ptr: int, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
    _registered.add(-nbytes)

"""Raw tensor bytes: the stored form of a tensor chunk is its memory, row-major.

No pickling, no headers: ``prod(sizes) * itemsize`` bytes in C order, in the
byte order of the machine that wrote them (the manifest records dtype and
shape; every platform torch ships on is little-endian).
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["PIECE_BYTES", "byte_view", "pieces", "value_tensor"]

#: One ctypes array type longer than any tensor; each view of it is cut to its
#: tensor's size (a type per size would cost a ctypes lookup, or a new class, per
#: tensor).
_SPAN = ctypes.c_char * (1 << 48)

#: Granularity of hashing and I/O calls: big enough to amortize syscalls, small
#: enough that the bytes just hashed are still in cache when written or read.
PIECE_BYTES = 16 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview of a contiguous CPU tensor's bytes (no copy).

    Writing through the view writes the tensor, which is how reads land
    straight in a destination tensor.
    """
    if not _values_in_memory(t):
        raise ValueError("byte_view needs a contiguous CPU tensor with its values in memory")
    n = t.nbytes
    if not n:
        return memoryview(bytearray())
    # From the address, not reshape/view/numpy: each torch call gives the GIL away
    # and takes it back, and a save's threads calling torch per item slow a
    # training thread that calls torch too, by more than the calls take
    # (benchmarks/bench_gil_calls.py measures it).
    span = _SPAN.from_address(t.data_ptr())
    span.tensor = t  # the memory's owner lives as long as a view of it
    return memoryview(span).cast("B")[:n]


def value_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor whose memory holds its values, for
    :func:`byte_view`: ``t`` itself where it is one; a copy of a device tensor,
    a strided view, or a conjugate or negative view. A bool tensor's bytes are
    copied as they are: a bool copy kernel rewrites bytes other than 0 and 1
    (a mask viewed from raw bytes) as 1, and a save keeps bits."""
    if _values_in_memory(t):
        return t
    if t.dtype == torch.bool:  # (never conjugate or negative)
        return t.detach().view(torch.uint8).contiguous().cpu().view(torch.bool)
    return t.detach().resolve_conj().resolve_neg().contiguous().cpu()


def _values_in_memory(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor whose memory is its values (a conjugate or negative
    view's is not: torch applies the bit when the values are read)."""
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def pieces(view: memoryview, size: int = PIECE_BYTES):
    """Successive slices of ``view`` of at most ``size`` bytes (none for empty views)."""
    for start in range(0, len(view), size):
        yield view[start : start + size]

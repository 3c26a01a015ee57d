"""Raw tensor bytes: the stored form of a tensor chunk is its memory, row-major.

No pickling, no headers: ``prod(sizes) * itemsize`` bytes in C order, in the
byte order of the machine that wrote them (the manifest records dtype and
shape; every platform torch ships on is little-endian).
"""

from __future__ import annotations

import torch

__all__ = ["PIECE_BYTES", "byte_view", "pieces"]

#: Granularity of hashing and I/O calls: big enough to amortize syscalls, small
#: enough that the bytes just hashed are still in cache when written or read.
PIECE_BYTES = 16 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview of a contiguous CPU tensor's bytes (no copy).

    Writing through the view writes the tensor, which is how reads land
    straight in a destination tensor.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    # .numpy() shares memory; uint8 is a dtype numpy always has (bf16/fp8 are not).
    return memoryview(flat.numpy()).cast("B")


def pieces(view: memoryview, size: int = PIECE_BYTES):
    """Successive slices of ``view`` of at most ``size`` bytes (none for empty views)."""
    for start in range(0, len(view), size):
        yield view[start : start + size]

"""Geometry of splitting a tensor into boxes along one dimension.

A tensor is cut along a single dimension ``d`` into slabs of whole indices of
``d`` (full extent in every other dimension), so every piece is an ordinary
DCP chunk (offsets + sizes). Dimension 0 is preferred: its pieces are
contiguous in memory and need no copy. A later dimension is used only when
one row (one index of dim 0) is too coarse for the balance slack, e.g. a
``(2, 10**9)`` tensor, and has finer slabs.
"""

from __future__ import annotations

import math

__all__ = ["choose_split_dim", "slab_bytes"]


def slab_bytes(shape: tuple[int, ...], itemsize: int, dim: int) -> int:
    """Bytes of one index along ``dim`` (the split granularity)."""
    return math.prod(s for i, s in enumerate(shape) if i != dim) * itemsize


def choose_split_dim(shape: tuple[int, ...], itemsize: int, granularity: int) -> int | None:
    """The dimension to split along, preferably with slabs of at most ``granularity`` bytes.

    Returns 0 when rows are fine enough; otherwise the dimension with the
    smallest slab (ties: the lowest), even when that slab is coarser than
    ``granularity``: cutting one slab too many costs at most a slab of balance,
    writing the tensor whole costs all of it (at 8k ranks, whole 125 MB
    embeddings made one rank write 230x the mean). ``None`` only when no
    dimension has extent >= 2 (nothing to cut).
    """
    candidates = [d for d, s in enumerate(shape) if s >= 2]
    if not candidates:
        return None
    if candidates[0] == 0 and slab_bytes(shape, itemsize, 0) <= granularity:
        return 0
    return min(candidates, key=lambda d: (slab_bytes(shape, itemsize, d), d))

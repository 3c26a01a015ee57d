"""Splitting a list of sizes into bins of similar total: :func:`partition` without splits.

The writer spreads one rank's items over its data files (one per writing
thread) this way: largest first, each to the least-loaded bin (LPT).
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import CostModel
from .items import Item
from .partition import PartitionOptions, partition

__all__ = ["balance"]

#: Whole items only, no grouping: plain LPT over the bins.
_WHOLE = PartitionOptions(split=False, group=False)


def balance(sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Indexes into ``sizes``, split into at most ``bins`` non-empty groups of similar total.

    Deterministic: ties go to the earlier index and the lower bin. Each
    group lists its indexes in placement order (largest first).
    """
    if bins <= 1 or len(sizes) <= 1:
        return [list(range(len(sizes)))] if sizes else []
    everyone = tuple(range(bins))
    items = [Item(i, n, everyone, f"{i:012d}") for i, n in enumerate(sizes)]
    placed = partition(items, bins, CostModel(per_item_overhead=0.0), _WHOLE, check=False)
    groups: list[list[int]] = [[] for _ in range(bins)]
    for piece in placed.pieces:
        groups[piece.rank].append(piece.key)
    return [g for g in groups if g]

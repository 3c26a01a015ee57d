"""Balanced assignment of replicated items to ranks (makespan, with splitting).

The algorithm, in cost units (byte-equivalents, see ``cost.py``):

1. Items with one owner stay there; their costs start the per-rank loads.
2. ``T = ceil(total cost / n)`` is the target load, and the slack is
   ``s = max(ceil(epsilon * T), 2 * m + h)`` where ``m`` is the minimum chunk
   size in bytes and ``h`` the per-item overhead.
3. Replicated *units* are processed largest first (ties broken by
   ``sort_key``): a unit is a group (several items of one sub-collection with
   the same owners) or a single item, or the unplaced remainder of a split item.
   Each goes to its least-loaded owner ``r`` (ties: lowest rank):

   * whole, if ``L_r + cost <= T + s``;
   * a group that does not fit is dissolved into its items (re-queued);
   * a splittable item that does not fit is cut: a slab of ``k`` indices along
     one dimension (``split.py``) sized to fill ``r`` up to ``T``, but at least
     ``m`` bytes and leaving at least ``m`` bytes; the remainder is re-queued;
   * anything else (bytes objects, sharded chunks, remainders under ``2m``
     bytes) goes whole to ``r``.

**Bound.** Let ``M = ceil(final total cost / n)`` be the mean load rounded up
(the final total exceeds the initial one by ``h`` per extra piece, so ``M >=
T``), ``O`` the largest load of owned items alone and ``U`` the largest cost
of a replicated item that could not be split. If every replicated item is
held by all ranks (data parallelism), then::

    max_r L_r <= max(O, M + max(s, U))

so ``max/mean <= 1 + max(epsilon*T, 2m + h, U) / mean`` whenever ``O <= M``.

*Proof.* Loads only grow, so when a unit is placed the least-loaded rank has
``L_r <= current mean <= M``. A whole placement is made only if ``L_r + c <=
T + s``, or for an unsplittable item (``L_r + c <= M + U``), or for a
remainder under ``2m`` bytes (``c < 2m + h <= s``). A cut piece has ``k``
slabs of at most ``g = s - m - h`` bytes each, where ``k`` is the largest
count with ``k*slab + h <= T - L_r``, raised to at least ``ceil(m/slab)``
slabs: so ``c <= max(T - L_r, m + slab + h)`` and ``L_r + c <= max(T, L_r) +
s <= M + s``. Every placement keeps its rank within the bound, and a rank's
final load is its load after its last placement. ∎

Complexity: ``O((I + P) log(I + n))`` for ``I`` items, ``P`` pieces and ``n``
ranks, using a heap of loads (lazy deletion) for units held by all ranks;
units held by a subset of ranks scan that subset.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlanningError
from .cost import CostModel
from .items import Item, Piece
from .split import choose_split_dim, slab_bytes

__all__ = ["Partition", "PartitionOptions", "partition"]


@dataclass(frozen=True)
class PartitionOptions:
    """Knobs of :func:`partition`.

    Attributes:
        epsilon: relative balance slack (see the module's bound).
        min_chunk_bytes: no piece of a split item is smaller than this.
        split: allow splitting replicated tensors.
        group: keep items of one sub-collection together when balance allows.
    """

    epsilon: float = 0.01
    min_chunk_bytes: int = 16 << 10
    split: bool = True
    group: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.epsilon < 1:
            raise PlanningError(f"epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.min_chunk_bytes < 1:
            raise PlanningError(f"min_chunk_bytes must be >= 1, got {self.min_chunk_bytes!r}")


@dataclass(frozen=True)
class Partition:
    """The result: every piece placed, and per-rank loads in cost units."""

    pieces: tuple[Piece, ...]
    loads: tuple[int, ...]
    target: int
    slack: int

    def bytes_per_rank(self) -> list[int]:
        out = [0] * len(self.loads)
        for p in self.pieces:
            out[p.rank] += p.nbytes
        return out

    def items_per_rank(self) -> list[int]:
        out = [0] * len(self.loads)
        for p in self.pieces:
            out[p.rank] += 1
        return out


@dataclass
class _Unit:
    """A queue entry: a group of whole items, or an item's unplaced range [lo, hi)."""

    items: tuple[Item, ...]
    lo: int = 0
    hi: int = 0
    dim: int | None = None  # set once an item has been cut

    def nbytes(self) -> int:
        if self.dim is None:
            return sum(i.nbytes for i in self.items)
        (item,) = self.items
        assert item.shape is not None
        return (self.hi - self.lo) * slab_bytes(item.shape, item.itemsize, self.dim)


class _Loads:
    """Per-rank loads with O(log n) argmin over all ranks (heap, lazy deletion)."""

    def __init__(self, loads: list[int]) -> None:
        self.loads = loads
        self.all_ranks = tuple(range(len(loads)))
        self._heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(self._heap)

    def argmin(self, owners: tuple[int, ...]) -> int:
        if owners == self.all_ranks:
            while True:
                load, r = self._heap[0]
                if load == self.loads[r]:
                    return r
                heapq.heappop(self._heap)  # stale entry
        return min(owners, key=lambda r: (self.loads[r], r))

    def add(self, rank: int, cost: int) -> None:
        self.loads[rank] += cost
        heapq.heappush(self._heap, (self.loads[rank], rank))


def _validate(items: Sequence[Item], world_size: int) -> None:
    if world_size < 1:
        raise PlanningError(f"world_size must be >= 1, got {world_size}")
    seen: set[int] = set()
    for item in items:
        if item.key in seen:
            raise PlanningError(f"item key {item.key} ({item.sort_key}) appears twice")
        seen.add(item.key)
        if not item.owners or list(item.owners) != sorted(set(item.owners)):
            raise PlanningError(f"item {item.sort_key}: owners must be sorted, unique, non-empty")
        if item.owners[0] < 0 or item.owners[-1] >= world_size:
            raise PlanningError(f"item {item.sort_key}: owner outside 0..{world_size - 1}")
        if item.shape is not None and math.prod(item.shape) * item.itemsize != item.nbytes:
            raise PlanningError(f"item {item.sort_key}: shape x itemsize != nbytes")


def partition(
    items: Sequence[Item],
    world_size: int,
    cost: CostModel | None = None,
    options: PartitionOptions | None = None,
) -> Partition:
    """Assign every item (whole or in pieces) to one rank; see the module docstring."""
    cost = cost or CostModel()
    options = options or PartitionOptions()
    _validate(items, world_size)
    h = cost.overhead_bytes
    m = options.min_chunk_bytes

    loads = [0] * world_size
    pieces: list[Piece] = []
    replicated: list[Item] = []
    for item in items:
        if len(item.owners) == 1:
            pieces.append(Piece(item.key, item.owners[0], item.nbytes))
            loads[item.owners[0]] += cost.cost(item.nbytes)
        else:
            replicated.append(item)

    total = sum(loads) + sum(cost.cost(i.nbytes) for i in replicated)
    target = -(-total // world_size)
    slack = max(math.ceil(options.epsilon * target), 2 * m + h)
    granularity = slack - m - h
    state = _Loads(loads)

    queue: list[tuple[int, str, int, _Unit]] = []
    seq = itertools.count()

    def push(unit: _Unit) -> None:
        n = unit.nbytes()
        c = cost.cost(n, len(unit.items))
        heapq.heappush(queue, (-c, unit.items[0].sort_key, next(seq), unit))

    if options.group:
        groups: dict[tuple[str, tuple[int, ...]], list[Item]] = {}
        for item in replicated:
            groups.setdefault((item.group, item.owners), []).append(item)
        for (name, _), members in sorted(groups.items(), key=lambda kv: kv[0]):
            if name and len(members) > 1:
                push(_Unit(tuple(sorted(members, key=lambda i: i.sort_key))))
            else:
                for item in members:
                    push(_Unit((item,)))
    else:
        for item in replicated:
            push(_Unit((item,)))

    while queue:
        neg_cost, _, _, unit = heapq.heappop(queue)
        c = -neg_cost
        owners = unit.items[0].owners
        r = state.argmin(owners)
        fits = state.loads[r] + c <= target + slack
        if len(unit.items) > 1:
            if fits:
                for item in unit.items:
                    pieces.append(Piece(item.key, r, item.nbytes))
                state.add(r, c)
            else:
                for item in unit.items:
                    push(_Unit((item,)))
            continue

        (item,) = unit.items
        dim = unit.dim
        if dim is None and not fits and options.split and item.shape is not None:
            dim = choose_split_dim(item.shape, item.itemsize, granularity)
            if dim is not None:
                unit = _Unit(unit.items, 0, item.shape[dim], dim)
        if unit.dim is None:  # whole item
            pieces.append(Piece(item.key, r, item.nbytes))
            state.add(r, c)
            continue

        assert item.shape is not None
        slab = slab_bytes(item.shape, item.itemsize, dim)
        k_min = -(-m // slab) if slab else 1
        remaining = unit.hi - unit.lo
        if fits or slab == 0 or slab > granularity or remaining < 2 * k_min:
            k = remaining
        else:
            budget = target - state.loads[r] - h
            k = min(max(budget // slab, k_min), remaining - k_min)
        if k == item.shape[dim]:  # the cut would cover everything: place it whole
            pieces.append(Piece(item.key, r, item.nbytes))
            state.add(r, c)
            continue
        offsets = tuple(unit.lo if d == dim else 0 for d in range(len(item.shape)))
        sizes = tuple(k if d == dim else s for d, s in enumerate(item.shape))
        pieces.append(Piece(item.key, r, k * slab, offsets, sizes))
        state.add(r, cost.cost(k * slab))
        if k < remaining:
            push(_Unit(unit.items, unit.lo + k, unit.hi, dim))

    return Partition(tuple(pieces), tuple(state.loads), target, slack)

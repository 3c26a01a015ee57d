"""Balanced assignment of replicated items to ranks (makespan, with splitting).

The algorithm, in cost units (byte-equivalents, see ``cost.py``):

1. Items with one owner stay there; their costs start the per-rank loads.
2. ``T = ceil(total cost / n)`` is the target load, and the slack is
   ``s = max(ceil(epsilon * T), 2 * m + h)`` where ``m`` is the minimum chunk
   size in bytes and ``h`` the per-item overhead. Unless given, ``m`` is 16 KiB
   or, where that would widen the slack past ``epsilon * T``, ``(ceil(epsilon *
   T) - h) // 2``, but at least ``h`` (a piece is worth its overhead) and 1:
   BERT-large + AdamW at 16k ranks gives each rank 268 KB, and a fixed 16 KiB
   would leave 13% slack.
3. Replicated *units* are processed largest first (ties broken by
   ``sort_key``): a unit is a group (several items of one sub-collection with
   the same owners) or a single item, or the unplaced remainder of a split item.
   Each goes to its least-loaded owner ``r`` (ties: lowest rank):

   * whole, if ``L_r + cost <= T + s``;
   * a group that does not fit is dissolved into its items (re-queued);
   * a splittable item that does not fit is cut: a slab of ``k`` indices along
     one dimension (the geometry below) sized to fill ``r`` up to ``T``, but at least
     ``m`` bytes and leaving at least ``m`` bytes; the remainder is re-queued.
     The dimension is one whose slabs are at most ``g = s - m - h`` bytes, or,
     if none is that fine, the finest one (a *coarse* cut: at least one slab);
   * anything else (bytes objects, sharded chunks, tensors with no dimension
     of extent 2 or more, items and remainders with fewer than ``2 * ceil(m /
     slab)`` slabs: no two pieces of ``m`` bytes) goes whole to ``r``.

**Bound.** Let ``M = ceil(final total cost / n)`` be the mean load rounded up
(the final total exceeds the initial one by ``h`` per extra piece, so ``M >=
T``), ``O`` the largest load of owned items alone, ``U`` the largest cost of
a replicated item that could not be cut, ``V`` the largest ``slab + h`` of an
item cut coarsely, and ``R`` the largest cost of an item or remainder placed
whole for having too few slabs, ``R < 2 * ceil(m / slab) * slab + h <= 2(m +
slab) + h``. If every replicated item is held by all ranks (data
parallelism), then::

    max_r L_r <= max(O, M + max(s, U, V, R))

so ``max/mean <= 1 + max(epsilon*T, 2m + h, U, V, R) / mean`` whenever ``O <= M``.
``R`` exceeds ``s`` only where a slab does not divide ``m`` and the item has
few slabs (hypothesis found 39 slabs of 3,000 bytes over 12 ranks with ``m =
4096``: 18,000 bytes on one rank for a mean of 9,750); at scale the big
items have thousands of rows and ``R`` stays under ``s``.

*Proof.* Loads only grow, so when a unit is placed the least-loaded rank has
``L_r <= current mean <= M``. A whole placement is made only if ``L_r + c <=
T + s``, or for an unsplittable item (``L_r + c <= M + U``), or for an item
or remainder with too few slabs (``L_r + c <= M + R``). A cut piece has ``k``
slabs, where ``k`` is the largest count with ``k*slab + h <= T - L_r``,
raised to at least ``ceil(m/slab)`` slabs: so ``c <= max(T - L_r, m + slab +
h)``. With ``slab <= g`` that gives ``L_r + c <= max(T, L_r) + s <= M + s``;
a coarse cut has ``slab > g >= m``, so at least one slab is ``ceil(m/slab) =
1`` and ``L_r + c <= max(T, L_r + slab + h) <= M + V``. Every placement keeps
its rank within the bound, and a rank's final load is its load after its last
placement. ∎

Complexity: ``O((I + P) log(I + n))`` for ``I`` items, ``P`` pieces and ``n``
ranks, using a heap of loads (lazy deletion) for units held by all ranks;
units held by a subset of ranks scan that subset.

What the partitioner works on: items to place and the pieces it places.
Deliberately free of torch and DCP types so the algorithm can be tested (and
fuzzed) in isolation; ``planner.py`` translates DCP ``WriteItem``s to these.

Both are immutable ``NamedTuple``s rather than frozen dataclasses: the planner
makes one per stored item on every save, and a frozen dataclass costs
several times as much to build (one ``object.__setattr__`` per field), a
large share of planning time at small world sizes.

Geometry of splitting a tensor into boxes along one dimension. A tensor is cut
along a single dimension ``d`` into slabs of whole indices of ``d`` (full extent
in every other dimension), so every piece is an ordinary DCP chunk (offsets +
sizes). Dimension 0 is preferred: its pieces are contiguous in memory and need
no copy. A later dimension is used only when one row (one index of dim 0) is too
coarse for the balance slack, e.g. a ``(2, 10**9)`` tensor, and has finer slabs.

Balancing sizes into bins, :func:`balance`: :func:`partition` without splits.
The writer spreads one rank's items over its data files (one per writing
thread) this way: largest first, each to the least-loaded bin (LPT).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import PlanningError
from .cost import CostModel

__all__ = [
    "DEFAULT_MIN_CHUNK_BYTES",
    "Item",
    "Partition",
    "PartitionOptions",
    "Piece",
    "balance",
    "choose_split_dim",
    "partition",
    "slab_bytes",
]


class Item(NamedTuple):
    """One stored object (a tensor chunk or a bytes blob) as the partitioner sees it.

    Attributes:
        key: the caller's identifier (returned in every ``Piece`` of this item).
        nbytes: bytes to store.
        owners: ranks that hold this item, sorted. One owner: it stays there.
            Several: any of them may write it (replicated data).
        sort_key: total order for deterministic tie-breaking (e.g. "fqn@offsets")
            among replicated items; never read for an item with one owner.
        group: sub-collection name; items of one group stay on one rank when
            balance allows. ``""`` means no group. Replicated items only.
        shape: element shape if the item may be split into sub-boxes (plain
            replicated tensors); ``None`` if it must be written whole.
        itemsize: bytes per element (with ``shape``).
    """

    key: int
    nbytes: int
    owners: tuple[int, ...]
    sort_key: str
    group: str = ""
    shape: tuple[int, ...] | None = None
    itemsize: int = 1


class Piece(NamedTuple):
    """An item, or a box of it, assigned to one rank.

    ``offsets``/``sizes`` are ``None`` for a whole item; otherwise the box
    (in elements) relative to the item, with ``sizes`` covering all dims.
    """

    key: int
    rank: int
    nbytes: int
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None

    @property
    def is_split(self) -> bool:
        """Whether this piece is a box of its item rather than the whole item."""
        return self.offsets is not None


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


#: The minimum chunk when none is given, unless the ranks' share is too small for it.
DEFAULT_MIN_CHUNK_BYTES = 16 << 10


@dataclass(frozen=True)
class PartitionOptions:
    """Knobs of :func:`partition`.

    Attributes:
        epsilon: relative balance slack (see the module's bound).
        min_chunk_bytes: no piece of a split item is smaller than this. ``None``:
            16 KiB, less where each rank's share is small (see the module
            docstring); :attr:`Partition.min_chunk` says what was used.
        split: allow splitting replicated tensors.
        group: keep items of one sub-collection together when balance allows.
    """

    epsilon: float = 0.01
    min_chunk_bytes: int | None = None
    split: bool = True
    group: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.epsilon < 1:
            raise PlanningError(f"epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.min_chunk_bytes is not None and self.min_chunk_bytes < 1:
            raise PlanningError(f"min_chunk_bytes must be >= 1, got {self.min_chunk_bytes!r}")


@dataclass(frozen=True)
class Partition:
    """The result: every piece placed, per-rank loads in cost units, and the
    target, slack and minimum chunk (bytes) the placement used."""

    pieces: tuple[Piece, ...]
    loads: tuple[int, ...]
    target: int
    slack: int
    min_chunk: int

    def bytes_per_rank(self) -> list[int]:
        """Bytes each rank writes (the sum of its pieces' sizes), indexed by rank."""
        out = [0] * len(self.loads)
        for p in self.pieces:
            out[p.rank] += p.nbytes
        return out

    def items_per_rank(self) -> list[int]:
        """Pieces each rank writes, indexed by rank."""
        out = [0] * len(self.loads)
        for p in self.pieces:
            out[p.rank] += 1
        return out


class _Loads:
    """Per-rank loads with O(log n) argmin over all ranks (heap, lazy deletion)."""

    def __init__(self, loads: list[int]) -> None:
        self.loads = loads
        self._heap = [(load, r) for r, load in enumerate(loads)]
        heapq.heapify(self._heap)

    def argmin(self, owners: tuple[int, ...]) -> int:
        # Owners are sorted, unique and in range, so n of them are all ranks (no
        # element-wise comparison of two n-tuples per unit).
        if len(owners) == len(self.loads):
            while True:
                load, r = self._heap[0]
                if load == self.loads[r]:
                    return r
                heapq.heappop(self._heap)  # stale entry
        # min keeps the first of equal loads, and owners are sorted: ties go to the
        # lowest rank. A C-level key: FSDP's empty shards have thousands of owners.
        return min(owners, key=self.loads.__getitem__)

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
    *,
    check: bool = True,
) -> Partition:
    """Assign every item (whole or in pieces) to one rank; see the module docstring.

    Args:
        check: validate ``items`` first (unique keys, sorted in-range owners,
            shapes that match sizes). A caller that builds items from data it
            has already checked (``planner.py``) may skip it.

    Raises:
        PlanningError: on inconsistent items (with ``check``).
    """
    cost = cost or CostModel()
    options = options or PartitionOptions()
    if check:
        _validate(items, world_size)
    elif world_size < 1:
        raise PlanningError(f"world_size must be >= 1, got {world_size}")
    h = cost.overhead_bytes

    loads = [0] * world_size
    pieces: list[Piece] = []
    replicated: list[Item] = []
    for item in items:
        if len(item.owners) == 1:
            r = item.owners[0]
            pieces.append(Piece(item.key, r, item.nbytes))
            loads[r] += item.nbytes + h
        else:
            replicated.append(item)

    total = sum(loads) + sum(i.nbytes for i in replicated) + h * len(replicated)
    target = -(-total // world_size)
    tolerance = math.ceil(options.epsilon * target)
    m = options.min_chunk_bytes
    if m is None:
        m = min(DEFAULT_MIN_CHUNK_BYTES, max(1, h, (tolerance - h) // 2))
    slack = max(tolerance, 2 * m + h)
    limit = target + slack
    granularity = slack - m - h
    state = _Loads(loads)

    # Queue entries are plain tuples (-cost, sort_key, seq, items, lo, hi, dim):
    # a group of whole items (dim None), or an item's unplaced slab range
    # [lo, hi) along dim once it has been cut. seq is unique, so comparison
    # never reaches the items.
    seq = itertools.count()
    queue: list[tuple] = []
    if options.group:
        groups: dict[tuple[str, tuple[int, ...]], list[Item]] = {}
        for item in replicated:
            groups.setdefault((item.group, item.owners), []).append(item)
        for (name, _), members in groups.items():
            if name and len(members) > 1:
                members.sort(key=lambda i: i.sort_key)
                c = sum(i.nbytes for i in members) + h * len(members)
                queue.append((-c, members[0].sort_key, next(seq), tuple(members), 0, 0, None))
            else:
                for i in members:
                    queue.append((-(i.nbytes + h), i.sort_key, next(seq), (i,), 0, 0, None))
    else:
        for i in replicated:
            queue.append((-(i.nbytes + h), i.sort_key, next(seq), (i,), 0, 0, None))
    # Seq numbers follow input order, which may differ between callers; pop
    # order must not. Renumber after sorting on (cost, sort_key), which with
    # unique sort keys is a total order of the initial units.
    queue.sort(key=lambda e: (e[0], e[1]))
    queue = [(e[0], e[1], n, *e[3:]) for n, e in enumerate(queue)]
    seq = itertools.count(len(queue))
    # A sorted list is already a heap.

    while queue:
        neg_cost, sort_key, _, unit, lo, hi, dim = heapq.heappop(queue)
        c = -neg_cost
        item = unit[0]
        r = state.argmin(item.owners)
        fits = state.loads[r] + c <= limit
        if len(unit) > 1:
            if fits:
                for i in unit:
                    pieces.append(Piece(i.key, r, i.nbytes))
                state.add(r, c)
            else:
                for i in unit:
                    entry = (-(i.nbytes + h), i.sort_key, next(seq), (i,), 0, 0, None)
                    heapq.heappush(queue, entry)
            continue

        if dim is None:
            if fits or not options.split or item.shape is None:
                pieces.append(Piece(item.key, r, item.nbytes))
                state.add(r, c)
                continue
            dim = choose_split_dim(item.shape, item.itemsize, granularity)
            if dim is None:
                pieces.append(Piece(item.key, r, item.nbytes))
                state.add(r, c)
                continue
            lo, hi = 0, item.shape[dim]

        shape = item.shape
        assert shape is not None
        slab = slab_bytes(shape, item.itemsize, dim)
        k_min = -(-m // slab) if slab else 1
        remaining = hi - lo
        if fits or slab == 0 or remaining < 2 * k_min:
            k = remaining
        else:
            budget = target - state.loads[r] - h
            k = min(max(budget // slab, k_min), remaining - k_min)
        if k == shape[dim]:  # the cut would cover everything: place it whole
            pieces.append(Piece(item.key, r, item.nbytes))
            state.add(r, c)
            continue
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(k if d == dim else s for d, s in enumerate(shape))
        pieces.append(Piece(item.key, r, k * slab, offsets, sizes))
        state.add(r, k * slab + h)
        if k < remaining:
            rest = (hi - lo - k) * slab + h
            heapq.heappush(queue, (-rest, sort_key, next(seq), unit, lo + k, hi, dim))

    return Partition(tuple(pieces), tuple(state.loads), target, slack, m)


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

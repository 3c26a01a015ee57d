"""DCP save-plan bookkeeping behind :class:`~dcp_multilevel.BalancedSavePlanner`.

What the planner does with DCP's own types around the pure partitioning of
``planning/`` (which knows nothing of DCP):

- :func:`collect`: deduplicate the ranks' local plans into distinct items and
  the ranks holding each, refusing replicas that disagree on what they are;
- :func:`final_item`: the global plan's ``WriteItem`` for one piece of an
  item, recorded in DCP's ``Metadata`` as ``create_default_global_save_plan``
  would;
- :func:`check_replicas`: refuse replicated items whose bytes differ between
  ranks (``verify_replicas``);
- :func:`tiling_errors`: DCP's validation of the final plan (chunks in bounds,
  disjoint, covering each tensor), run by ``planning.chunk_errors``;
- :func:`merge_mappings`, :func:`piece_order`: small functions of the same pass;
- :class:`KeptLocalPlan`: a rank's last local plan, taken again for a state
  laid out as the last one.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import PlanningError
from ..format.health import Finding
from ..planning import Piece, chunk_errors

__all__ = [
    "KeptLocalPlan",
    "check_replicas",
    "collect",
    "final_item",
    "merge_mappings",
    "piece_order",
    "tiling_errors",
]

#: Looked up once: final_item runs once per piece, 1.8M times at 16k FSDP ranks.
_SHARD = WriteItemType.SHARD


class KeptLocalPlan:
    """A rank's last local plan and the layout of the (flattened) state it was made from.

    DCP makes every local plan anew: per tensor a ``WriteItem``, its index,
    chunk and properties, about 10,500 objects for GPT-2-medium's 1,168
    tensors with AdamW. They live until the next save, so Python's cyclic
    collector moves them to its oldest generation, and every so many of them
    start a full collection of the whole heap (with the manifest's, one every
    few saves, each a pause that grows with the heap), on the save's thread,
    holding the GIL the training thread needs.
    A state laid out as the last one (the same keys in the same order, from
    the same nesting; per tensor the shape, dtype, layout, ``requires_grad``
    and pinning DCP's items record; per DTensor also its spec) gets the last
    plan again: the same items DCP would make. States holding other kinds of
    sharded values (``ShardedTensor``, a custom ``__create_write_items__``)
    are not kept.

    Call order, per save: :meth:`plan_for`; where it gives None, the caller
    makes the plan and hands it to :meth:`keep`.
    """

    def __init__(self) -> None:
        self._layout: list[tuple[Any, ...]] | None = None
        self._coordinator = False
        self.plan: SavePlan | None = None

    def plan_for(
        self, state_dict: dict[str, Any], is_coordinator: bool, paths: dict[str, Any]
    ) -> SavePlan | None:
        """The kept plan if ``state_dict`` (flattened; ``paths``: where each key came
        from in the nested state, DCP's ``planner_data``) is laid out as the one it
        was made from."""
        layout = self._layout
        if layout is None or is_coordinator != self._coordinator or len(layout) != len(state_dict):
            return None
        # Compared entry by entry: a new layout would be one more object per entry kept.
        for (fqn, value), kept in zip(state_dict.items(), layout, strict=True):
            if _layout_entry(fqn, value, paths.get(fqn)) != kept:
                return None
        return self.plan

    def keep(
        self,
        state_dict: dict[str, Any],
        is_coordinator: bool,
        paths: dict[str, Any],
        plan: SavePlan,
    ) -> None:
        """Keep ``plan``, made for ``state_dict`` (nothing is kept for a state with
        values of a kind whose items this cannot tell apart)."""
        layout = [_layout_entry(fqn, value, paths.get(fqn)) for fqn, value in state_dict.items()]
        ok = all(entry is not None for entry in layout)
        self._layout = layout if ok else None
        self._coordinator = is_coordinator
        self.plan = plan if ok else None

    # A copy sent to another process (DCP's PROCESS executor pickles the planner)
    # starts empty: the plan it keeps is made there, and a layout may hold device
    # meshes that have no business travelling.
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()


def _layout_entry(fqn: str, value: Any, path: Any) -> tuple[Any, ...] | None:
    """What DCP's local write items for ``value`` depend on, and the key's ``path``
    (None: not known here); the branches follow DCP's own ``_create_write_items``.
    (DCP's plan cache compares plans without their dtypes or paths: a state nested
    otherwise under the same flat keys would have kept its last ``planner_data``.)"""
    if isinstance(value, DTensor):
        # Its item: the global shape, the mesh and placements (the spec), and the
        # properties of to_local(), whose requires_grad is the DTensor's.
        local = value._local_tensor
        if hasattr(local, "__create_write_items__"):
            return None
        pinned = local.is_pinned()
        return (fqn, path, value._spec, local.dtype, local.layout, value.requires_grad, pinned)
    if hasattr(value, "__create_write_items__") or isinstance(value, ShardedTensor):
        return None
    if isinstance(value, torch.Tensor):
        pinned = value.is_pinned()
        return (fqn, path, value.shape, value.dtype, value.layout, value.requires_grad, pinned)
    return (fqn, path)  # a bytes item


def merge_mappings(mappings: list[dict]) -> dict:
    """``dict(ChainMap(*mappings))``: earlier mappings win. Faster at many ranks,
    where ChainMap looks every key up through the whole chain."""
    merged: dict = {}
    for m in reversed(mappings):
        merged.update(m)
    return merged


def collect(all_plans: list[SavePlan]) -> tuple[list[WriteItem], list[tuple[int, ...]]]:
    """Deduplicate: each distinct item (first occurrence) and the sorted ranks holding it.

    Raises PlanningError when two ranks hold one key (fqn, offset) with a
    different type, shape or dtype: deduplicating would silently pick one.

    This loop runs over ranks x items (1.6M at 1024 ranks for BERT-large +
    AdamW, 26M at 16k), so it keys by (fqn, offset) tuples, hashed in C, not
    by MetadataIndex, whose generated __hash__/__eq__ run in Python. In data
    parallelism most local plans are identical: a rank whose keys and
    signatures equal the previous rank's (one list comparison in C) joins that
    run of ranks without touching the per-item dictionary.

    Memory: only the current run's rows and slots are kept; a finished run is
    folded into ``holders`` at once. (Keeping every run's rows would hold all
    26M rows, ~100 bytes each, at 16k FSDP ranks, where every plan differs.)
    """
    slot: dict[tuple[str, Any], int] = {}
    first: list[WriteItem] = []
    signature: list[tuple[Any, ...]] = []
    # Ranks holding each slot, ascending: runs are folded in in rank order.
    holders: list[list[int]] = []
    run_rows: list[tuple] | None = None
    run_slots: list[int] = []
    run_ranks: list[int] = []
    runs = 0
    for rank, plan in enumerate(all_plans):
        items = plan.items
        # One row per item: its key (fqn, offset), then what replicas must agree
        # on. Built inline: a function call per item of every rank is a visible share of
        # planning at a thousand ranks (benchmarks/bench_plan_scale.py).
        rows = [
            (i.fqn, i.offset, w.type)
            if (td := w.tensor_data) is None
            else (i.fqn, i.offset, w.type, td.size, td.chunk.sizes, td.properties.dtype)
            for w in items
            for i in (w.index,)
        ]
        if run_rows is not None and rows == run_rows:
            run_ranks.append(rank)
            continue
        _hold(holders, run_slots, run_ranks)
        if run_rows is not None and len(rows) == len(run_rows):
            # Sharded states: every rank lists the same tensors in the same order,
            # and most rows equal the previous rank's (FSDP's empty shards past a
            # tensor's last row, the optimizer's scalars: 24M of 26M rows at 16k
            # ranks). An equal row has the previous rank's slot; compared in C,
            # only the others go through the dictionary.
            same = list(map(operator.eq, rows, run_rows))
            slots = [i if equal else -1 for i, equal in zip(run_slots, same, strict=True)]
            todo: Iterable[int] = itertools.compress(range(len(rows)), map(operator.not_, same))
        else:
            slots = [-1] * len(rows)
            todo = range(len(rows))
        for j in todo:
            row = rows[j]
            key = row[:2]
            i = slot.get(key)
            if i is None:
                i = slot[key] = len(first)
                first.append(items[j])
                signature.append(row)
                holders.append([])
            elif row != signature[i]:
                # holders[i] has every earlier run's ranks; empty: i is this rank's twice.
                _raise_mismatch(first[i], items[j], holders[i][0] if holders[i] else rank, rank)
            slots[j] = i
        run_rows, run_slots, run_ranks = rows, slots, [rank]
        runs += 1

    if runs == 1:  # the data-parallel case: one shared owner tuple
        everyone = tuple(run_ranks)
        return first, [everyone] * len(first)
    _hold(holders, run_slots, run_ranks)
    # One tuple per distinct owner set: FSDP's empty shards and the optimizer's
    # scalars are held by thousands of ranks each, alike. dict.fromkeys drops a
    # rank listed twice (an item twice in one plan) and keeps the ascending order.
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}
    owners = []
    for h in holders:
        t = (h[0],) if len(h) == 1 else tuple(dict.fromkeys(h))
        owners.append(shared.setdefault(t, t))
    return first, owners


def _hold(holders: list[list[int]], slots: list[int], ranks: list[int]) -> None:
    """Record that every rank of a finished run holds every slot of its plan."""
    if len(ranks) == 1:
        (rank,) = ranks
        for i in slots:
            holders[i].append(rank)
    else:
        for i in slots:
            holders[i].extend(ranks)


def piece_order(p: Piece) -> tuple[int, tuple[int, ...]]:
    """Sort key of a rank's pieces: item order, then a split item's pieces by offset."""
    return (p.key, p.offsets or ())


def final_item(w: WriteItem, piece: Piece, md: dict[str, Any]) -> WriteItem:
    """The global plan's item for ``piece`` of ``w``, recorded in ``md`` (DCP's Metadata).

    As ``create_default_global_save_plan``: the index hint is the chunk's
    position in its tensor's chunk list.
    """
    fqn = w.index.fqn
    td = w.tensor_data
    if td is None:
        if fqn in md:
            raise PlanningError(f"item {fqn!r} is saved twice: as a bytes object and another item")
        md[fqn] = BytesStorageMetadata()
        return w
    tmd = md.get(fqn)
    if tmd is None:
        tmd = md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
    elif not isinstance(tmd, TensorStorageMetadata) or (
        w.type is not _SHARD and piece.offsets is None
    ):
        # DCP's create_default_global_save_plan asserts the same.
        raise PlanningError(
            f"item {fqn!r} is saved twice: as a whole tensor and as another item; "
            "every state-dict key must name one tensor, sharded or whole"
        )
    hint = len(tmd.chunks)
    if piece.offsets is None:
        chunk = td.chunk
        item = WriteItem(
            index=MetadataIndex(fqn, w.index.offset, hint),
            type=w.type,
            tensor_data=td,
        )
    else:
        chunk = ChunkStorageMetadata(
            offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes)
        )
        item = WriteItem(
            index=MetadataIndex(fqn, chunk.offsets, hint),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=td.properties, size=td.size),
        )
    tmd.chunks.append(chunk)
    return item


def tiling_errors(metadata: Metadata, world_size: int) -> list[str]:
    """What DCP's ``_validate_global_plan`` would report for ``metadata``, ``'fqn': problem`` each.

    Same checks and verdicts (``planning/chunks.py``), without DCP's quadratic
    sweep over row-sharded tensors; as there, coverage is checked only for
    more than one rank.
    """
    errors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            boxes = [(c.offsets, c.sizes) for c in md.chunks]
            problems = chunk_errors(md.size, boxes, must_cover=world_size > 1)
            errors.extend(f"{fqn!r}: {p}" for p in problems)
    return errors


def _raise_mismatch(a: WriteItem, b: WriteItem, rank_a: int, rank_b: int) -> None:
    """Replicas disagree on what they are: dedup would silently pick one."""

    def describe(w: WriteItem) -> str:
        if w.tensor_data is None:
            return "a bytes object"
        td = w.tensor_data
        return f"a {tuple(td.chunk.sizes)} {td.properties.dtype} {w.type.name.lower()}"

    raise PlanningError(
        f"item {a.index.fqn!r} is {describe(a)} on rank {rank_a} but {describe(b)} on "
        f"rank {rank_b}; every rank must hold the same structure for a replicated item"
    )


def check_replicas(
    digests: list[dict[MetadataIndex, str]],
) -> tuple[list[Finding], dict[MetadataIndex, frozenset[int]]]:
    """Compare every replicated item's digests across the ranks that hold it.

    Returns the findings (one per kind: outvoted copies, or copies with no
    majority; ``format/health.py``) and, per item with a strict majority, the
    ranks outvoted: they must not write it, so the majority's bytes are stored.
    With no majority (two copies that differ) every holder may write it; the
    save is quarantined either way.
    """
    by_index: dict[MetadataIndex, dict[str, list[int]]] = defaultdict(dict)
    for rank, per_item in enumerate(digests):
        for index, digest in per_item.items():
            by_index[index].setdefault(digest, []).append(rank)
    outvoted: dict[MetadataIndex, frozenset[int]] = {}
    minority_items: list[str] = []
    minority_ranks: set[int] = set()
    split_items: list[str] = []
    split_ranks: set[int] = set()
    for index, groups in by_index.items():
        if len(groups) < 2:
            continue
        holders = sum(len(r) for r in groups.values())
        largest = max(groups.values(), key=len)
        if 2 * len(largest) > holders:
            others = frozenset(r for g in groups.values() if g is not largest for r in g)
            outvoted[index] = others
            minority_items.append(index.fqn)
            minority_ranks |= others
        else:
            split_items.append(index.fqn)
            split_ranks.update(r for g in groups.values() for r in g)
    findings = []
    if minority_items:
        findings.append(
            Finding(
                "replicas",
                "replicated tensors differ from the other ranks' copies; the "
                "majority's bytes are written",
                tuple(sorted(set(minority_items))),
                tuple(sorted(minority_ranks)),
            )
        )
    if split_items:
        findings.append(
            Finding(
                "replicas",
                "replicated tensors differ across ranks with no majority",
                tuple(sorted(set(split_items))),
                tuple(sorted(split_ranks)),
            )
        )
    return findings, outvoted

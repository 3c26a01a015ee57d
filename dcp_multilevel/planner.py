"""BalancedSavePlanner: DCP's DefaultSavePlanner with cost-balanced deduplication.

Stock DCP gives each replicated item, whole, to whichever rank has the
smallest plan so far, in insertion order; one big tensor late in the order
can make one rank write 2.5x the mean. This planner hands the assignment to
``planning.partition`` (largest first, splitting big replicated tensors into
DCP chunks, keeping sub-collections together) and otherwise behaves like the
default planner, so any ``StorageWriter`` can use it.

Call order (DCP's ``SavePlanner`` protocol; ``dcp.save`` drives it)::

    all ranks     set_up_planner -> create_local_plan
    coordinator   create_global_plan(all local plans)   # partition happens here
    all ranks     finish_plan -> resolve_data (per item, from the storage writer)
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .errors import PlanningError
from .format.tensor_bytes import byte_view
from .planning import CostModel, Item, PartitionOptions, Piece, partition

__all__ = ["BalancedSavePlanner", "parent_group", "write_item_nbytes"]

logger = logging.getLogger(__name__)


def parent_group(fqn: str) -> str:
    """Default sub-collection of an item: its FQN without the last component.

    ``model.layer.3.attn.weight`` and ``...attn.bias`` share ``model.layer.3.attn``;
    ``optim.state.<param>.exp_avg`` and ``.exp_avg_sq`` share ``optim.state.<param>``.
    """
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


@dataclasses.dataclass(frozen=True)
class _LocalPlannerData:
    """Local ``SavePlan.planner_data`` when replicas are verified."""

    mappings: Any
    digests: dict[MetadataIndex, str]


class BalancedSavePlanner(DefaultSavePlanner):
    """Save planner that balances replicated data across ranks by a cost model.

    Args:
        cost_model: per-rank cost (``bytes / bandwidth + items * overhead``).
        epsilon: balance slack; with splitting, max/mean cost is at most
            ``1 + max(epsilon, (2*min_chunk_bytes + overhead)/target, U/target)``
            (``U``: largest replicated item that cannot be split), see
            ``planning/partition.py``.
        min_chunk_bytes: no piece of a split tensor is smaller than this.
        split: allow splitting replicated tensors into row (or column) chunks.
        group_key: maps an FQN to its sub-collection (``None``: no grouping).
        verify_replicas: before deduplicating, check that every replicated
            item has the same bytes on every rank that holds it (hashes only
            travel); raise PlanningError naming the FQN and ranks otherwise.
        enable_plan_caching: reuse the global plan while local plans do not
            change (DCP's mechanism), per planner instance: reuse one planner
            across saves to benefit. Turned off by ``verify_replicas``, whose
            hashes change every step.
        flatten_state_dict, flatten_sharded_tensors: as in DefaultSavePlanner.
    """

    def __init__(
        self,
        *,
        cost_model: CostModel | None = None,
        epsilon: float = 0.01,
        min_chunk_bytes: int = 16 << 10,
        split: bool = True,
        group_key: Callable[[str], str] | None = parent_group,
        verify_replicas: bool = False,
        enable_plan_caching: bool = True,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
    ) -> None:
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            enable_plan_caching=enable_plan_caching and not verify_replicas,
        )
        self.cost_model = cost_model or CostModel()
        self.options = PartitionOptions(
            epsilon=epsilon,
            min_chunk_bytes=min_chunk_bytes,
            split=split,
            group=group_key is not None,
        )
        self.group_key = group_key
        self.verify_replicas = verify_replicas
        # DCP keys its plan cache by class name in class-level dicts, so two
        # planners (or one planner with two writers) would replay each other's
        # plans, storage_data included. Scope it to this instance, and drop the
        # entries when the instance goes away so per-save planners do not leak.
        self._cached_plans_key = f"{type(self).__name__}:{uuid.uuid4().hex}"
        weakref.finalize(self, _drop_cached_plans, self._cached_plans_key)
        #: The last partition's loads (cost units), for reports and tests.
        self.last_loads: tuple[int, ...] = ()

    # ------------------------------------------------------------------ local

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.verify_replicas and plan.usable:
            digests = {item.index: self._digest(item) for item in plan.items}
            plan = dataclasses.replace(
                plan, planner_data=_LocalPlannerData(plan.planner_data, digests)
            )
            self.plan = plan
        return plan

    def _digest(self, item: WriteItem) -> str:
        data = super().resolve_data(item)
        if isinstance(data, io.BytesIO):
            return xxhash.xxh3_64_hexdigest(data.getbuffer())
        t = data.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
        return xxhash.xxh3_64_hexdigest(byte_view(t))

    # ------------------------------------------------------------------ global

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # DefaultSavePlanner routes both its cached and uncached paths through here.
        if self.verify_replicas:
            _check_replicas(
                [
                    p.planner_data.digests if isinstance(p.planner_data, _LocalPlannerData) else {}
                    for p in all_plans
                ]
            )
        all_plans = [
            dataclasses.replace(p, planner_data=p.planner_data.mappings)
            if isinstance(p.planner_data, _LocalPlannerData)
            else p
            for p in all_plans
        ]
        global_plan, metadata = self._balance(all_plans)
        if self.flatten_state_dict:
            merged = _merge_mappings([p.planner_data for p in global_plan if p.planner_data])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = _validate_global_plan(global_plan, metadata)
        if errors:
            raise PlanningError(f"balanced plan failed DCP's validation: {'; '.join(errors)[:500]}")
        return global_plan, metadata

    def _balance(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Deduplicate, partition, and build the final plans and their Metadata in one pass.

        Does the work of DCP's ``dedup_save_plans`` + ``create_default_global_save_plan``
        (index hints numbered per FQN in rank order, as there) without their
        per-item ``dataclasses.replace`` calls, which cost more than the partitioning.
        """
        world = len(all_plans)
        first, owners = _collect(all_plans)

        group_key = self.group_key
        tensor = WriteItemType.TENSOR
        items = []
        for key, w in enumerate(first):
            index = w.index
            fqn = index.fqn
            offset = index.offset
            holders = owners[key]
            td = w.tensor_data
            # Unique per item and cheap: most items have no offset, or all zeros.
            sort_key = fqn if offset is None or not any(offset) else f"{fqn}@{tuple(offset)}"
            splittable = len(holders) > 1 and w.type == tensor and td is not None and td.chunk.sizes
            items.append(
                Item(
                    key,
                    write_item_nbytes(w),
                    holders,
                    sort_key,
                    group_key(fqn) if group_key else "",
                    tuple(td.chunk.sizes) if splittable else None,
                    td.properties.dtype.itemsize if td is not None else 1,
                )
            )
        # Items come from the checks above (owners sorted and in range, keys unique).
        result = partition(items, world, self.cost_model, self.options, check=False)
        self.last_loads = result.loads

        # Per rank, items in the order of the first local plan that had them
        # (state-dict order, as stock DCP keeps them); pieces of one item by offset.
        per_rank: list[list[Piece]] = [[] for _ in range(world)]
        for piece in result.pieces:
            per_rank[piece.rank].append(piece)
        md: dict[str, Any] = {}
        plans = []
        for plan, pieces in zip(all_plans, per_rank, strict=True):
            pieces.sort(key=_piece_order)
            plans.append(
                dataclasses.replace(plan, items=[_final_item(first[p.key], p, md) for p in pieces])
            )
        return plans, Metadata(md)

    # ------------------------------------------------------------------ resolve

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        obj = self.state_dict.get(write_item.index.fqn) if write_item.tensor_data else None
        if (
            write_item.type == WriteItemType.SHARD
            and type(obj) in (torch.Tensor, torch.nn.Parameter)
            and write_item.tensor_data is not None
        ):
            # A piece of a plain (replicated) tensor that this planner split:
            # its chunk offsets are relative to the whole tensor.
            t = obj
            chunk = write_item.tensor_data.chunk
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                if size != t.shape[dim]:
                    t = t.narrow(dim, off, size)
            return t
        return super().resolve_data(write_item)


def _merge_mappings(mappings: list[dict]) -> dict:
    """``dict(ChainMap(*mappings))``: earlier mappings win. Faster at many ranks,
    where ChainMap looks every key up through the whole chain."""
    merged: dict = {}
    for m in reversed(mappings):
        merged.update(m)
    return merged


def _drop_cached_plans(key: str) -> None:
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.pop(key, None)


def write_item_nbytes(w: WriteItem) -> int:
    """Bytes DCP stores for ``w`` (a tensor chunk's elements, or a bytes item's size)."""
    if w.tensor_data is None:
        return w.bytes_io_data.nbytes if w.bytes_io_data is not None else 0
    return math.prod(w.tensor_data.chunk.sizes) * w.tensor_data.properties.dtype.itemsize


class _PlanClass:
    """Ranks whose local plans list the same items (keys and signatures) in the same order."""

    def __init__(self, rows: list[tuple], slots: list[int], rank: int) -> None:
        self.rows = rows
        self.slots = slots
        self.ranks = [rank]


def _collect(all_plans: list[SavePlan]) -> tuple[list[WriteItem], list[tuple[int, ...]]]:
    """Deduplicate: each distinct item (first occurrence) and the sorted ranks holding it.

    Raises PlanningError when two ranks hold one key (fqn, offset) with a
    different type, shape or dtype: deduplicating would silently pick one.

    This loop runs over ranks x items (1.6M at 1024 ranks for BERT-large +
    AdamW), so it keys by (fqn, offset) tuples, hashed in C, not by
    MetadataIndex, whose generated __hash__/__eq__ run in Python. In data
    parallelism most local plans are identical: a rank whose keys and
    signatures equal the previous class's (one list comparison in C) joins
    that class without touching the per-item dictionary.
    """
    slot: dict[tuple[str, Any], int] = {}
    first: list[WriteItem] = []
    signature: list[tuple[Any, ...]] = []
    holders: list[list[int]] = []
    classes: list[_PlanClass] = []
    last: _PlanClass | None = None
    for rank, plan in enumerate(all_plans):
        items = plan.items
        # One row per item: its key (fqn, offset), then what replicas must agree
        # on. Built inline (a function call per item costs ~1 s at 1024 ranks).
        rows = [
            (i.fqn, i.offset, w.type)
            if (td := w.tensor_data) is None
            else (i.fqn, i.offset, w.type, td.size, td.chunk.sizes, td.properties.dtype)
            for w in items
            for i in (w.index,)
        ]
        if last is not None and rows == last.rows:
            last.ranks.append(rank)
            continue
        slots = []
        for w, row in zip(items, rows, strict=True):
            key = row[:2]
            i = slot.get(key)
            if i is None:
                i = slot[key] = len(first)
                first.append(w)
                signature.append(row)
                holders.append([])
            elif row != signature[i]:
                _raise_mismatch(first[i], w, _first_holder(classes, i, rank), rank)
            slots.append(i)
        last = _PlanClass(rows, slots, rank)
        classes.append(last)

    if len(classes) == 1:  # the data-parallel case: one shared owner tuple
        everyone = tuple(classes[0].ranks)
        return first, [everyone] * len(first)
    for c in classes:
        for i in c.slots:
            holders[i].extend(c.ranks)
    return first, [tuple(sorted(set(h))) for h in holders]


def _first_holder(classes: list[_PlanClass], i: int, rank: int) -> int:
    """The lowest rank whose plan holds slot ``i`` (for error messages)."""
    return min((c.ranks[0] for c in classes if i in c.slots), default=rank)


def _piece_order(p: Piece) -> tuple[int, tuple[int, ...]]:
    return (p.key, p.offsets or ())


def _final_item(w: WriteItem, piece: Piece, md: dict[str, Any]) -> WriteItem:
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
        w.type != WriteItemType.SHARD and not piece.is_split
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


def _check_replicas(digests: list[dict[MetadataIndex, str]]) -> None:
    """Raise when a replicated item hashes differently on the ranks that hold it."""
    by_index: dict[MetadataIndex, dict[str, list[int]]] = defaultdict(dict)
    for rank, per_item in enumerate(digests):
        for index, digest in per_item.items():
            by_index[index].setdefault(digest, []).append(rank)
    differing = sorted(
        ((index, groups) for index, groups in by_index.items() if len(groups) > 1),
        key=lambda e: (e[0].fqn, tuple(e[0].offset or ())),
    )
    if differing:
        index, groups = differing[0]
        variants = "; ".join(
            f"ranks {ranks} hold xxh3 {digest}"
            for digest, ranks in sorted(groups.items(), key=lambda g: g[1])
        )
        more = f" ({len(differing) - 1} more items differ)" if len(differing) > 1 else ""
        raise PlanningError(
            f"replicated item {index.fqn!r} is not equal on every rank: {variants}{more}. "
            "Stock DCP would silently keep one copy; make the replicas equal (e.g. broadcast "
            "from rank 0) or give them distinct names."
        )

"""BalancedSavePlanner: DCP's DefaultSavePlanner with cost-balanced deduplication.

Stock DCP gives each replicated item, whole, to whichever rank has the
smallest plan so far, in insertion order; one big tensor late in the order
can make one rank write 2.5x the mean. This planner hands the assignment to
``planning.partition`` (largest first, splitting big replicated tensors into
DCP chunks, keeping sub-collections together) and otherwise behaves like the
default planner, so any ``StorageWriter`` can use it. Its bookkeeping with
DCP's plan types (deduplication, final items and metadata, replica checks,
DCP's validation of the final plan) is in ``_plans.py``.

Call order (DCP's ``SavePlanner`` protocol; ``dcp.save`` drives it)::

    all ranks     set_up_planner -> create_local_plan
    coordinator   create_global_plan(all local plans)   # partition happens here
    all ranks     finish_plan -> resolve_data (per item, from the storage writer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import logging
import math
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from ..errors import PlanningError
from ..format.health import Finding
from ..planning import CostModel, Item, PartitionOptions, Piece, partition
from .plans import (
    KeptLocalPlan,
    check_replicas,
    collect,
    final_item,
    merge_mappings,
    piece_order,
    tiling_errors,
)
from .replicas import Digests, stripped, with_replicated

__all__ = ["BalancedSavePlanner", "parent_group", "write_item_nbytes"]

# The logger users configure, named as documented (not after this module).
logger = logging.getLogger("dcp_multilevel.planner")


def parent_group(fqn: str) -> str:
    """Default sub-collection of an item: its FQN without the last component.

    ``model.layer.3.attn.weight`` and ``...attn.bias`` share ``model.layer.3.attn``;
    ``optim.state.<param>.exp_avg`` and ``.exp_avg_sq`` share ``optim.state.<param>``.
    """
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


class BalancedSavePlanner(DefaultSavePlanner):
    """Save planner that balances replicated data across ranks by a cost model.

    Args:
        cost_model: per-rank cost (``bytes / bandwidth + items * overhead``).
        epsilon: balance slack; with splitting, max/mean cost is at most
            ``1 + max(epsilon, (2*min_chunk_bytes + overhead)/target, U/target,
            V/target)`` (``U``: largest replicated item that cannot be split;
            ``V``: the coarsest slab, one row or column, of a tensor cut more
            coarsely than the slack), see ``planning/partition.py``.
        min_chunk_bytes: no piece of a split tensor is smaller than this.
            ``None``: 16 KiB, less where each rank's share is too small for
            16 KiB pieces to keep ``epsilon`` (thousands of ranks).
        split: allow splitting replicated tensors into row (or column) chunks.
        group_key: maps an FQN to its sub-collection (``None``: no grouping).
        verify_replicas: before deduplicating, check that every replicated
            item has the same bytes on every rank that holds it (hashes only
            travel; the ``replicas`` health check, ``docs/health.md``). Copies
            that differ make the save quarantined, naming the items and ranks
            (:attr:`health_findings`, which ``MultiLevelWriter`` records; the
            planner logs them for any writer); with three or more copies and a
            majority, the ranks outvoted do not write them: the majority's
            bytes are stored. CPU tensors are hashed with xxh3, device tensors
            fingerprinted on their device (``planning/fingerprint.py``: 16
            bytes come back, not the tensor): a replica must live on the same
            kind of device on every rank.
        enable_plan_caching: reuse the global plan while local plans do not
            change (DCP's mechanism), per planner instance: reuse one planner
            across saves to benefit. Turned off by ``verify_replicas``, whose
            hashes change every step (the local plan of a state laid out as the
            last save's is still reused).
        flatten_state_dict, flatten_sharded_tensors: as in DefaultSavePlanner.
    """

    def __init__(
        self,
        *,
        cost_model: CostModel | None = None,
        epsilon: float = 0.01,
        min_chunk_bytes: int | None = None,
        split: bool = True,
        group_key: Callable[[str], str] | None = parent_group,
        verify_replicas: bool = True,
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
        weakref.finalize(self, drop_cached_plans, self._cached_plans_key)
        #: The last partition's loads (cost units), for reports and tests.
        self.last_loads: tuple[int, ...] = ()
        #: The coordinator, after the last global plan: what the replica check found.
        self.health_findings: tuple[Finding, ...] = ()
        self._outvoted: dict[MetadataIndex, frozenset[int]] = {}
        # The coordinator: per rank, the FQNs of its replicated items (replicas.py).
        self._replicated: list[tuple[str, ...]] = []
        self._digests = Digests()
        self._kept_local = KeptLocalPlan()

    # ------------------------------------------------------------------ local

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan; with ``verify_replicas``, plus an xxh3 digest of every item.

        A state laid out as the last save's gets the last plan again
        (:class:`~dcp_multilevel.plugin.plans.KeptLocalPlan`). Hashing resolves every
        item's data once more, on every rank.
        """
        if self.verify_replicas:  # (no plan caching: the digests change every step)
            return self._plan_with_digests()
        answer = self._answer_from_kept_plan()
        if answer is not None:
            return answer
        plan = super().create_local_plan()
        # Where DCP found its cached plan equal to the one it just made, keep the
        # cached one: the next save of this layout then finds it cached by identity.
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        made = cached if not plan.usable and cached is not None else self.plan
        self._kept_local.keep(self.state_dict, self.is_coordinator, self._paths(), made)
        return plan

    def _plan_with_digests(self) -> SavePlan:
        """The local plan (the kept one for a state laid out as the last save's) with
        the digests of the items other ranks may hold too (``replicas.py``)."""
        kept = self._kept_local.plan_for(self.state_dict, self.is_coordinator, self._paths())
        if kept is None:
            self._digests.forget()
            plan = super().create_local_plan()  # (DCP's caching is off: a plan, always)
            self._kept_local.keep(self.state_dict, self.is_coordinator, self._paths(), plan)
        else:
            plan = self._with_mappings(kept)
        self.plan = self._digests.attach(plan, super().resolve_data)
        return self.plan

    def _answer_from_kept_plan(self) -> SavePlan | None:
        """What DCP's ``create_local_plan`` would answer for a state laid out as the
        last save's, from the kept plan; None: DCP's own path makes the plan."""
        known = self._kept_local.plan is not None
        kept = self._kept_local.plan_for(self.state_dict, self.is_coordinator, self._paths())
        if kept is None:
            if known:
                # The layout changed. DCP compares plans without their tensors'
                # dtypes or the keys' paths, and would answer "unchanged" to a state
                # that changed only there: this rank would write under its last
                # plan, whose dtype is wrong (stock DCP records it in its metadata),
                # and the manifest would record the last nesting. Without its cached
                # plan DCP sends the new one.
                SavePlanner._cached_save_plan.pop(self._cached_plans_key, None)
            return None
        plan = self._with_mappings(kept)
        if not self._enable_plan_caching:
            self.plan = plan
            return plan
        # DCP answers "unchanged" when its cached plan equals this one: known by
        # identity once the last save got through (else DCP's own path compares).
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if cached is not None and cached.items is kept.items:
            self.plan = plan
            return SavePlan([], usable=False)
        return None

    def _with_mappings(self, kept: SavePlan) -> SavePlan:
        """The kept plan with this save's flatten mappings, as DCP's would carry them."""
        if not self.flatten_state_dict:
            return kept
        return dataclasses.replace(kept, planner_data=self.mappings)

    def _paths(self) -> dict[str, Any]:
        """Where each flattened key came from in the nested state (DCP's mappings)."""
        return self.mappings if self.flatten_state_dict else {}

    # ------------------------------------------------------------------ global

    def _create_global_plan_with_caching(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], list[SavePlan], Metadata]:
        # DCP sends a rank its new final plan only where it differs from the cached
        # one by DCP's comparison, which leaves out the tensors' dtypes: a rank whose
        # items changed only there would write under its stale plan. Sent whole then.
        before = SavePlanner._cached_global_plan.get(self._cached_plans_key)
        delta, global_plan, metadata = super()._create_global_plan_with_caching(all_plans)
        if before is not None and before is not global_plan and len(delta) == len(before):
            delta = [
                new if not sent.usable and old.items != new.items else sent
                for sent, old, new in zip(delta, before, global_plan, strict=True)
            ]
        return delta, global_plan, metadata

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # DefaultSavePlanner routes both its cached and uncached paths through here.
        with _collector_paused():
            return self._plan_globally(all_plans)

    def _plan_globally(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.health_findings, self._outvoted = (), {}
        if self.verify_replicas:
            digests, all_plans = stripped(all_plans)
            findings, self._outvoted = check_replicas(digests)
            self.health_findings = tuple(findings)
            for f in findings:
                logger.error("dcp_multilevel: the save is poisoned: %s", f.describe())
        global_plan, metadata = self._balance(all_plans)
        if self.flatten_state_dict:
            merged = merge_mappings([p.planner_data for p in global_plan if p.planner_data])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if self.verify_replicas:  # each rank learns which of its items are replicated
            global_plan = with_replicated(global_plan, self._replicated)
        # DCP's checks of the final plan. Pieces this planner cut tile their tensors
        # by construction; what can fail is chunks that the ranks sharded themselves.
        errors = tiling_errors(metadata, len(global_plan))
        if errors:
            raise PlanningError(
                "the ranks' chunks do not tile their tensors; every rank must shard a tensor "
                f"the same way. {len(errors)} found: {'; '.join(errors)[:500]}"
            )
        return global_plan, metadata

    def _balance(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Deduplicate, partition, and build the final plans and their Metadata in one pass.

        Does the work of DCP's ``dedup_save_plans`` + ``create_default_global_save_plan``
        (index hints numbered per FQN in rank order, as there) without their
        per-item ``dataclasses.replace`` calls, which cost more than the partitioning.
        """
        world = len(all_plans)
        first, owners = collect(all_plans)

        group_key = self.group_key
        tensor = WriteItemType.TENSOR
        items = []
        outvoted = self._outvoted
        for key, w in enumerate(first):
            holders = owners[key]
            if outvoted and w.index in outvoted:  # the majority's copies are written
                holders = tuple(r for r in holders if r not in outvoted[w.index])
            if len(holders) == 1:
                # Stays with its one holder: no ordering among replicas, no group
                # (saves building both for each of FSDP's 1.8M shards at 16k ranks).
                items.append(Item(key, write_item_nbytes(w), holders, ""))
                continue
            index = w.index
            fqn = index.fqn
            offset = index.offset
            td = w.tensor_data
            # Unique per item and cheap: most items have no offset, or all zeros.
            sort_key = fqn if offset is None or not any(offset) else f"{fqn}@{tuple(offset)}"
            splittable = w.type == tensor and td is not None and td.chunk.sizes
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
            pieces.sort(key=piece_order)
            plans.append(
                dataclasses.replace(plan, items=[final_item(first[p.key], p, md) for p in pieces])
            )
        if self.verify_replicas:
            self._replicated = [
                tuple(sorted({first[p.key].index.fqn for p in pieces if len(owners[p.key]) > 1}))
                for pieces in per_rank
            ]
        return plans, Metadata(md)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """As DCP's; with the replica check, this rank notes which of its items other
        ranks hold (its next save of this layout hashes only those)."""
        return super().finish_plan(self._digests.learn(self.plan, new_plan))

    # ------------------------------------------------------------------ resolve

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """As DCP's, and for a piece of a plain tensor this planner split, a view of that piece."""
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


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the coordinator plans.

    Planning allocates millions of small containers (a row per gathered item,
    holders, pieces, final items), and each allocation burst triggers
    collections; a full one traverses every live object, the gathered local
    plans included (tens of millions of objects at 16k ranks). Even with those
    plans frozen out of the collector's reach, the collections would take longer
    than the planning itself at a thousand FSDP ranks
    (``benchmarks/bench_plan_scale.py`` times planning). Nothing here builds
    reference cycles, so reference counting frees all of it as usual; only other
    threads' cyclic garbage waits until planning ends. ``gc.disable`` is
    process-wide: a collector turned off by someone else stays off, and one
    turned off by another thread during planning is turned back on here.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def drop_cached_plans(key: str) -> None:
    """Forget DCP's class-level plan cache entries under ``key`` (a planner's
    ``_cached_plans_key``; stock's is its class name)."""
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

"""BalancedSavePlanner: DCP's DefaultSavePlanner with cost-balanced deduplication.

Stock DCP gives each replicated item, whole, to whichever rank has the
smallest plan so far, in insertion order; one big tensor late in the order
can make one rank write 2.5x the mean. This planner hands the assignment to
``planning.partition`` (largest first, splitting big replicated tensors into
DCP chunks, keeping sub-collections together) and otherwise behaves like the
default planner, so any ``StorageWriter`` can use it. Its bookkeeping with
DCP's plan types (deduplication, final items and metadata, replica checks,
DCP's validation of the final plan) is below.

Call order (DCP's ``SavePlanner`` protocol; ``dcp.save`` drives it)::

    all ranks     set_up_planner -> create_local_plan
    coordinator   create_global_plan(all local plans)   # partition happens here
    all ranks     finish_plan -> resolve_data (per item, from the storage writer)

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

The replica check's digests: what each rank hashes, what travels, what it learns.
The planner with ``verify_replicas`` (the
``replicas`` health check, ``docs/health.md``) compares every replicated item's
copies before deduplicating (:func:`check_replicas`). The digests travel
with the local plans and the answer comes back with the final ones::

    every rank    create_local_plan   plan + LocalDigests(digests)     (Digests.attach)
    coordinator   create_global_plan  strip them (stripped), compare, partition;
                                      each final plan + FinalReplicated (with_replicated)
    every rank    finish_plan         learn which of its items are replicated (Digests.learn)

A rank hashes every item it holds until a save of its layout showed which of
them other ranks hold: then only those (nothing under FSDP, where no item is
replicated; about half a ZeRO-1 rank's state). In a single process, nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import itertools
import logging
import math
import operator
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import xxhash
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
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
from torch.distributed.tensor import DTensor

from .. import _dist
from ..errors import PlanningError
from ..format.health import Finding
from ..format.tensor_bytes import byte_view, value_tensor
from ..planning import CostModel, Item, PartitionOptions, Piece, chunk_errors, partition
from ..planning.fingerprint import fingerprint

__all__ = ["BalancedSavePlanner", "parent_group", "write_item_nbytes"]

logger = logging.getLogger("dcp_multilevel.planner")


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


@dataclasses.dataclass(frozen=True)
class LocalDigests:
    """A local plan's ``planner_data`` with the replica check: DCP's mappings, and a
    digest of the items this rank hashed."""

    mappings: Any
    digests: dict[MetadataIndex, str]


@dataclasses.dataclass(frozen=True)
class FinalReplicated:
    """A final plan's ``planner_data`` with the replica check: DCP's mappings, and the
    FQNs of the items the rank writes that other ranks hold too."""

    mappings: Any
    replicated: tuple[str, ...]


class Digests:
    """One planner's side of the exchange (every rank; see the module docstring)."""

    def __init__(self) -> None:
        # The FQNs the last save of this layout showed replicated (None: unknown).
        self._hint: frozenset[str] | None = None

    def forget(self) -> None:
        """The layout changed: hash every item at the next save."""
        self._hint = None

    def attach(self, plan: SavePlan, resolve: Callable[[WriteItem], Any]) -> SavePlan:
        """``plan`` with the digests of the items to compare (``resolve``: the item's data)."""
        if not plan.usable or _dist.world_size() <= 1:
            return plan
        hint = self._hint
        digests = {
            item.index: d
            for item in plan.items
            if (hint is None or item.index.fqn in hint) and (d := digest(item, resolve))
        }
        return dataclasses.replace(plan, planner_data=LocalDigests(plan.planner_data, digests))

    def learn(self, local: SavePlan, final: SavePlan) -> SavePlan:
        """``final`` (this rank's final plan) as DCP expects it; notes which of the items
        of ``local`` are replicated: those others write, and those it was told of."""
        data = final.planner_data
        if not isinstance(data, FinalReplicated):
            return final
        final = dataclasses.replace(final, planner_data=data.mappings)
        held = {item.index.fqn for item in local.items}
        written = {item.index.fqn for item in final.items}
        self._hint = frozenset((held - written) | set(data.replicated))
        return final


def stripped(plans: Sequence[SavePlan]) -> tuple[list[dict[MetadataIndex, str]], list[SavePlan]]:
    """The coordinator: each rank's digests, and the plans as DCP made them."""
    digests = [
        p.planner_data.digests if isinstance(p.planner_data, LocalDigests) else {} for p in plans
    ]
    plain = [
        dataclasses.replace(p, planner_data=p.planner_data.mappings)
        if isinstance(p.planner_data, LocalDigests)
        else p
        for p in plans
    ]
    return digests, plain


def with_replicated(
    plans: Sequence[SavePlan], replicated: Sequence[tuple[str, ...]]
) -> list[SavePlan]:
    """The coordinator: each final plan with the FQNs of its replicated items."""
    return [
        dataclasses.replace(p, planner_data=FinalReplicated(p.planner_data, rep))
        for p, rep in zip(plans, replicated, strict=True)
    ]


def digest(item: WriteItem, resolve: Callable[[WriteItem], Any]) -> str | None:
    """The item's digest; None for a value that does not serialize (the writer reports
    that, naming it, when it stores the value) or has no values (the meta device)."""
    if item.type == WriteItemType.BYTE_IO:
        try:
            data = resolve(item)
        except Exception:  # noqa: BLE001 - not this check's to report
            return None
    else:
        data = resolve(item)
    if isinstance(data, io.BytesIO):
        return xxhash.xxh3_64_hexdigest(data.getbuffer())
    t: torch.Tensor = data.detach()
    if t.device.type == "meta":  # a planning dry run: nothing to compare
        return None
    if t.device.type != "cpu":  # on the device: no whole copy to the host
        return fingerprint(t.resolve_conj().resolve_neg())  # (values, not memory)
    return xxhash.xxh3_64_hexdigest(byte_view(value_tensor(t)))


# The logger users configure, named as documented (not after this module).


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
        # The coordinator: per rank, the FQNs of its replicated items (the replica check, above).
        self._replicated: list[tuple[str, ...]] = []
        self._digests = Digests()
        self._kept_local = KeptLocalPlan()

    # ------------------------------------------------------------------ local

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan; with ``verify_replicas``, plus an xxh3 digest of every item.

        A state laid out as the last save's gets the last plan again
        (:class:`~dcp_multilevel.plugin.planner.KeptLocalPlan`). Hashing resolves every
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
        the digests of the items other ranks may hold too (:class:`Digests`)."""
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

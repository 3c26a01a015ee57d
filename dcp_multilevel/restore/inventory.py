"""What each rank needs of a step and what its node holds: the restore's inventories.

Before a load, every rank takes an :class:`~dcp_multilevel.restore.plan.Inventory`
(:func:`take_inventory`): the files (or the items' byte ranges) its ranks need
(a dry run of DCP's load planner on its state_dict, :func:`needed_ranges`),
and what its node holds of the step on every level, parity blocks and group
descriptions included (``LevelDriver.holdings``). The ranks of a node send
their needs to its lowest rank (:func:`split_needs`), and the inventories are
exchanged with one all-gather (:func:`gather_inventories`); every rank then
plans alike (``plan.py``).

Collective: every function that says so is called by every rank in the
same order, on the main thread.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..format import Manifest
from ..levels.base import LevelDriver
from ..levels.node_local import PLACEMENT_NAME
from . import plan as restore_plan
from .execute import parts_copy
from .plan import (
    Inventory,
    merge_node_needs,
    merge_ranges,
)

__all__ = [
    "gather_inventories",
    "needed_ranges",
    "split_needs",
    "take_inventory",
    "whole_files_of",
]

logger = logging.getLogger(__name__)


#: The length before each rank's needs sent to its node's receiver (u64).
_LENGTH = struct.Struct("<Q")


def needed_ranges(
    state_dict: dict[str, Any], manifest: Manifest, planner: Any
) -> dict[str, list[list[int]]] | None:
    """Per data file, the ``[offset, end)`` byte ranges of the items this rank's load
    will read (merged), or None (every byte of every file) when unknown.

    A dry run of DCP's default load planner on ``state_dict`` (no data is
    read). Unknown, and so everything, when the caller passes its own
    planner or a ``Stateful`` (whose ``state_dict()`` DCP calls itself).
    """
    if planner is not None and type(planner) is not DefaultLoadPlanner:
        return None
    if any(isinstance(v, Stateful) for v in state_dict.values()):
        return None
    try:
        dry = DefaultLoadPlanner()
        dry.set_up_planner(state_dict, manifest.metadata, is_coordinator=False)
        plan = dry.create_local_plan()
        per_file: dict[str, list[list[int]]] = {}
        for item in plan.items:
            loc = manifest.locations[item.storage_index]
            per_file.setdefault(loc.file, []).append([loc.offset, loc.offset + loc.length])
    except Exception as e:  # noqa: BLE001 - the real load will report it; fetch everything
        logger.debug("dcp_multilevel: load dry run failed (%s); restoring every file", e)
        return None
    return {f: [list(r) for r in merge_ranges(rs)] for f, rs in sorted(per_file.items())}


def split_needs(
    ranges: dict[str, list[list[int]]] | None,
    manifest: Manifest,
    part_share: float = restore_plan.PART_SHARE,
) -> tuple[list[str] | None, dict[str, list[list[int]]] | None]:
    """What a rank's load reads (``needed_ranges``) as an inventory says it: the files
    (None: every one), and the byte ranges of only those it reads at most
    ``part_share`` of (the others are copied whole anyway: a rank that reads
    everything sends no ranges at all)."""
    if ranges is None:
        return None, None
    needs = None if set(ranges) >= set(manifest.files) else sorted(ranges)
    partly = {
        f: rs
        for f, rs in ranges.items()
        if sum(b - a for a, b in rs) <= part_share * manifest.files[f]
    }
    return needs, partly


def take_inventory(
    step: int,
    drivers: Sequence[LevelDriver],
    manifest: Manifest,
    needs: tuple[list[str] | None, dict[str, list[list[int]]] | None],
    node: int,
    whole: Sequence[int],
) -> Inventory:
    """What this rank's node holds of ``step``: file listings only (no data is read).

    ``needs``: what this rank's load reads, as :func:`split_needs` gives it.
    """
    names = set(manifest.files)
    inv = Inventory(_dist.rank(), node, needs[0], needs[1], whole=list(whole))
    for i, driver in enumerate(drivers):
        if i > 0 and not driver.node_local:
            continue
        ckpt = driver.checkpoint(step)
        try:
            if i > 0 and not ckpt.is_committed():
                continue
            inv.files[i] = sorted(ckpt.data_files() & names)
            held = driver.holdings(step)
            if held is not None:
                inv.parity[i], inv.groups[i] = held["parity"], held["groups"]
            if i > 0 and inv.placement is None:
                inv.placement = _placement(ckpt)
        except (OSError, ValueError) as e:  # an unreadable part is a part not held
            logger.warning("dcp_multilevel: cannot list step %d on %s: %s", step, driver.url, e)
    inv.parts = parts_copy(drivers[0].checkpoint(step), manifest) is not None
    return inv


def _placement(ckpt: StoredCheckpoint) -> list[int] | None:
    try:
        return list(json.loads(ckpt.store.read_bytes(PLACEMENT_NAME))["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gather_inventories(
    inv: Inventory, members: Sequence[int] = (), group: Any = None
) -> list[Inventory]:
    """Every rank's inventory, in rank order. Collective.

    ``members``: the ranks of this rank's node, when known, and ``group`` the
    restore's group: the ranks first send their needs and ranges to the node's
    lowest rank, which sends them merged (``merge_node_needs``). Ranges name
    every file a rank reads a few items of (with sharded state, every other
    node's): gathered from every rank they were O(ranks x files) per rank, now
    O(nodes x files).
    """
    members = sorted(members)
    if group is not None and len(members) > 1 and inv.rank in members:
        inv = _merged_at_receiver(inv, members, group)
    return [_inventory(d) for d in _dist.all_gather_object(asdict(inv))]


def _merged_at_receiver(inv: Inventory, members: list[int], group: Any) -> Inventory:
    """This rank's inventory as the exchange carries it: the node's lowest rank
    receives the others' needs and ranges (JSON, length first) and merges them."""
    receiver = members[0]
    if inv.rank != receiver:
        body = bytearray(json.dumps([inv.needs, inv.ranges]).encode())
        _dist.send_bytes(bytearray(_LENGTH.pack(len(body))), receiver, group)
        _dist.send_bytes(body, receiver, group)
        return replace(inv, needs=[], ranges={}, merged=True)
    node = [inv]
    for rank in members[1:]:
        head = bytearray(_LENGTH.size)
        _dist.recv_bytes(head, rank, group)
        body = bytearray(_LENGTH.unpack(head)[0])
        _dist.recv_bytes(body, rank, group)
        needs, ranges = json.loads(body)
        node.append(replace(inv, rank=rank, needs=needs, ranges=ranges))
    return merge_node_needs(node)


def _inventory(d: dict[str, Any]) -> Inventory:
    return Inventory(
        rank=d["rank"], node=d["node"], needs=d["needs"], ranges=d["ranges"], parts=d["parts"],
        files={int(k): v for k, v in d["files"].items()}, whole=list(d["whole"]),
        parity={int(k): v for k, v in d["parity"].items()},
        groups={int(k): v for k, v in d["groups"].items()}, placement=d["placement"],
        merged=d["merged"],
    )  # fmt: skip


def whole_files_of(
    ranges: dict[str, list[list[int]]] | None, manifest: Manifest
) -> dict[str, list[list[int]]] | None:
    """``ranges`` widened to whole files: a reference is read in its step's directory,
    where a restore brings whole files only (ranges go to a parts copy beside it)."""
    if ranges is None:
        return None
    return {f: [[0, manifest.files[f]]] for f in ranges}

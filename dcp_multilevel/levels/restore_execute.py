"""Bringing every file a rank needs onto its node before a load: copies and rebuilds.

With node-local levels a node sees only its own part of each checkpoint. A
node that was replaced (an empty disk), or a job restarted on fewer nodes,
lacks files its ranks must read. Before ``dcp.load``, the ranks:

1. take an :class:`Inventory` each: the files its ranks need (a dry run of
   DCP's load planner on its state_dict, or all files), and what its node
   holds of the step on every level (``inventory.py``: ``take_inventory``);
2. exchange them (one all-gather, ``gather_inventories``) and compute the same
   :class:`RestorePlan` on every rank (``plan.py``, pure; ``order.py`` orders
   it): per missing file, in order,
   a link from another level of the node, a copy from another node holding
   it, an erasure rebuild of the member it belongs to, a store level
   holding the whole step (the reader reads it there), else the step cannot
   be restored from here, and the reasons name the nodes, levels and groups;
3. carry the plan out (:func:`execute`) over the restore's gloo group, into
   each node's first-level directory. A source whose bytes fail their
   checksums is reported by every rank (all-gather) and left out of the
   next plan (a corrupt copy falls through to the next source).

A node that needs only a few items of another node's file (a value every
rank holds, which one rank's file stores beside that rank's own shards)
receives only their byte ranges (``Copy.ranges``), into the step's *parts
copy*: ``<first-level step>/.parts``, a directory with the step's manifest
(written last) and files of the full size holding only the received ranges
(the rest is a hole). The reader tries it after the first level
(``parts_copy``); every item it serves is checked against its checksum, so a
range it does not hold can never be read as data. The first level's own
files stay whole: the inventory lists them as copies other nodes may take.

A node whose first level holds the step committed as another save (a disk
from an earlier run) is never written to: before anything moves, every
node's lowest rank compares, and the restore fails on every rank with
:class:`~dcp_multilevel.errors.CheckpointExistsError` naming the node, the
step and both saves (:func:`refuse_replacing`).

Collective: every function that says so is called by every rank in the
same order, on the main thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import CheckpointExistsError, CheckpointNotFoundError, DcpMultilevelError
from ..format import DATA_DIR, Manifest
from .base import LevelDriver
from .node_level import hard_link_or_copy
from .restore_actions import BlockFault, Copy, CopyFault, Fault, Inventory, Link, Rebuild, Ring
from .restore_plan import RestorePlan, group_descriptions, my_hops, received_around
from .wire import SOURCE_ERRORS, file_blocks, recv_file, recv_ranges, send_file, send_ranges

__all__ = [
    "PARTS_DIR",
    "RestoreReport",
    "execute",
    "parts_copy",
    "refuse_replacing",
    "set_aside_damaged",
]

logger = logging.getLogger(__name__)


#: The parts copy of a first-level step (see the module docstring).
PARTS_DIR = ".parts"


def parts_copy(first: StoredCheckpoint, manifest: Manifest) -> StoredCheckpoint | None:
    """The parts copy of first-level step ``first`` (whose manifest is ``manifest``)
    where it can exist (a local directory, no delta reference: a delta's reference
    is found beside its own checkpoint, which the parts copy is not); None elsewhere."""
    path = first.store.local_path("")
    if path is None or manifest.reference is not None:
        return None
    return StoredCheckpoint.at(os.path.join(path, PARTS_DIR))


@dataclass
class RestoreReport:
    """What a restore brought onto one node (``CheckpointManager.last_restore``)."""

    step: int
    received: dict[str, int] = field(default_factory=dict)  # source -> files brought here
    seconds: float = 0.0

    def add(
        self,
        plan: RestorePlan,
        names: Sequence[str],
        inventories: Sequence[Inventory],
        node: int,
        bad: set[Fault],
    ) -> None:
        """Count the files ``plan`` brought onto ``node``, by where they came from
        (``names``: each level as the user wrote it; ``bad``: the sources that failed)."""
        nodes = {inv.rank: inv.node for inv in inventories}
        for action in plan.actions:
            if isinstance(action, Ring):
                # A file whose copy failed on a ring node (one set, not a lookup per
                # file and node: 2,000 nodes x 16,000 files at scale).
                ring_nodes = set(action.nodes)
                failed = {f.file for f in bad if isinstance(f, CopyFault) and f.node in ring_nodes}
                files = [f for f in received_around(action, node) if f not in failed]
                if files:
                    key = f"{names[0]} (around a ring of {len(action.nodes)} nodes)"
                    self.received[key] = self.received.get(key, 0) + len(files)
                continue
            if nodes.get(action.dst) != node or _failed(action, nodes, bad):
                continue
            name = names[action.level]
            count = 1
            if isinstance(action, Link):
                key = f"{name} (this node)"
            elif isinstance(action, Copy) and action.ranges is None:
                key = f"{name} (node {nodes[action.src]})"
            elif isinstance(action, Copy):
                key = f"{name} (node {nodes[action.src]}, items only)"
            else:
                key = f"{name} (rebuilt from nodes {sorted(nodes[r] for _, r in action.sources)})"
                count = len(action.brings)
            self.received[key] = self.received.get(key, 0) + count


def set_aside_damaged(first: StoredCheckpoint, node: Sequence[Inventory]) -> list[str]:
    """Read every file the ranks ``node`` need from this node's first-level copy
    ``first``, checking every item; rename the damaged ones aside (kept for
    inspection as ``<file>.damaged-<unix time>``) and return their names."""
    files = first.manifest().files
    needed = set(files)
    if all(inv.needs is not None for inv in node):
        needed = {f for inv in node for f in inv.needs or ()}
    damaged = []
    for file in sorted(first.data_files() & needed):
        try:
            for _ in file_blocks(first, file):
                pass
        except SOURCE_ERRORS as e:
            path = first.store.local_path(file)
            if path is None:
                continue  # not a local directory: the reader's fallbacks are all there is
            logger.warning(
                "dcp_multilevel: %s of %s is damaged (%s); setting it aside", file, first.url, e
            )
            os.replace(path, f"{path}.damaged-{int(time.time())}")
            damaged.append(file)
    return damaged


def _failed(action: Link | Copy | Rebuild, nodes: dict[int, int], bad: set[Fault]) -> bool:
    if isinstance(action, Copy):
        return CopyFault(nodes[action.src], action.file) in bad
    if isinstance(action, Rebuild):
        return any(BlockFault(action.level, action.group, b, r) in bad for b, r in action.sources)
    return False


def execute(
    plan: RestorePlan,
    drivers: Sequence[LevelDriver],
    manifest_bytes: bytes,
    group: Any,
    inventories: Sequence[Inventory],
) -> list[Fault]:
    """Carry out this rank's part of ``plan`` (collective); the sources found damaged here.

    Received and rebuilt files go to this node's first-level copy of the step.
    """
    me = _dist.rank()
    step = plan.step
    nodes = {inv.rank: inv.node for inv in inventories}
    # One checkpoint object per level for the whole plan: each decodes the manifest
    # (thousands of items: a tenth of a second) once, not once per action.
    held: dict[int, StoredCheckpoint] = {}

    def at(level: int) -> StoredCheckpoint:
        if level not in held:
            held[level] = drivers[level].checkpoint(step, manifest_bytes=manifest_bytes)
        return held[level]

    into = at(0)
    files = into.manifest().files
    refuse_replacing(drivers[0], step, into.manifest().save_id, inventories)
    parts: StoredCheckpoint | None = None  # this node's parts copy, once it receives one
    bad: list[Fault] = []
    descs = group_descriptions(inventories)
    for action in plan.actions:
        if isinstance(action, Ring):  # this rank's hops, in the ring's order (ring.py)
            for hop in my_hops(action, me):
                file = action.files[hop.index].file
                if hop.src == me:
                    send_file(at(hop.level), file, hop.dst, group)
                elif not recv_file(into.store, file, files[file], hop.src, group):
                    bad.append(CopyFault(nodes[hop.src], file))
            continue
        if isinstance(action, Link):
            if me == action.dst:
                hard_link_or_copy(
                    drivers[action.level].checkpoint(step).store, into.store, action.file
                )
            continue
        if isinstance(action, Copy) and action.ranges is not None:
            if me == action.src:
                send_ranges(at(action.level), action.file, action.ranges, action.dst, group)
            elif me == action.dst:
                if parts is None:
                    parts = _open_parts(into, manifest_bytes)
                path = parts.store.local_path(action.file)
                assert path is not None  # parts_copy() is a local directory
                if not recv_ranges(path, files[action.file], action.ranges, action.src, group):
                    bad.append(CopyFault(nodes[action.src], action.file))
            continue
        if isinstance(action, Copy):
            if me == action.src:
                send_file(at(action.level), action.file, action.dst, group)
            elif me == action.dst and not recv_file(
                into.store, action.file, files[action.file], action.src, group
            ):
                bad.append(CopyFault(nodes[action.src], action.file))
            continue
        # A rebuild: the level kind's own (levels/base.py).
        desc = descs[action.level][action.group]
        rebuilder = drivers[action.level].rebuilder
        assert rebuilder is not None  # the plan asked this level's kind for the rebuild
        if me == action.dst:
            local = {b: at(action.level) for b, r in action.sources if r == me}
            failed = rebuilder.receive(
                desc, action.members, action.sources, local, into, into.store, group
            )
            bad += [BlockFault(action.level, action.group, b, r) for b, r in failed]
        else:
            for block, rank in action.sources:
                if rank == me:
                    rebuilder.send(desc, block, at(action.level), action.dst, group)
    if parts is not None:
        parts.commit_manifest(manifest_bytes)  # last: the copy exists
    return bad


def refuse_replacing(
    first: LevelDriver, step: int, save_id: str, inventories: Sequence[Inventory]
) -> None:
    """Raise :class:`CheckpointExistsError` on every rank when some node's first level
    holds ``step`` committed as another save than ``save_id`` (each node's lowest
    rank looks at its own disk). Collective."""
    me = _dist.rank()
    node = next((inv.node for inv in inventories if inv.rank == me), None)
    lowest = min((inv.rank for inv in inventories if inv.node == node), default=me)
    found: tuple[int | None, str, str] | None = None
    if me == lowest:
        ckpt = first.checkpoint(step)
        try:
            held = ckpt.held_save_id()
        except (DcpMultilevelError, OSError) as e:
            held = f"unreadable ({type(e).__name__}: {e})"
        if held is not None and held != save_id:
            found = (node, ckpt.url, held)
    conflicts = [f for f in _dist.all_gather_object(found) if f is not None]
    if not conflicts:
        return
    where, url, held = conflicts[0]
    raise CheckpointExistsError(
        f"Checkpoint already exists at {url} (node {where}'s first level holds step {step} "
        f"as save {held}); restoring save {save_id} of step {step} there would replace it, "
        "so the restore stops before anything moves. Move that step aside on that node "
        "(it may be the only copy of an earlier run), then load again.",
        checkpoint=url,
    )


def _open_parts(first: StoredCheckpoint, manifest_bytes: bytes) -> StoredCheckpoint:
    """This node's parts copy of ``first``'s step, ready for ranges: one left by an
    earlier restore of the same save keeps its ranges (each item is checked when
    read); one of another save is removed, its manifest first."""
    parts = parts_copy(first, first.manifest())
    assert parts is not None  # the plan sends ranges only where the inventory allows them
    try:
        same = parts.manifest_bytes() == manifest_bytes
    except (CheckpointNotFoundError, OSError):
        same = False
    if not same:
        parts.delete()
        os.makedirs(parts.store.local_path(DATA_DIR) or "", exist_ok=True)
    return parts

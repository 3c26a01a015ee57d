"""Bringing every file a rank needs onto its node before a load: copies and rebuilds.

With node-local levels a node sees only its own part of each checkpoint. A
node that was replaced (an empty disk), or a job restarted on fewer nodes,
lacks files its ranks must read. Before ``dcp.load``, the ranks:

1. take an :class:`Inventory` each: the files its ranks need (a dry run of
   DCP's load planner on its state_dict, or all files), and what its node
   holds of the step on every level (``take_inventory``);
2. exchange them (one all-gather) and compute the same :class:`RestorePlan`
   on every rank (:func:`plan_restore`, pure): per missing file, in order,
   a copy from another node holding it (its first level or a partner copy),
   else an erasure rebuild of the member it belongs to, else a store level
   holding the whole step (the reader reads it there), else the step cannot
   be restored from here, and the reasons name the nodes, levels and groups;
3. carry the plan out (:func:`execute`) over the restore's gloo group, into
   each node's first-level directory. A source whose bytes fail their
   checksums is reported by every rank (all-gather) and left out of the
   next plan (a corrupt copy falls through to the next source).

Collective: every function that says so is called by every rank in the
same order, on the main thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..format import Manifest
from .base import LevelDriver
from .erasure import ErasureLevel, block_chunks, rebuild, send_block
from .node_local import PLACEMENT_NAME, link_or_copy
from .wire import SOURCE_ERRORS, file_blocks, recv_file, send_file

__all__ = [
    "Copy",
    "Inventory",
    "Link",
    "Rebuild",
    "RestorePlan",
    "RestoreReport",
    "execute",
    "gather_inventories",
    "needed_files",
    "plan_restore",
    "set_aside_damaged",
    "take_inventory",
]

logger = logging.getLogger(__name__)


def needed_files(state_dict: dict[str, Any], manifest: Manifest, planner: Any) -> list[str] | None:
    """The data files this rank's load will read, or None (all of them) when unknown.

    A dry run of DCP's default load planner on ``state_dict`` (no data is
    read). Unknown, and so every file, when the caller passes its own
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
        return sorted({manifest.locations[item.storage_index].file for item in plan.items})
    except Exception as e:  # noqa: BLE001 - the real load will report it; fetch everything
        logger.debug("dcp_multilevel: load dry run failed (%s); restoring every file", e)
        return None


@dataclass
class Inventory:
    """One rank's view of one step (JSON-able: exchanged with every rank)."""

    rank: int
    node: int
    needs: list[str] | None  # None: every file
    files: dict[int, list[str]] = field(default_factory=dict)  # level -> files on this node
    whole: list[int] = field(default_factory=list)  # store levels above the first holding it
    parity: dict[int, list[list[Any]]] = field(default_factory=dict)  # level -> [[group, block]]
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)  # level -> group -> desc
    placement: list[int] | None = None  # node of each rank of the save, if recorded


def take_inventory(
    step: int,
    drivers: Sequence[LevelDriver],
    manifest: Manifest,
    needs: list[str] | None,
    node: int,
    whole: Sequence[int],
) -> Inventory:
    """What this rank's node holds of ``step``: file listings only (no data is read)."""
    inv = Inventory(_dist.rank(), node, needs, whole=list(whole))
    names = set(manifest.files)
    for i, driver in enumerate(drivers):
        if i > 0 and not driver.node_local:
            continue
        ckpt = driver.checkpoint(step)
        try:
            if i > 0 and not ckpt.is_committed():
                continue
            inv.files[i] = sorted(ckpt.data_files() & names)
            if isinstance(driver, ErasureLevel):
                held = driver.holdings(step)
                inv.parity[i], inv.groups[i] = held["parity"], held["groups"]
            if i > 0 and inv.placement is None:
                inv.placement = _placement(ckpt)
        except (OSError, ValueError) as e:  # an unreadable part is a part not held
            logger.warning("dcp_multilevel: cannot list step %d on %s: %s", step, driver.url, e)
    return inv


def _placement(ckpt: StoredCheckpoint) -> list[int] | None:
    try:
        return list(json.loads(ckpt.store.read_bytes(PLACEMENT_NAME))["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Link:
    """Make ``file``, which ``dst``'s node holds on level ``level``, appear on its first level."""

    file: str
    level: int
    dst: int


@dataclass(frozen=True)
class Copy:
    """Send ``file`` from ``src``'s node (its copy on level ``level``) to ``dst``'s."""

    file: str
    level: int
    src: int
    dst: int


@dataclass(frozen=True)
class Rebuild:
    """Rebuild members ``members`` of erasure group ``group`` (level ``level``) on
    ``dst``'s node from ``sources`` ((block, rank) pairs)."""

    level: int
    group: str
    members: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    dst: int


@dataclass
class RestorePlan:
    """Every rank's part of a restore (the same on every rank)."""

    step: int
    actions: list[Link | Copy | Rebuild] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why it cannot work; empty: it can

    @property
    def ok(self) -> bool:
        """True when every rank can read every file it needs."""
        return not self.reasons


def plan_restore(
    step: int,
    files: dict[str, int],
    inventories: Sequence[Inventory],
    level_urls: Sequence[str],
    bad: set[tuple[Any, ...]] = frozenset(),  # type: ignore[assignment]
    transfers: bool = True,
) -> RestorePlan:
    """How every node gets the files its ranks need (pure; see the module docstring).

    ``bad`` holds the sources found damaged in earlier rounds:
    ``("copy", node, file)`` (every copy of ``file`` on ``node``: after a restore
    linked one level's copy into another, both are the same bytes) and
    ``("block", level, group, block, rank)``.
    With ``transfers=False`` (no group to move bytes over) only store levels help.
    """
    plan = RestorePlan(step)
    nodes: dict[int, list[Inventory]] = {}
    for inv in inventories:
        nodes.setdefault(inv.node, []).append(inv)
    groups: dict[int, dict[str, dict[str, Any]]] = {}
    for inv in inventories:
        for level, descs in inv.groups.items():
            for g, desc in descs.items():
                groups.setdefault(level, {}).setdefault(g, desc)
    lacking: list[str] = []  # one line per node that lacks files (first in the reasons)
    arrived: dict[int, tuple[int, set[str]]] = {}  # node -> (receiving rank, rebuilt files)
    for node, invs in sorted(nodes.items()):
        dst = min(inv.rank for inv in invs)
        # Copies on this node found damaged (and what a restore linked to them).
        spoiled = {key[2] for key in bad if key[0] == "copy" and key[1] == node}
        have = {f for inv in invs for fs in inv.files.values() for f in fs} - spoiled
        needed = set(files)
        if all(inv.needs is not None for inv in invs):
            needed = {f for inv in invs for f in inv.needs or ()}
        mine = {f for inv in invs for f in inv.files.get(0, ())} - spoiled
        for file in sorted(needed & (have - mine)):  # on another level of this very node
            level = min(i for inv in invs for i, fs in inv.files.items() if file in fs)
            plan.actions.append(Link(file, level, dst))
        missing = sorted(needed - have)
        covered = any(inv.whole for inv in invs)
        unmet: list[str] = []
        rebuilt: set[str] = set()
        for file in missing:
            if file in rebuilt:
                continue
            source = _copy_source(file, node, inventories, bad, arrived) if transfers else None
            if source is not None:
                plan.actions.append(Copy(file, source[0], source[1], dst))
                continue
            action = _rebuild_for(file, node, needed - have, groups, inventories, bad, dst,
                                  level_urls, step) if transfers else None  # fmt: skip
            if isinstance(action, Rebuild):
                plan.actions.append(action)
                desc = groups[action.level][action.group]
                rebuilt |= {f for y in action.members for f, _ in desc["members"][y]["files"]}
                arrived.setdefault(node, (dst, set()))[1].update(rebuilt)
                continue
            if not covered:
                unmet.append(file)
                if isinstance(action, str):
                    plan.reasons.append(action)
        if unmet:
            ranks = sorted(inv.rank for inv in invs)
            lacking.append(
                f"node {node} (ranks {ranks}) lacks {len(unmet)} file(s) of step {step} that no "
                f"node holds and no level can rebuild (e.g. {unmet[0]})"
            )
            copying = sorted({i for inv in inventories for i in inv.files if i > 0} - set(groups))
            for i in copying:
                plan.reasons.append(f"{level_urls[i]}: no node here holds a copy of {unmet[0]}")
    plan.reasons[:0] = lacking
    if plan.reasons:
        lost = _lost_nodes(inventories)
        if lost:
            plan.reasons.append(
                f"nodes that held step {step} and hold none of it now (lost or replaced): {lost}"
            )
        plan.reasons = list(dict.fromkeys(plan.reasons))
        plan.actions = []
    return plan


def _lost_nodes(inventories: Sequence[Inventory]) -> list[int]:
    """Nodes of the saving job (its placement) on which no rank holds the step now."""
    placement = next((inv.placement for inv in inventories if inv.placement), None)
    if not placement:
        return []
    holding = {inv.node for inv in inventories if any(fs for fs in inv.files.values())}
    return sorted(set(placement) - holding)


def _copy_source(
    file: str,
    node: int,
    inventories: Sequence[Inventory],
    bad: set[tuple[Any, ...]],
    arrived: dict[int, tuple[int, set[str]]] | None = None,
) -> tuple[int, int] | None:
    """(level, rank) of the first intact copy of ``file`` on another node, lowest level
    first; else a node that an earlier action of the plan brings it to (``arrived``:
    node -> (its receiving rank, files)), so a lost member is rebuilt once, then copied."""
    options = sorted(
        (level, inv.rank)
        for inv in inventories
        if inv.node != node and ("copy", inv.node, file) not in bad
        for level, fs in inv.files.items()
        if file in fs
    )
    if options:
        return options[0]
    for other, (rank, files) in sorted((arrived or {}).items()):
        if other != node and file in files and ("copy", other, file) not in bad:
            return 0, rank
    return None


def _rebuild_for(
    file: str,
    node: int,
    wanted: set[str],
    groups: dict[int, dict[str, dict[str, Any]]],
    inventories: Sequence[Inventory],
    bad: set[tuple[Any, ...]],
    dst: int,
    level_urls: Sequence[str],
    step: int,
) -> Rebuild | str | None:
    """A rebuild that yields ``file`` on ``node``, or why none can (None: no group has it)."""
    reason: str | None = None
    for level, descs in sorted(groups.items()):
        for g, desc in sorted(descs.items()):
            members = [{f for f, _ in m["files"]} for m in desc["members"]]
            if not any(file in m for m in members):
                continue
            k, m = desc["data"], desc["parity"]
            # Rebuild the members this node lacks and cannot copy (together: one pass).
            lost = [
                y for y in range(k)
                if any(_copy_source(f, node, inventories, bad) is None for f in members[y] & wanted)
            ]  # fmt: skip
            holders = _block_holders(level, g, desc, members, inventories, bad)
            usable = [(b, holders[b]) for b in range(k + m) if b not in lost and b in holders]
            if len(usable) >= k:
                return Rebuild(level, g, tuple(lost), tuple(usable[:k]), dst)
            gone = [
                desc["members"][b]["node"] if b < k else desc["parity_nodes"][b - k]
                for b in range(k + m)
                if b not in holders
            ]
            reason = (
                f"{level_urls[level]}: group {g} of step {step}: RS({k}+{m}) needs {k} intact "
                f"blocks, has {len(usable)} (blocks of nodes {gone} lost or damaged; tolerates "
                f"{m})"
            )
    return reason


def _block_holders(
    level: int,
    g: str,
    desc: dict[str, Any],
    members: list[set[str]],
    inventories: Sequence[Inventory],
    bad: set[tuple[Any, ...]],
) -> dict[int, int]:
    """block -> the lowest rank that can stream it intact."""
    out: dict[int, int] = {}
    k = desc["data"]
    for inv in sorted(inventories, key=lambda i: i.rank):
        held = set(inv.files.get(level, ()))
        for y, files in enumerate(members):
            if y not in out and files <= held and ("block", level, g, y, inv.rank) not in bad:
                out[y] = inv.rank
        for pg, b in inv.parity.get(level, ()):
            if pg == g and b >= k and b not in out and ("block", level, g, b, inv.rank) not in bad:
                out[b] = inv.rank
    return out


@dataclass
class RestoreReport:
    """What a restore brought onto one node (``CheckpointManager.last_restore``)."""

    step: int
    received: dict[str, int] = field(default_factory=dict)  # source -> files brought here
    seconds: float = 0.0

    def add(self, plan: RestorePlan, names: Sequence[str], inventories: Sequence[Inventory],
            node: int, bad: set[tuple[Any, ...]]) -> None:  # fmt: skip
        """Count the files ``plan`` brought onto ``node``, by where they came from
        (``names``: each level as the user wrote it; ``bad``: the sources that failed)."""
        nodes = {inv.rank: inv.node for inv in inventories}
        descs = {(level, g): desc for inv in inventories
                 for level, held in inv.groups.items() for g, desc in held.items()}  # fmt: skip
        for action in plan.actions:
            if nodes.get(action.dst) != node or _failed(action, nodes, bad):
                continue
            name = names[action.level]
            count = 1
            if isinstance(action, Link):
                key = f"{name} (this node)"
            elif isinstance(action, Copy):
                key = f"{name} (node {nodes[action.src]})"
            else:
                key = f"{name} (rebuilt from nodes {sorted(nodes[r] for _, r in action.sources)})"
                members = descs[(action.level, action.group)]["members"]
                count = sum(len(members[y]["files"]) for y in action.members)
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
            logger.warning("dcp_multilevel: %s of %s is damaged (%s); setting it aside",
                           file, first.url, e)  # fmt: skip
            os.replace(path, f"{path}.damaged-{int(time.time())}")
            damaged.append(file)
    return damaged


def _failed(action: Link | Copy | Rebuild, nodes: dict[int, int], bad: set[tuple[Any, ...]]
            ) -> bool:  # fmt: skip
    if isinstance(action, Copy):
        return ("copy", nodes[action.src], action.file) in bad
    if isinstance(action, Rebuild):
        return any(("block", action.level, action.group, b, r) in bad for b, r in action.sources)
    return False


def execute(
    plan: RestorePlan,
    drivers: Sequence[LevelDriver],
    manifest_bytes: bytes,
    group: Any,
    inventories: Sequence[Inventory],
) -> list[tuple[Any, ...]]:
    """Carry out this rank's part of ``plan`` (collective); the sources found damaged here.

    Received and rebuilt files go to this node's first-level copy of the step.
    """
    me = _dist.rank()
    step = plan.step
    nodes = {inv.rank: inv.node for inv in inventories}
    into = drivers[0].checkpoint(step, manifest_bytes=manifest_bytes)
    files = into.manifest().files
    bad: list[tuple[Any, ...]] = []
    # A replaced node holds no group description: take them from the inventories.
    descs = {(level, g): desc for inv in inventories
             for level, held in inv.groups.items() for g, desc in held.items()}  # fmt: skip
    for action in plan.actions:
        if isinstance(action, Link):
            if me == action.dst:
                link_or_copy(drivers[action.level].checkpoint(step).store, into.store, action.file)
            continue
        if isinstance(action, Copy):
            if me == action.src:
                ckpt = drivers[action.level].checkpoint(step, manifest_bytes=manifest_bytes)
                send_file(ckpt, action.file, action.dst, group)
            elif me == action.dst and not recv_file(
                into.store, action.file, files[action.file], action.src, group
            ):
                bad.append(("copy", nodes[action.src], action.file))
            continue
        driver = drivers[action.level]
        desc = descs[(action.level, action.group)]
        if me == action.dst:
            local = {b: driver.checkpoint(step, manifest_bytes=manifest_bytes)
                     for b, r in action.sources if r == me}  # fmt: skip
            failed = rebuild(desc, action.members, action.sources, local, into.store, into, group)
            bad += [("block", action.level, action.group, b, r) for b, r in failed]
        else:
            for block, rank in action.sources:
                if rank == me:
                    ckpt = driver.checkpoint(step, manifest_bytes=manifest_bytes)
                    send_block(block_chunks(ckpt, desc, block), desc["stripe"], action.dst, group)
    return bad


def gather_inventories(inv: Inventory) -> list[Inventory]:
    """Every rank's inventory, in rank order. Collective."""
    return [_inventory(d) for d in _dist.all_gather_object(asdict(inv))]


def _inventory(d: dict[str, Any]) -> Inventory:
    return Inventory(
        rank=d["rank"], node=d["node"], needs=d["needs"],
        files={int(k): v for k, v in d["files"].items()}, whole=list(d["whole"]),
        parity={int(k): v for k, v in d["parity"].items()},
        groups={int(k): v for k, v in d["groups"].items()}, placement=d["placement"],
    )  # fmt: skip

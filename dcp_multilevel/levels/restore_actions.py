"""What a restore does, as values: the inventories it plans from and its actions.

Every rank plans the same restore from every rank's :class:`Inventory`
(``restore_inventory.py`` takes and exchanges them); a plan is a list of actions
(``restore_plan.py`` chooses and orders them, ``restore_execute.py`` carries
them out): a :class:`Link` (a file another level of the node holds), a
:class:`Copy` (from another node), a :class:`Rebuild` (erasure members from
their group's intact blocks). A source found damaged while a plan is
carried out is a *fault* (:class:`CopyFault`, :class:`BlockFault`): the next
plan leaves it out. Files that every node of many needs travel around a
:class:`Ring` (``restore_plan.py``): one action for all of them, not one copy per node
and file. Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BlockFault",
    "Copy",
    "CopyFault",
    "Fault",
    "Inventory",
    "Link",
    "Rebuild",
    "Ring",
    "RingFile",
    "participants",
]


@dataclass
class Inventory:
    """One rank's view of one step (JSON-able: exchanged with every rank)."""

    rank: int
    node: int
    needs: list[str] | None  # None: every file
    # file -> the [offset, end) byte ranges of the items this rank reads there, for the
    # files it reads at most plan.PART_SHARE of (a needed file not here: read mostly whole;
    # None: unknown). Only those: a rank that reads everything sends no ranges.
    ranges: dict[str, list[list[int]]] | None = None
    parts: bool = False  # this rank's first level can take a file's parts (execute.py)
    files: dict[int, list[str]] = field(default_factory=dict)  # level -> files on this node
    whole: list[int] = field(default_factory=list)  # store levels above the first holding it
    parity: dict[int, list[list[Any]]] = field(default_factory=dict)  # level -> [[group, block]]
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)  # level -> group -> desc
    placement: list[int] | None = None  # node of each rank of the save, if recorded
    # True: this rank's needs and ranges travel in its node's lowest rank's inventory
    # (``merge_node_needs``); its own say it needs nothing (which plans alike: a
    # node's needs are the union of its ranks').
    merged: bool = False


@dataclass(frozen=True)
class Link:
    """Make ``file``, which ``dst``'s node holds on level ``level``, appear on its first level."""

    file: str
    level: int
    dst: int


@dataclass(frozen=True)
class Copy:
    """Send ``file`` from ``src``'s node (its copy on level ``level``) to ``dst``'s;
    with ``ranges`` (sorted, disjoint ``(offset, end)`` pairs, each whole items)
    only those bytes, into ``dst``'s parts copy."""

    file: str
    level: int
    src: int
    dst: int
    ranges: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class Rebuild:
    """Rebuild members ``members`` of erasure group ``group`` (level ``level``) on
    ``dst``'s node from ``sources`` ((block, rank) pairs); ``brings`` names the
    files the rebuilt members hold."""

    level: int
    group: str
    members: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    dst: int
    brings: tuple[str, ...] = ()


@dataclass(frozen=True)
class RingFile:
    """One file of a :class:`Ring`: the node at position ``origin`` sends it first (its
    copy on level ``level``), on lane ``lane``; ``holders``: the other ring positions
    holding it already, as ``(position, level)`` (no hop into them; they send their own
    copy on); ``hops``: how far it travels (past the last position that lacks it);
    ``sender``: the origin's rank that sends it, where an earlier action brought it
    there onto another rank than the lane's (None: the lane's)."""

    file: str
    origin: int
    lane: int
    level: int
    hops: int
    holders: tuple[tuple[int, int], ...] = ()
    sender: int | None = None


@dataclass(frozen=True)
class Ring:
    """Every node of ``nodes`` (in ring order) that lacks a file of ``files`` receives
    it from the node before it, and passes it on: lane ``j`` of a node is its rank
    ``ranks[position][j % len(ranks[position])]``. ``ring.py`` lists the hops."""

    nodes: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    files: tuple[RingFile, ...]


def participants(action: Link | Copy | Rebuild | Ring) -> set[int]:
    """The ranks that take part in ``action``."""
    if isinstance(action, Ring):
        return {r for ranks in action.ranks for r in ranks}  # senders are among them
    if isinstance(action, Copy):
        return {action.src, action.dst}
    if isinstance(action, Rebuild):
        return {action.dst, *(rank for _, rank in action.sources)}
    return {action.dst}


@dataclass(frozen=True, order=True)
class CopyFault:
    """Every copy of ``file`` on ``node`` is damaged (after a restore linked one
    level's copy into another, both are the same bytes)."""

    node: int
    file: str


@dataclass(frozen=True, order=True)
class BlockFault:
    """Block ``block`` of erasure group ``group`` on level ``level``, as rank ``rank``
    holds it, is damaged."""

    level: int
    group: str
    block: int
    rank: int


#: A source a restore found damaged (every rank learns of it alike).
Fault = CopyFault | BlockFault

"""What a level kind that rebuilds lost files from coded blocks brings to a restore.

A restore (``restore/``) copies a file a node lacks from another node when
some node holds it; a kind whose nodes hold *blocks* instead (erasure
parity) rebuilds it. The restore knows nothing of how: it asks the level's
driver for its :class:`Rebuilder` (``LevelDriver.rebuilder``) and treats
what the kind reports in the inventories (``LevelDriver.holdings``: its
groups' descriptions and the blocks this node holds) as opaque.

Call order, for one restore (every rank computes the same plan)::

    holdings = driver.holdings(step)       each node, into its inventory
    r = driver.rebuilder                   the restore's planner, for each level
    r.plan(level, file, wanted, ...)       for a file no node can copy: which group's
                                           members to rebuild, from which blocks
    r.receive(desc, members, sources, ...) the receiving rank, carrying it out
    r.send(desc, block, source, dst, ...)  each rank that holds a source block

Pure in ``plan`` (no I/O); ``receive`` and ``send`` move bytes over the
restore's group, point to point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..checkpoint import StoredCheckpoint
from ..stores import Store

__all__ = ["RebuildChoice", "Rebuilder"]


@dataclass(frozen=True)
class RebuildChoice:
    """Rebuild ``members`` of ``group`` from ``sources`` (``(block, rank)`` pairs);
    ``brings``: the files the rebuilt members hold."""

    group: str
    members: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    brings: tuple[str, ...]


class Rebuilder(Protocol):
    """A level kind's rebuilds (see the module docstring for the call order)."""

    def plan(
        self,
        level: int,
        file: str,
        wanted: set[str],
        groups: dict[str, dict[str, Any]],
        inventories: Sequence[Any],
        copyable: Callable[[str], bool],
        block_damaged: Callable[[str, int, int], bool],
    ) -> RebuildChoice | str | None:
        """How to rebuild ``file`` on a node that needs ``wanted`` (files the node
        lacks), or why it cannot be (a reason naming the group), or None (no group
        holds it). ``level``: this level's index (inventories key by it);
        ``groups``: every group's description any node reported there;
        ``inventories``: every rank's (``.rank``, ``.files[level]``, the kind's
        blocks in ``.parity[level]``); ``copyable(f)``: another node holds ``f``;
        ``block_damaged(group, block, rank)``: that source was found damaged."""
        ...

    def receive(
        self,
        desc: dict[str, Any],
        members: Sequence[int],
        sources: Sequence[tuple[int, int]],
        local: dict[int, StoredCheckpoint],
        into: StoredCheckpoint,
        store: Store,
        group: Any,
    ) -> list[tuple[int, int]]:
        """Rebuild ``members`` into ``store`` (``into``'s), reading the blocks this
        rank holds from ``local`` and receiving the others; the ``(block, rank)``
        sources found damaged."""
        ...

    def send(
        self, desc: dict[str, Any], block: int, source: StoredCheckpoint, dst: int, group: Any
    ) -> None:
        """Stream block ``block`` of ``desc``'s group from ``source`` to rank ``dst``."""
        ...

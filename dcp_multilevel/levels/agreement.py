"""Which step every rank can restore, and from which levels: agreed collectively.

Each rank lists what it sees on every level (a node-local first level shows
each node only its own files, and only rank 0's node the manifests). The
ranks exchange their views, and a step is restorable when every rank can
read it: a higher level it sees holds the step, or its own view of the first
level has every data file the step's manifest names. The manifest comes from
the lowest rank that sees it, sent to all.

Collective: every rank calls these functions in the same order, on the main
thread (they use the trainer's process group through ``_dist``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .. import _dist
from ..errors import DcpMultilevelError
from .base import LevelDriver

__all__ = ["Restore", "Views", "gather_views", "restorable"]

logger = logging.getLogger(__name__)

#: One rank's view: level index -> steps committed there, ascending.
View = dict[int, list[int]]


@dataclass(frozen=True)
class Views:
    """What this rank sees on each level, and what every rank sees (rank order)."""

    mine: View
    everyone: list[View]

    def candidates(self) -> list[int]:
        """Every step some rank sees committed on some level, ascending."""
        return sorted({s for view in self.everyone for steps in view.values() for s in steps})

    def anywhere(self, step: int) -> bool:
        """True when some rank sees ``step`` committed on some level."""
        return any(step in steps for view in self.everyone for steps in view.values())


@dataclass(frozen=True)
class Restore:
    """How this rank loads ``step``: from these levels in order (the first level's
    copy first when it has one, with the manifest rank 0's node read)."""

    step: int
    levels: list[int]
    first_manifest: bytes | None


def gather_views(drivers: Sequence[LevelDriver]) -> Views:
    """Every rank's view of every level. Collective."""
    mine = {i: d.steps() for i, d in enumerate(drivers)}
    return Views(mine, _dist.all_gather_object(mine))


def restorable(step: int, drivers: Sequence[LevelDriver], views: Views) -> Restore | None:
    """How this rank loads ``step`` if every rank can, else None (the same on all). Collective."""
    holders = [r for r, view in enumerate(views.everyone) if step in view[0]]
    manifest: bytes | None = None
    if holders:
        mine = _first_manifest(drivers[0], step) if _dist.rank() == holders[0] else None
        manifest = _dist.broadcast_object(mine, holders[0])
    higher = [i for i in range(1, len(drivers)) if step in views.mine[i]]
    ok = bool(higher) or (manifest is not None and _has_files(drivers[0], step, manifest))
    if not all(_dist.all_gather_object(ok)):
        return None
    return Restore(step, ([0] if manifest is not None else []) + higher, manifest)


def _first_manifest(first: LevelDriver, step: int) -> bytes | None:
    try:
        return first.checkpoint(step).manifest_bytes()
    except OSError as e:  # deleted since listing: this step is not on the first level
        logger.warning("dcp_multilevel: cannot read the manifest of step %d: %s", step, e)
        return None


def _has_files(first: LevelDriver, step: int, manifest: bytes) -> bool:
    """True when this rank's view of the first level has every file ``manifest`` names."""
    ckpt = first.checkpoint(step, manifest_bytes=manifest)
    try:
        files = ckpt.manifest().files
    except DcpMultilevelError:
        return False
    return set(files) <= ckpt.data_files()

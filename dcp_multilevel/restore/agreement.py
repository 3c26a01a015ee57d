"""Which step every rank can restore, and from which levels: agreed collectively.

Each rank lists what it sees on every level (a node-local first level shows
each node only its own files, and only rank 0's node the manifests). The
ranks exchange their views; for a candidate step, the manifest comes from
the lowest rank that sees it on the first level (else on a node-local level,
which keeps the same bytes), sent to all; a copy that does not decode (its
digest does not match) is passed over for the next one. Then every rank says what its node
holds and what its load needs, and the step is restorable when every node can
have every file it needs: on its own disk, copied or rebuilt from other
nodes (``execute.py``), or from a store level that holds the whole step.

Collective: every rank calls these functions in the same order, on the main
thread (they use the trainer's process group through ``_dist``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _dist
from ..checkpoint import decoded_manifest
from ..errors import ManifestError
from ..format import Manifest
from ..levels.base import LevelDriver
from .inventory import gather_inventories, split_needs, take_inventory
from .plan import PART_SHARE, Inventory, RestorePlan, plan_restore, rebuilders

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

    def on_a_store(self, step: int, drivers: Sequence[LevelDriver]) -> bool:
        """Whether a store level above the first holds ``step`` for every rank."""
        return any(
            not driver.node_local and all(step in view[i] for view in self.everyone)
            for i, driver in enumerate(drivers)
            if i > 0
        )


@dataclass(frozen=True)
class Restore:
    """How this rank loads ``step``: the transfers every node needs first (``plan``),
    then the levels to read, in order (the first level first when a manifest
    for it was found), or why the step cannot be restored (``reasons``).

    A value: a re-plan, a reference chain or a reason found later make a new one
    (``dataclasses.replace``)."""

    step: int
    levels: tuple[int, ...]
    manifest: bytes | None  # the first level's manifest (as its holder read it)
    plan: RestorePlan | None = None
    inventories: tuple[Inventory, ...] = ()
    reasons: tuple[str, ...] = ()
    mine: Inventory | None = None  # this rank's own, as taken (before the exchange merged it)
    #: A first-level delta's references, oldest first, each restored before the
    #: step (the reader finds them beside it on the first level).
    chain: tuple[Restore, ...] = ()
    #: Newer steps a load of the newest step passed over: quarantined.
    passed_over: tuple[int, ...] = ()
    #: Newer steps a load of the newest step passed over: not every rank could
    #: restore them (a lost node's newest files, a copy cut short by a crash).
    unrestorable: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every rank can read everything it needs."""
        return not self.reasons

    def reference_step(self) -> int | None:
        """The step the first-level manifest's deltas are coded against (None: whole,
        or no first-level manifest)."""
        if self.manifest is None:
            return None
        return decoded_manifest(self.manifest, f"step {self.step}").reference_step


def gather_views(drivers: Sequence[LevelDriver]) -> Views:
    """Every rank's view of every level. Collective.

    Every rank receives ``8 R + R x`` the largest view's pickle (``L`` levels of
    ``S`` steps each): no files in it, so it stays per rank (``docs/scale.md``)."""
    mine = {i: d.steps() for i, d in enumerate(drivers)}
    return Views(mine, _dist.all_gather_object(mine))


def restorable(
    step: int,
    drivers: Sequence[LevelDriver],
    views: Views,
    *,
    node: int,
    needs: Callable[[Manifest], dict[str, list[list[int]]] | None],
    transfers: bool,
    names: Sequence[str] | None = None,
    members: Sequence[int] = (),
    group: Any = None,
    part_share: float = PART_SHARE,
) -> Restore:
    """How every rank can load ``step`` (``Restore.ok``), the same verdict on all. Collective.

    ``node``: this rank's node; ``needs(manifest)``: per file, the byte ranges
    this rank's load reads (``restore.needed_ranges``; None: all); ``transfers``:
    whether files may be moved between nodes (``execute.py``), else only what
    each node sees, and store levels, count;
    ``names``: the levels as the user wrote them (for messages; default: their URLs);
    ``members`` (the ranks of this rank's node) and ``group`` (the restore's):
    the inventories are exchanged by node, the node's lowest rank sending what the
    node holds and needs (``restore.gather_inventories``; bytes per rank in
    ``docs/scale.md``); ``part_share``: see ``plan_restore``.
    """
    whole = [
        i for i in range(1, len(drivers)) if not drivers[i].node_local and step in views.mine[i]
    ]
    raw: bytes | None = None
    damaged: list[str] = []
    # The first holder whose copy decodes; one broadcast unless a copy is damaged.
    for rank, level in _manifest_sources(step, drivers, views):
        mine = _read_manifest(drivers[level], step) if _dist.rank() == rank else None
        raw, why = _dist.broadcast_object(mine, rank)
        if raw is not None:
            break
        if why is not None:
            damaged.append(why)
    if raw is None:  # only store levels above the first hold it (or a whole copy)
        ok = all(_dist.all_gather_object(bool(whole)))
        why = () if ok else (*damaged, f"step {step}: some rank sees it on no level it can read")
        return Restore(step, tuple(whole), None, reasons=why)
    manifest = decoded_manifest(raw, drivers[0].checkpoint(step).url)
    inventory = take_inventory(
        step, drivers, manifest, split_needs(needs(manifest), manifest, part_share), node, whole
    )
    wanted = inventory.needs  # None: every file
    local = [i for i in sorted(inventory.files) if i > 0]
    levels = (0, *local, *whole)
    # The common case first: every rank's node already holds what it needs on the
    # first level. One boolean each, instead of every rank's file lists.
    own = set(inventory.files.get(0, ()))
    if all(_dist.all_gather_object(set(wanted or manifest.files) <= own)):
        return Restore(step, levels, raw, RestorePlan(step), (inventory,))
    everyone = gather_inventories(inventory, members, group)
    urls = list(names) if names is not None else [d.url for d in drivers]
    plan = plan_restore(
        step,
        manifest.files,
        everyone,
        urls,
        transfers=transfers,
        part_share=part_share,
        rebuilders=rebuilders(drivers),
    )
    return Restore(step, levels, raw, plan, tuple(everyone), plan.reasons, inventory)


def _manifest_sources(
    step: int, drivers: Sequence[LevelDriver], views: Views
) -> Iterator[tuple[int, int]]:
    """(rank, level) holders of the step's first-level manifest, in the order to read
    them: the first level's holders, then a node-local level's (the same bytes)."""
    for level in [0] + [i for i, d in enumerate(drivers) if i > 0 and d.node_local]:
        for rank, view in enumerate(views.everyone):
            if step in view[level]:
                yield rank, level


def _read_manifest(driver: LevelDriver, step: int) -> tuple[bytes | None, str | None]:
    """The manifest's bytes once they decode, else None and why (None: it is gone).

    Decoded here, on its holder, so that a damaged copy (its digest does not
    match) sends every rank on to the next copy instead of stopping the load."""
    checkpoint = driver.checkpoint(step)
    try:
        raw = checkpoint.manifest_bytes()
    except OSError as e:  # deleted since listing: this step is not on that level
        logger.warning("dcp_multilevel: cannot read the manifest of step %d: %s", step, e)
        return None, None
    try:
        decoded_manifest(raw, checkpoint.url)
    except ManifestError as e:
        logger.warning("dcp_multilevel: %s Passing over this copy of step %d.", e, step)
        return None, str(e)
    return raw, None

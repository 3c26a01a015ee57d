"""Loading a step through the levels: agree on it, bring each node what it lacks.

What a :class:`~dcp_multilevel.MultiLevelReader` given ``levels`` does around
DCP's calls (``levels/loads.py``), in two phases:

- :meth:`Restorer.choose` (``read_metadata``): agree collectively on the step
  (the one asked for, or the newest every rank can restore: :class:`Views`,
  ``restore_inventory.py``, ``restore_plan.py``) and bring onto each node, whole, the files its
  own ranks wrote that it lacks (a lost node's files, copied or rebuilt over
  the restore's gloo group, in rounds that leave damaged sources out); damage
  found while copying sends it on to the next older step;
- :meth:`Restorer.complete` (``read_data``, once DCP's plan says which items each
  rank reads): the byte ranges each rank reads of other ranks' files, brought
  as items (a parts copy beside the step) or files; then the copies to read,
  fastest first (:meth:`Restorer.copies`).

When a read fails on a first-level file damaged since the save (the step's or
one of its references'), :meth:`Restorer.repair` sets those files aside and
fetches intact copies, and the reader reads again.

Call order (every rank, main thread, the same steps)::

    restore = restorer.choose(views, step)          collective (step None: the newest)
    restore = restorer.complete(restore, views, ranges)   collective
    copies, manifest = restorer.copies(restore)
    ... read ...
    restorer.repair(restore)                        collective, when some rank's read failed

**Agreement** (:class:`Views`, :class:`Restore`): which step every rank can restore, and
from which levels, agreed collectively.

Each rank lists what it sees on every level (a node-local first level shows
each node only its own files, and only rank 0's node the manifests). The
ranks exchange their views; for a candidate step, the manifest comes from
the lowest rank that sees it on the first level (else on a node-local level,
which keeps the same bytes), sent to all; a copy that does not decode (its
digest does not match) is passed over for the next one. Then every rank says what its node
holds and what its load needs, and the step is restorable when every node can
have every file it needs: on its own disk, copied or rebuilt from other
nodes (``restore_execute.py``), or from a store level that holds the whole step.

Collective: every rank calls these functions in the same order, on the main
thread (they use the trainer's process group through ``_dist``).

**Rounds** (:class:`Transfers`): the files and items each node lacks, copied, linked or
rebuilt.

:class:`Transfers` runs what ``restore_plan.py`` planned (``restore_execute.py``
moves the bytes), in rounds that re-plan around damaged sources, sets aside damaged
first-level files, and keeps each node's first level readable afterwards
(the manifests a delta's references need beside them, and the step's own on
rank 0's node). Every method that says so is collective: every rank calls
it in the same order, on the main thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _dist
from .._phases import reached
from ..checkpoint import decoded_manifest
from ..errors import CheckpointNotFoundError, DcpMultilevelError, ManifestError
from ..format import MANIFEST_NAME, Manifest, rank_files
from .base import LevelDriver
from .config import PART_SHARE
from .lanes import Lanes
from .restore_actions import CopyFault, Fault, Inventory
from .restore_execute import RestoreReport, execute, parts_copy
from .restore_execute import set_aside_damaged as set_aside_files
from .restore_inventory import gather_inventories, split_needs, take_inventory, whole_files_of
from .restore_plan import RestorePlan, plan_restore, rebuilders
from .topology import Topology

__all__ = [
    "Needs",
    "Restore",
    "Restorer",
    "Transfers",
    "Views",
    "every_file",
    "gather_views",
    "restorable",
]


#: What a rank reads of a step, given its manifest: per data file, byte ranges (None: all).
Needs = Callable[[Manifest], dict[str, list[list[int]]] | None]

logger = logging.getLogger(__name__)


class Restorer:
    """Plans and carries out a runtime's loads (see the module docstring), moving files
    between nodes with ``transfers``."""

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self.drivers = transfers.drivers
        #: After a load: how many items each copy served on this rank.
        self.last_load_sources: dict[str, int] = {}
        #: The last load's restore: files brought onto this rank's node, by source.
        self.last_restore: RestoreReport | None = None
        #: Seconds the last load spent in each phase on this rank: ``plan`` (agreeing
        #: on the step, inventories, the restore plan), ``bring`` (copies, links,
        #: rebuilds), ``read`` (the reader's, through the levels).
        self.last_phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the block's seconds in :attr:`last_phases` under ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.last_phases[name] = self.last_phases.get(name, 0.0) + time.perf_counter() - t0

    def choose(
        self,
        views: Views,
        step: int | None = None,
        reads: Needs | None = None,
        allow_quarantined: bool = False,
    ) -> Restore | None:
        """Agree on ``step`` (None: the newest clean step every rank can restore) and
        bring onto each node, whole, the files of its own ranks it lacks; the restore,
        or None when no level holds a checkpoint (``step`` None only). Collective.

        ``reads``: what each rank's load reads, when the caller knows it (a dry run of
        its load planner): then exactly that is brought, and :meth:`complete` has
        nothing left to do. A quarantined step (``format/health.py``) is passed over,
        logged, unless ``allow_quarantined``; one asked for by its number is loaded
        with a warning (``Restore.passed_over``: the steps passed over).

        Raises:
            CheckpointNotFoundError: no level holds ``step``, or not every rank can
                restore it; or checkpoints exist, but none can be restored by every
                rank, or every one is quarantined (never a silent fresh start).
        """
        self.last_phases = {}
        self.last_restore = None
        if step is not None:
            plan = self._choose_step(views, step, reads)
            _warn_if_quarantined(plan, "asked for by its number")
            return plan
        candidates = views.candidates()
        newest: Restore | None = None
        passed: list[int] = []
        unrestorable: list[int] = []
        for candidate in reversed(candidates):
            plan = self.plan(candidate, views, reads or every_file)
            newest = newest or plan
            if not plan.ok:
                unrestorable.append(candidate)
                continue
            why = _quarantine_of(plan)
            if why is not None and not allow_quarantined:
                logger.warning(
                    "dcp_multilevel: passing over step %d, quarantined: %s", candidate, why
                )
                passed.append(candidate)
                continue
            if why is not None:
                _warn_if_quarantined(plan, "allow_quarantined=True")
            try:
                plan = self._bring_first(plan, views, reads)
            except CheckpointNotFoundError as e:
                # Damage found only while copying (every rank re-planned alike):
                # the next older step may still be whole.
                logger.warning("dcp_multilevel: %s; trying an older step", e)
                if newest is plan:
                    newest = dataclasses.replace(plan, reasons=(*plan.reasons, str(e)))
                unrestorable.append(candidate)
                continue
            return dataclasses.replace(
                plan, passed_over=tuple(passed), unrestorable=tuple(unrestorable)
            )
        if passed:
            first = self.drivers[0].level
            raise CheckpointNotFoundError(
                f"every checkpoint every rank can restore is quarantined (steps "
                f"{sorted(passed)} on {first.url}: their checks found poisoned state, see "
                "`dcp-multilevel ls`). Load one deliberately by its number, or with "
                "MultiLevelReader(..., allow_quarantined=True) / load_latest("
                "allow_quarantined=True), or start fresh with a new level location.",
                checkpoint=first.checkpoint_url(max(passed)),
            )
        if candidates:
            first = self.drivers[0].level
            raise CheckpointNotFoundError(
                f"committed checkpoints exist (newest: step {candidates[-1]}), but for each of "
                f"them some rank cannot reach all of its data files on {first.url} (a "
                "node-local level on a lost or new node?) and no higher level holds it"
                + _why(newest)
                + ". Restore the nodes' disks, or start fresh deliberately "
                "with a new level location.",
                checkpoint=first.checkpoint_url(candidates[-1]),
            )
        return None

    def _choose_step(self, views: Views, step: int, reads: Needs | None) -> Restore:
        first = self.drivers[0].level
        if not views.anywhere(step):
            raise CheckpointNotFoundError(
                f"step {step} has no complete checkpoint on any level ("
                + "; ".join(
                    f"{d.url}: {views.mine[i][-3:] or 'none'}" for i, d in enumerate(self.drivers)
                )
                + " are the newest there). Refusing to start fresh silently: pick an existing "
                "step or load the latest.",
                checkpoint=first.checkpoint_url(step),
            )
        plan = self.plan(step, views, reads or every_file)
        if not plan.ok:
            raise CheckpointNotFoundError(
                f"step {step} is committed on {first.url}, but not every rank can reach "
                "all of its data files there (a node-local level on a lost or new node?) and no "
                "higher level holds it" + _why(plan) + ". Load an earlier step that a higher "
                "level holds.",
                checkpoint=first.checkpoint_url(step),
            )
        return self._bring_first(plan, views, reads)

    @staticmethod
    def _own_files(manifest: Manifest) -> dict[str, list[list[int]]]:
        """What a rank surely reads of a step saved by as many ranks: the files its own
        rank wrote, whole."""
        return {f: [[0, manifest.files[f]]] for f in rank_files(manifest.files, _dist.rank())}

    def _bring_first(self, plan: Restore, views: Views, reads: Needs | None) -> Restore:
        """``plan`` says the step can be had (what ``reads`` says each rank reads, else
        every file): bring what it planned (``reads``), or each node the files its own
        ranks wrote that it lacks (a lost node's), whole, where the step was saved by as
        many ranks (after another world size, :meth:`complete` brings what each rank
        reads). The restore done (``plan`` when nothing was needed). Collective."""
        if plan.manifest is None or plan.plan is None or not plan.plan.actions:
            return plan
        if reads is not None:
            self._bring(plan)
            return plan
        world = decoded_manifest(plan.manifest, f"step {plan.step}").world_size
        if world != _dist.world_size():
            return plan
        # Not after the plan above: only if a source was lost meanwhile.
        own = self._planned(plan.step, views, self._own_files)
        self._bring(own)
        return own

    def complete(self, plan: Restore, views: Views, reads: Needs | None) -> Restore:
        """Bring what each rank's load reads of ``plan``'s step and its references
        (``reads(manifest)``: per data file, the byte ranges of its items; None: brought
        already, by :meth:`choose`), then keep the references' manifests beside them and
        the step's on rank 0's node. Collective.

        Raises:
            CheckpointNotFoundError: not every rank can have what it reads.
        """
        if plan.manifest is not None and reads is not None:
            passed = {"passed_over": plan.passed_over, "unrestorable": plan.unrestorable}
            plan = dataclasses.replace(self._planned(plan.step, views, reads), **passed)
            self._bring(plan)
        for ref in plan.chain:
            assert ref.manifest is not None  # plan() keeps only references with one
            self.transfers.keep_manifest(ref.step, ref.manifest)
        if plan.plan is not None and plan.manifest is not None and self.last_restore is not None:
            self.transfers.recommit_first_level(plan)
        if plan.manifest is not None:
            # A node's lowest rank wrote those manifests: none of its ranks reads before.
            _dist.all_gather_object(None)
        return plan

    def _planned(self, step: int, views: Views, needs: Needs) -> Restore:
        """:meth:`plan`, or CheckpointNotFoundError saying why not every rank can have
        what ``needs`` says it reads. Collective."""
        plan = self.plan(step, views, needs)
        if not plan.ok:
            raise CheckpointNotFoundError(
                f"step {step} cannot be restored: " + "; ".join(plan.reasons),
                checkpoint=self.drivers[0].level.checkpoint_url(step),
            )
        return plan

    def _bring(self, plan: Restore) -> None:
        """Bring each node what ``plan`` says it lacks (the references first). Collective."""
        parts = [ref for ref in plan.chain if ref.plan is not None and ref.plan.actions]
        if plan.plan is not None and plan.manifest is not None:
            parts.append(plan)
        if parts:
            with self.phase("bring"):
                self.last_restore = self.transfers.bring_files(parts, report=self.last_restore)

    def copies(self, plan: Restore) -> tuple[list[tuple[str, dict[str, Any] | None]], bytes | None]:
        """The copies to read ``plan``'s step from, fastest first (location, storage
        options), and the first copy's manifest when this rank may not see it there.

        The first level serves what this rank sees there (with what the restore
        brought); items a restore brought without their whole file are in the step's
        parts copy; the rest comes, file by file, from the higher levels.
        """
        copies = [self.drivers[i].checkpoint(plan.step) for i in plan.levels]
        options: list[dict[str, Any] | None] = [
            self.drivers[i].root.storage_options for i in plan.levels
        ]
        if plan.levels and plan.levels[0] == 0 and plan.manifest is not None:
            first = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest)
            parts = parts_copy(first, first.manifest())
            if parts is not None and parts.is_committed():
                copies.insert(1, parts)
                options.insert(1, None)
        primary = plan.manifest if plan.levels and plan.levels[0] == 0 else None
        return [(c.location, o) for c, o in zip(copies, options, strict=True)], primary

    def repair(self, plan: Restore) -> bool:
        """After a read some rank failed: set this node's damaged first-level files of the
        step (and its references) aside and fetch intact copies from other nodes; True
        when something was fetched (read again). Collective."""
        if self.transfers.group is None:
            return False
        damaged = []
        for part in [*plan.chain, plan]:  # the same list on every rank (agreed)
            if part.plan is not None and part.manifest is not None:
                bad = self.transfers.set_aside_damaged(part)
                if bad:
                    damaged.append((part, bad))
        if not damaged:
            return False
        with self.phase("bring"):
            self.last_restore = self.transfers.bring_files(
                [part for part, _ in damaged], [bad for _, bad in damaged], self.last_restore
            )
        return True

    def record(self, step: int) -> dict[str, Any]:
        """The last load's metrics record: where the time went, what came from where."""
        restore = self.last_restore
        return {
            "kind": "load",
            "rank": _dist.rank(),
            "step": step,
            **{f"{name}_seconds": seconds for name, seconds in self.last_phases.items()},
            "sources": dict(self.last_load_sources),
            "received": dict(restore.received) if restore is not None else {},
            "unix": time.time(),
        }

    def kept(self, plan: Restore, key: str) -> Any:
        """What the loaded step's manifest keeps under ``key`` in its ``extra`` (rank 0
        reads it from the first level that has it; every rank gets it). Collective."""

        def read() -> Any:
            for index in plan.levels:
                try:
                    known = plan.manifest if index == 0 else None
                    ckpt = self.drivers[index].checkpoint(plan.step, manifest_bytes=known)
                    return ckpt.manifest().extra.get(key)
                except (DcpMultilevelError, OSError):
                    continue  # the load read another copy: so does this
            return None

        return _dist.rank0_decides(read)

    def plan(self, step: int, views: Views, needs: Needs) -> Restore:
        """How every rank can load ``step`` (``Restore.ok``), logged when it cannot. Collective.

        ``needs(manifest)``: per data file, the byte ranges this rank reads (None: all).

        A first-level delta is read beside its references on the same level:
        each of them must be restorable too (``Restore.chain``, whole files:
        a reference is found in the step's directory, never in a parts copy).
        """
        with self.phase("plan"):
            return self._plan(step, views, needs)

    def _plan(self, step: int, views: Views, reads: Needs) -> Restore:
        t = self.transfers

        def agree(at: int, whole_files: bool) -> Restore:
            def needs(manifest: Manifest) -> dict[str, list[list[int]]] | None:
                ranges = reads(manifest)
                return whole_files_of(ranges, manifest) if whole_files else ranges

            return restorable(
                at,
                self.drivers,
                views,
                node=t.node(),
                needs=needs,
                transfers=t.group is not None,
                names=t.names,
                members=t.node_ranks(),
                group=t.group,
                part_share=t.part_share,
            )

        plan = agree(step, whole_files=False)
        chain: list[Restore] = []  # the references, newest first while they are found
        why_not: list[str] = []
        link = plan.reference_step()
        while plan.ok and link is not None:
            if any(r.step == link for r in chain) or link >= step:
                why_not.append(f"step {step}: its reference chain loops at step {link}")
                break
            ref = agree(link, whole_files=True)
            if not ref.ok or ref.manifest is None:
                why = "; ".join(ref.reasons) or "only store levels hold it"
                if views.on_a_store(step, self.drivers):
                    # The reader falls back, item by item, to the store level.
                    logger.warning(
                        "dcp_multilevel: step %d is a delta against step %d, which "
                        "cannot be restored onto the nodes (%s); reading it from a "
                        "store level",
                        step,
                        link,
                        why,
                    )
                    chain.clear()
                    break
                why_not.append(
                    f"step {step} is a delta against step {link}, which cannot be restored: {why}"
                )
                break
            chain.append(ref)
            link = ref.reference_step()
        plan = dataclasses.replace(
            plan, chain=tuple(reversed(chain)), reasons=(*plan.reasons, *why_not)
        )
        if not plan.ok:
            logger.warning(
                "dcp_multilevel: step %d cannot be restored: %s", step, "; ".join(plan.reasons)
            )
        return plan


def _quarantine_of(plan: Restore) -> str | None:
    """Why ``plan``'s step is quarantined (its first-level manifest says), else None.
    Only the first level holds quarantined steps: a step read from higher levels only
    was drained, so it was clean."""
    if plan.manifest is None:
        return None
    manifest = decoded_manifest(plan.manifest, f"step {plan.step}")
    return manifest.health.reason() if manifest.quarantined else None  # type: ignore[union-attr]


def _warn_if_quarantined(plan: Restore, how: str) -> None:
    why = _quarantine_of(plan)
    if why is not None:
        logger.warning(
            "dcp_multilevel: loading step %d, which is QUARANTINED (%s): %s", plan.step, how, why
        )


def every_file(manifest: Manifest) -> None:
    """What a step must offer every rank to be loadable whatever each one reads (its
    load plan is not known yet when the step is chosen): every file (None)."""
    return None


def _why(plan: Restore | None) -> str:
    return f" ({'; '.join(plan.reasons)})" if plan is not None and plan.reasons else ""


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


#: How many times a restore re-plans around damaged sources before giving up.
_RESTORE_ROUNDS = 4


class Transfers:
    """A runtime's restores onto its nodes (see the module docstring).

    Args:
        drivers: the level drivers, first level first.
        names: the levels as the user wrote them (for messages and reports).
        topology: which node each rank is on (None: unknown; nothing is shared).
        restore_group: the gloo group restores move bytes over (None: no transfers).
        lanes: the runtime's lanes (a restore first lets running drains end).
        part_share: see ``plan_restore`` (0: whole files).
    """

    def __init__(
        self,
        drivers: Sequence[LevelDriver],
        names: Sequence[str],
        topology: Topology | None,
        restore_group: Any,
        lanes: Lanes,
        part_share: float = PART_SHARE,
    ) -> None:
        self.drivers = list(drivers)
        self.names = list(names)
        self.topology = topology
        self.group = restore_group
        self.part_share = part_share
        self._lanes = lanes

    def node(self) -> int:
        """This rank's node (its rank when the topology is unknown: nothing is shared)."""
        return self.topology.nodes[_dist.rank()] if self.topology is not None else _dist.rank()

    def node_ranks(self) -> list[int]:
        """The ranks of this rank's node (just this one when the topology is unknown)."""
        if self.topology is None:
            return [_dist.rank()]
        return list(self.topology.ranks_on(self.node()))

    def recommit_first_level(self, plan: Restore) -> None:
        """Write the step's manifest on rank 0's first level when a restore brought the
        files there but the manifest was lost with the node (a node-local first level
        keeps it on rank 0's node only): drains of the step read it there."""
        if _dist.rank() != 0 or plan.levels[0] != 0 or plan.manifest is None:
            return
        first = self.drivers[0].checkpoint(plan.step)
        if not first.is_committed():
            logger.info(
                "dcp_multilevel: step %d: its manifest was lost with rank 0's node; "
                "writing it again on %s",
                plan.step,
                first.url,
            )
            first.store.write_atomic(MANIFEST_NAME, plan.manifest)

    def keep_manifest(self, step: int, data: bytes) -> None:
        """Write first-level ``step``'s manifest (``data``, as rank 0 read it) on this
        node's part of the first level where it is missing: the node's lowest rank
        (every rank when the topology is unknown: each may have a disk of its own).

        A delta's reference is found beside it, on the reading rank's node; a
        node-local first level has the manifests on rank 0's node only.
        """
        rank = _dist.rank()
        if self.topology is not None and not self.topology.leads(rank):
            return
        ckpt = self.drivers[0].checkpoint(step)
        # A node that holds none of the step's files reads no delta against it.
        if not ckpt.is_committed() and ckpt.data_files():
            ckpt.store.write_atomic(MANIFEST_NAME, data)

    def set_aside_damaged(self, plan: Restore) -> set[Fault]:
        """Check this node's first-level files of the step (one rank per node) and
        rename the damaged ones aside; every node's findings, as bad sources. Collective."""
        assert plan.manifest is not None
        found: list[str] = []
        node = self.node()
        if self.topology is None or self.topology.leads(_dist.rank()):
            first = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest)
            mine = [i for i in plan.inventories if i.node == node]
            if len(plan.inventories) < _dist.world_size():  # the fast path kept only ours
                mine = [dataclasses.replace(mine[0], needs=None)]  # check every file here
            found = set_aside_files(first, mine)
        everyone = _dist.all_gather_object((node, found))
        bad: set[Fault] = {CopyFault(n, f) for n, files in everyone for f in files}
        if bad:
            logger.warning(
                "dcp_multilevel: step %d: damaged first-level files set aside, "
                "fetching intact copies: %s",
                plan.step,
                sorted(bad),
            )
        return bad

    def bring_files(
        self,
        parts: Sequence[Restore],
        bad: Sequence[set[Fault]] | None = None,
        report: RestoreReport | None = None,
    ) -> RestoreReport:
        """Copy or rebuild onto each node the files each of ``parts`` lacks (steps: a
        delta's references, then the step; collective), in rounds: a source found
        damaged (``bad``, one set per part, and what each round finds) is left out
        of that part's next plan. Within a round the parts' transfers run one after
        another with no wait in between: a rank goes on to the next step's as soon
        as its own part of the last one is done (every rank walks the same actions
        in the same order, so none waits on a transfer that never comes). Counts go
        on ``report`` (a new one, for the last part's step, by default)."""
        assert all(part.plan is not None and part.manifest is not None for part in parts)
        t0 = time.perf_counter()
        bads = [set(b) for b in bad] if bad is not None else [set() for _ in parts]
        parts = list(parts)  # each part's inventories are renewed by a re-plan
        steps: list[RestorePlan | None] = []
        for i, b in enumerate(bads):
            if b:
                parts[i] = self.replan(parts[i], b)
            steps.append(parts[i].plan)
        report = report if report is not None else RestoreReport(parts[-1].step)
        for _ in range(_RESTORE_ROUNDS):
            todo = [i for i, s in enumerate(steps) if s is not None and s.actions]
            if not todo:
                break
            for drain_driver in self.drivers:  # a running drain must not race the restore
                self._lanes.finish(drain_driver)
            found = [
                execute(
                    steps[i],
                    self.drivers,
                    parts[i].manifest,
                    self.group,  # type: ignore[arg-type]
                    parts[i].inventories,
                )
                for i in todo
            ]
            reached("restore", parts[-1].step)
            everyone = _dist.all_gather_object(found)
            for k, i in enumerate(todo):
                part, done = parts[i], steps[i]
                assert done is not None
                found_everywhere = {b for theirs in everyone for b in theirs[k]}
                report.add(done, self.names, part.inventories, self.node(), found_everywhere)
                steps[i] = None
                if found_everywhere:
                    bads[i] |= found_everywhere
                    damaged = sorted(map(repr, found_everywhere))
                    logger.warning(
                        "dcp_multilevel: damaged sources for step %d: %s; trying others",
                        part.step,
                        damaged,
                    )
                    parts[i] = self.replan(part, bads[i])
                    steps[i] = parts[i].plan
        report.seconds += time.perf_counter() - t0
        if report.received:
            logger.info(
                "dcp_multilevel: step %d restored onto this node: %s in %.2f s",
                report.step,
                report.received,
                report.seconds,
            )
        return report

    def replan(self, plan: Restore, bad: set[Fault]) -> Restore:
        """``plan`` planned again from fresh inventories, leaving ``bad`` out (collective)."""
        assert plan.manifest is not None
        manifest = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest).manifest()
        mine = plan.mine or next(i for i in plan.inventories if i.rank == _dist.rank())
        inventory = take_inventory(
            plan.step, self.drivers, manifest, (mine.needs, mine.ranges), mine.node, mine.whole
        )
        everyone = gather_inventories(inventory, self.node_ranks(), self.group)
        kinds = rebuilders(self.drivers)
        steps = plan_restore(
            plan.step,
            manifest.files,
            everyone,
            self.names,
            bad,
            part_share=self.part_share,
            rebuilders=kinds,
        )
        if not steps.ok:
            raise CheckpointNotFoundError(
                f"step {plan.step} cannot be restored: " + "; ".join(steps.reasons),
                checkpoint=self.drivers[0].level.checkpoint_url(plan.step),
            )
        return dataclasses.replace(plan, plan=steps, inventories=tuple(everyone))

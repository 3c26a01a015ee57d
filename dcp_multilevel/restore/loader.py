"""Loading a step through the levels: agree on it, bring each node what it lacks.

What a :class:`~dcp_multilevel.MultiLevelReader` given ``levels`` does around
DCP's calls (``plugin/level_reads.py``), in two phases:

- :meth:`Loader.choose` (``read_metadata``): agree collectively on the step
  (the one asked for, or the newest every rank can restore: ``agreement.py``,
  ``inventory.py``, ``plan.py``) and bring onto each node, whole, the files its
  own ranks wrote that it lacks (a lost node's files, copied or rebuilt over
  the restore's gloo group, in rounds that leave damaged sources out); damage
  found while copying sends it on to the next older step;
- :meth:`Loader.complete` (``read_data``, once DCP's plan says which items each
  rank reads): the byte ranges each rank reads of other ranks' files, brought
  as items (a parts copy beside the step) or files; then the copies to read,
  fastest first (:meth:`Loader.copies`).

When a read fails on a first-level file damaged since the save (the step's or
one of its references'), :meth:`Loader.repair` sets those files aside and
fetches intact copies, and the reader reads again.

Call order (every rank, main thread, the same steps)::

    restore = loader.choose(views, step)          collective (step None: the newest)
    restore = loader.complete(restore, views, ranges)   collective
    copies, manifest = loader.copies(restore)
    ... read ...
    loader.repair(restore)                        collective, when some rank's read failed
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import _dist
from ..checkpoint import decoded_manifest
from ..errors import CheckpointNotFoundError, DcpMultilevelError
from ..format import Manifest, rank_files
from .agreement import Restore, Views, restorable
from .execute import RestoreReport, parts_copy
from .inventory import whole_files_of
from .transfers import Transfers

__all__ = ["Loader", "Needs", "every_file"]

#: What a rank reads of a step, given its manifest: per data file, byte ranges (None: all).
Needs = Callable[[Manifest], dict[str, list[list[int]]] | None]

logger = logging.getLogger(__name__)


class Loader:
    """Plans and carries out a ladder's loads (see the module docstring), moving files
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

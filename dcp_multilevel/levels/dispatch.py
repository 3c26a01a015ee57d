"""Drain coordination: which drains a save starts, after a restart, and after a restore.

:class:`Dispatcher` builds the drain jobs a runtime's saves need (a first-level
step onto each higher level due, after the references a level between nodes
lacks), names them alike on every rank, takes rank 0's decisions where the
policy needs one, and hands them to the lanes (``levels/lanes.py``). It
also drains again what a crash left undone (:meth:`Dispatcher.resume`) and what
a restore onto a replaced node left unprotected (:meth:`Dispatcher.reprotect`).

Call order (main thread, every rank, the same arguments everywhere)::

    decision = drains.decide(step, due)    rank 0 (inside rank0_decides): what to
                                           skip ("skip"), what to send first
    sent = drains.submit(step, due,        every rank: one job per due level
                         decision, committed)
    drains.resume(view)                    after load_latest: drains a crash left
    drains.reprotect(plan)                 after a restore onto a replaced node
    drains.wait() / drains.close()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _dist
from ..checkpoint import decoded_manifest
from ..errors import DcpMultilevelError
from ..format import is_rank_file, rank_files
from .base import DrainJob, DrainResult, LevelDriver
from .books import Books
from .config import Level
from .deltas import DeltaHistory
from .lanes import Lanes
from .topology import Topology

__all__ = ["Dispatcher", "DrainDecision", "Sent"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainDecision:
    """Rank 0's decision for one save's drains, taken by every rank."""

    skip: tuple[int, ...] = ()  # levels the step is not sent to (policy "skip", busy)
    #: level -> first-level steps to drain there first (references it lacks)
    before: dict[int, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As a JSON value (rank 0 publishes it through the c10d store)."""
        return {"skip": list(self.skip), "before": {str(i): s for i, s in self.before.items()}}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> DrainDecision:
        """The decision :meth:`to_json` wrote."""
        before = {int(i): [int(s) for s in steps] for i, steps in value["before"].items()}
        return cls(tuple(int(i) for i in value["skip"]), before)


@dataclass
class Sent:
    """Where one save's step went: the URLs of the levels its drain started on, was
    skipped on (policy ``"skip"``), or waits behind a running drain (``"latest"``)."""

    started: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)


class Dispatcher:
    """Builds and submits the manager's drains (see the module docstring)."""

    def __init__(
        self,
        levels: Sequence[Level],
        drivers: Sequence[LevelDriver],
        chains: DeltaHistory,
        holdings: Books,
        topology: Topology | None,
        *,
        policy: str,
        timeout_s: float,
        instance: int,
        on_result: Callable[[DrainResult], None] | None = None,
    ) -> None:
        self.levels = list(levels)
        self.drivers = list(drivers)
        self.deltas = chains
        self.books = holdings
        self.topology = topology
        self._on_result = on_result
        # Drain ids key values in the c10d store, shared by every runtime of the
        # process group: ``instance`` numbers this one, the same on every rank.
        self._instance = instance
        self._generation = 0
        self.lanes = Lanes(
            policy=policy,
            timeout_s=timeout_s,
            on_committed=holdings.committed,
            on_result=self._ended,
            key=f"m{self._instance}",
        )

    # ------------------------------------------------------------------ saves

    def decide(self, step: int, due: Sequence[int]) -> DrainDecision:
        """Rank 0: which due levels to skip, and which references to send first."""
        policy = self.lanes.policy
        skip = tuple(i for i in due if policy == "skip" and self.lanes.busy(self.drivers[i]))
        before: dict[int, list[int]] = {}
        for i in due:
            if i in skip:
                continue
            if policy == "wait":  # then retention knows the outcome
                self.lanes.finish(self.drivers[i])
            before[i] = self._missing_references(i, step)
        return DrainDecision(skip, before)

    def submit(
        self,
        step: int,
        due: Sequence[int],
        decision: DrainDecision,
        committed_unix: float,
        supersedes: bool = False,
    ) -> Sent:
        """Every rank: start (or queue, or skip) the drain of ``step`` to each due level
        (``supersedes``: replacing the copies there of a timeline a load passed over)."""
        sent = Sent()
        self._generation += 1
        for i in due:
            skip = i in decision.skip
            ref = None if skip else self.deltas.reference(i)
            job = self._job(
                i,
                step,
                self._drain_id(i, step),
                committed_unix,
                decision.before.get(i, ()),
                ref,
                supersedes,
            )
            url = self.levels[i].url
            queued = self.lanes.busy(self.drivers[i])
            if self.lanes.submit(job, skip=skip) is None:
                self.books.dropped(i, step)
                sent.skipped.append(url)
                continue
            self.deltas.stored(i, step, ref)
            sent.started.append(url)
            if queued:
                sent.queued.append(url)
        return sent

    def _missing_references(self, index: int, step: int) -> list[int]:
        """Rank 0: the references of first-level ``step`` (its chain, oldest first) that
        level ``index`` must receive before it: a level between nodes copies the first
        level's deltas as they are, of use there only beside their references. Steps
        on rank 0's node's part of the level are not sent again; one a running drain
        is bringing there is dropped when this job starts, if it arrived."""
        if not self.deltas.holds_first_level_deltas(index):
            return []
        chain: list[int] = []
        driver = self.drivers[index]
        ref = self.deltas.refs(0, [step]).get(step)
        while ref is not None and not driver.checkpoint(ref).is_committed() and ref not in chain:
            chain.append(ref)
            ref = self.deltas.refs(0, [ref]).get(ref)
        return chain[::-1]

    def _drain_id(self, index: int, step: int, why: str = "") -> str:
        """The same on every rank for the same drain (submissions are in the same order)."""
        return f"m{self._instance}-{index}-{step}-{self._generation}{why and '-' + why}"

    def _job(
        self,
        index: int,
        step: int,
        drain_id: str,
        committed: float,
        first: Sequence[int] = (),
        reference: int | None = None,
        supersedes: bool = False,
    ) -> DrainJob:
        """The drain of first-level ``step`` to level ``index``, after drains of the
        first-level steps ``first`` (see :meth:`_missing_references`)."""
        source, target = self.drivers[0], self.drivers[index]
        before = tuple(
            DrainJob(s, source.checkpoint(s), target, f"{drain_id}-ref{s}", committed)
            for s in first
        )
        return DrainJob(
            step,
            source.checkpoint(step),
            target,
            drain_id,
            committed,
            reference,
            before,
            supersedes=supersedes,
        )

    def _ended(self, result: DrainResult) -> None:
        """Every drain's outcome, in the thread that decided it: its metrics record; a
        superseded step needs no protection on the first level any more."""
        if result.superseded:
            index = next(i for i, d in enumerate(self.drivers) if d.url == result.level)
            self.books.dropped(index, result.step)
        if self._on_result is not None:
            self._on_result(result)

    # ------------------------------------------------------------------ restarts

    def resume(self, view: dict[int, list[int]]) -> None:
        """Drain again the newest first-level step each higher level is due to hold and
        lacks (``view``: rank 0's listing, up to the loaded step). Collective."""
        first = view[0]
        resumed: dict[int, int] = {}
        for i in range(1, len(self.levels)):
            newest_there = max(view[i], default=-1)
            pending = [s for s in first if self.books.due(i, s) and s > newest_there]
            if pending:
                resumed[i] = pending[-1]
        if not resumed:
            return
        resumed = self._whole_on_first_level(resumed)
        if not resumed:
            return
        before = _dist.rank0_decides(
            lambda: {i: self._missing_references(i, step) for i, step in resumed.items()}
        )
        self._generation += 1
        for i, step in resumed.items():
            logger.info(
                "dcp_multilevel: resuming the drain of step %d to %s", step, self.levels[i].url
            )
            job = self._job(i, step, self._drain_id(i, step, "resume"), time.time(), before[i])
            self.lanes.submit(job, skip=False)  # every rank alike: never skipped

    def _whole_on_first_level(self, resumed: dict[int, int]) -> dict[int, int]:
        """The drains of :meth:`resume` (level -> step) whose step every rank holds its own
        files of on its node's first level; the others are dropped, logged. Collective.

        ``resume`` goes by rank 0's listing, but a drain sends each rank's files from
        its own node's first level. A replaced node lacks them when the load read its
        part of the step from a store level (killed during a partner copy, after the
        remote drain committed): that drain would fail on every rank, and the next
        ``wait()`` raise, for a step the levels need not hold again (the next save
        is copied as usual).
        """

        def files() -> dict[int, list[str] | None]:
            out: dict[int, list[str] | None] = {}
            for step in set(resumed.values()):
                try:
                    out[step] = sorted(self.drivers[0].checkpoint(step).manifest().files)
                except (DcpMultilevelError, OSError):
                    out[step] = None  # unreadable: left to the drain, which reports it
            return out

        names = _dist.rank0_decides(files)  # the manifest is on rank 0's node only
        rank = _dist.rank()
        mine = {
            step: listed is None
            or {f for f in listed if is_rank_file(f, rank)}
            <= self.drivers[0].checkpoint(step).data_files()
            for step, listed in names.items()
        }
        everyone = _dist.all_gather_object(mine)
        whole = {step for step in names if all(theirs[step] for theirs in everyone)}
        for i, step in resumed.items():
            if step not in whole:
                logger.warning(
                    "dcp_multilevel: step %d is not drained again to %s: some rank's files of "
                    "it are not on its node's first level (a replaced node; the load read them "
                    "from another level); the next save there is copied as usual",
                    step,
                    self.levels[i].url,
                )
        return {i: step for i, step in resumed.items() if step in whole}

    def reprotect(self, plan: Any) -> None:
        """After a restore onto a replaced node: drain the loaded step (and the
        references it was restored with) again to each node-local level that some
        nodes hold it on and others lack, so the copies or parity the lost node held
        for the others are made again now, not at the next save on that level.

        Decided from the restore's inventories (``plan``: the restorer's restore of
        the step), the same on every rank (a restore that needed nothing keeps only
        this rank's: nothing to do). Collective.
        """
        if self.topology is None:
            return
        nodes = set(self.topology.nodes)
        restored = {r.step: r for r in [*plan.chain, plan] if r.manifest is not None}
        redo: dict[int, list[int]] = {}  # level -> steps to copy again, oldest first
        holders: dict[tuple[int, int], set[int]] = {}  # (level, step) -> nodes holding it
        for step, r in restored.items():
            if len(r.inventories) < _dist.world_size():
                continue
            for i, driver in enumerate(self.drivers):
                held = {inv.node for inv in r.inventories if inv.files.get(i)}
                if i > 0 and driver.node_local and held and not held >= nodes:
                    redo.setdefault(i, []).append(step)
                    holders[i, step] = held
        if not redo:
            return
        # A drain sends each rank's own files from its node's first level: all must be
        # there (a step a store level served is not).
        own = True
        for step in sorted({s for steps in redo.values() for s in steps}):
            first = self.drivers[0].checkpoint(step)
            manifest = decoded_manifest(restored[step].manifest, first.url)
            if manifest.world_size != _dist.world_size():
                return  # the copies follow the saving job's placement (node_local.py)
            own = own and set(rank_files(manifest.files, _dist.rank())) <= first.data_files()
        if not all(_dist.all_gather_object(own)):
            logger.warning(
                "dcp_multilevel: step %d is not on every node of %s, and some rank's "
                "files are not on its first level to copy again; the next save "
                "there protects the nodes again",
                plan.step,
                [self.levels[i].url for i in redo],
            )
            return
        self._generation += 1
        for i, steps in redo.items():
            for step in steps:
                logger.info(
                    "dcp_multilevel: step %d is on %s on nodes %s only; copying it "
                    "again for nodes %s",
                    step,
                    self.levels[i].url,
                    sorted(holders[i, step]),
                    sorted(nodes - holders[i, step]),
                )
            drain_id = self._drain_id(i, steps[-1], "reprotect")
            job = self._job(i, steps[-1], drain_id, time.time(), steps[:-1])
            self.lanes.submit(job, skip=False)

    # ------------------------------------------------------------------ lifecycle

    def costs(self) -> tuple[dict[int, float], set[int]]:
        """Each higher level's last committed drain's seconds on this rank, and the
        levels whose lane is busy (for the schedule)."""
        drains: dict[int, float] = {}
        index_of = {d.url: i for i, d in enumerate(self.drivers)}
        for result in reversed(self.lanes.results):  # the newest first
            index = index_of.get(result.level)
            if result.committed and index is not None and index not in drains:
                drains[index] = result.seconds
                if len(drains) == len(self.drivers) - 1:
                    break
        busy = {i for i, d in enumerate(self.drivers) if i > 0 and self.lanes.busy(d)}
        return drains, busy

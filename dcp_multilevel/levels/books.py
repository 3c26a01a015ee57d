"""What each level holds, as the runtime knows it, and the retention that follows.

:class:`Books` is the one owner of the runtime's books: the levels each
step was decided for, the steps known committed on each higher level (from
drains and from listings at load time), and the steps a level will not get
(skipped, or superseded by a newer due step). First-level retention reads
them, never the remote itself, so a slow or unreachable remote cannot stall
``save``.

Threads: the main thread saves, decides and applies first-level retention;
each higher level's drain lane reports its commits (:meth:`Books.committed`,
the lanes' ``on_committed``) and applies that level's retention in its own
thread. The books are under one lock, held only to read or change them, never
during I/O or while waiting for a drain (a lane's callback would wait for it,
and the next ``save`` behind the lane). Each level's retention runs in one
thread only, so its listing and its deletions never race.

The books keep no state per save beyond the steps still on the first level:
what retention removes there is forgotten (a long run's books stay flat).

Call order (the runtime makes every call)::

    holdings.spare(lanes, saving)    construction: what retention must not delete
    holdings.decided(step, levels)     main thread, when the schedule sent a step
    holdings.due(index, step)          any thread
    holdings.retain(0) -> removed      rank 0, after a first-level save (holdings.oldest: the
                                       oldest step left there)
    holdings.removed_on_first(removed, oldest)   every rank: its node's copies of rank 0's
                                       removals; the books forget what is older
    holdings.committed(job)            a lane, after a drain committed (retention there)
    holdings.dropped(index, step)      when a step will not reach a level
    holdings.learned(index, steps)     main thread, from a listing at load time
    holdings.quarantined(steps)        any rank: steps whose checks found something
    holdings.cleared(step)             any rank: a step saved again, clean
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from .. import _dist
from ..schedule import SavePolicy
from .base import DrainJob, LevelDriver
from .config import Level
from .deltas import DeltaHistory
from .lanes import Lanes
from .retention import RetentionRules, not_yet_above
from .topology import Topology

__all__ = ["Books"]

logger = logging.getLogger(__name__)


class Books:
    """The manager's books and its retention (see the module docstring).

    Args:
        levels: the runtime's levels; ``drivers`` their drivers.
        schedule: decides the steps no decision was recorded for (fixed policies;
            None: only recorded decisions count, see :meth:`due`).
        chains: the levels' delta histories (references retention keeps).
        topology: which node each rank is on (None: unknown).
    """

    def __init__(
        self,
        levels: Sequence[Level],
        drivers: Sequence[LevelDriver],
        schedule: SavePolicy | None,
        chains: DeltaHistory,
        topology: Topology | None,
    ) -> None:
        self.levels = list(levels)
        self.drivers = list(drivers)
        self._schedule = schedule
        self.deltas = chains
        self.topology = topology
        self._lanes: Lanes | None = None
        self._saving: Callable[[], set[int]] | None = None
        self._rules = [RetentionRules(level.keep) for level in self.levels]
        #: Rank 0, after :meth:`retain` of the first level: the oldest step left there.
        self.oldest: int | None = None
        n = len(self.levels)
        # The race: a lane adds a commit or a superseded step while the main
        # thread's first-level retention reads the same sets.
        self._lock = threading.Lock()
        self._known: dict[int, set[int]] = {i: set() for i in range(n)}
        self._dropped: dict[int, set[int]] = {i: set() for i in range(n)}
        # step -> the levels a decision sent it to (an adaptive policy cannot be
        # asked again about a past step; retention and resumed drains look here).
        self._decided: dict[int, frozenset[int]] = {}
        # Steps committed quarantined (``format/health.py``): retention counts them last.
        self._quarantined: set[int] = set()

    def spare(self, lanes: Lanes, saving: Callable[[], set[int]] | None = None) -> None:
        """Retention spares what ``lanes``'s running and waiting drains read (the
        lanes reports its commits to :meth:`committed`: it is built after this), and
        on the first level the steps ``saving()`` names: saves in progress, whose
        directories have no manifest yet (retention runs beside the next save, and
        would take an older step's for one a crash abandoned)."""
        self._lanes = lanes
        self._saving = saving

    # ------------------------------------------------------------------ books

    def adopt_schedule(self, schedule: SavePolicy) -> None:
        """Steps no decision was recorded for are due as ``schedule`` says, unless a
        schedule was given already (the first manager's). Under the lock: the
        follower's retention asks :meth:`due` while the main thread builds a manager."""
        with self._lock:
            if self._schedule is None:
                self._schedule = schedule

    def decided(self, step: int, levels: frozenset[int]) -> None:
        """The schedule sent ``step`` to ``levels``."""
        with self._lock:
            self._decided[step] = levels

    def due(self, index: int, step: int, *, again: bool = False) -> bool:
        """Whether ``step`` was (or, for a fixed policy, is) due on level ``index``.
        ``again``: for a new save of ``step``: a quarantined save of it, due on the
        first level only, does not decide for the new one."""
        with self._lock:
            decided = self._decided.get(step)
            if again and step in self._quarantined:
                decided = None
            schedule = self._schedule
        if decided is not None:
            return index in decided
        if schedule is None:
            return False
        try:
            return schedule.due(index, self.levels[index], step)
        except NotImplementedError:  # an adaptive policy: only its recorded decisions count
            return False

    def learned(self, index: int, steps: Iterable[int]) -> None:
        """A listing shows ``steps`` committed on level ``index``."""
        with self._lock:
            self._known[index].update(steps)

    def quarantined(self, steps: Iterable[int]) -> None:
        """``steps`` were committed quarantined: retention counts them after clean ones."""
        with self._lock:
            self._quarantined.update(steps)

    def cleared(self, step: int) -> None:
        """``step`` was saved again, clean (over a quarantined save of it)."""
        with self._lock:
            self._quarantined.discard(step)

    def is_quarantined(self, step: int) -> bool:
        """Whether ``step`` is known to be quarantined."""
        with self._lock:
            return step in self._quarantined

    def dropped(self, index: int, step: int) -> None:
        """``step`` will not reach level ``index`` (skipped, or superseded there): the
        first level need not keep it for that level."""
        with self._lock:
            self._dropped[index].add(step)

    def committed(self, job: DrainJob) -> None:
        """A lane, after ``job`` committed: remember it, and apply that level's retention
        (rank 0; on a node-local level, the lowest rank of each node, on its node's part)."""
        index = self.drivers.index(job.target)
        self.learned(index, [job.step])
        if job.target.node_local and self.topology is not None:
            applies = self.topology.leads(_dist.rank())
        else:
            applies = _dist.rank() == 0
        if applies:
            try:
                self.retain(index)
            except OSError as e:  # retention is housekeeping: the drain itself succeeded
                logger.warning("dcp_multilevel: retention on %s failed: %s", job.target.url, e)

    # ------------------------------------------------------------------ retention

    def retain(self, index: int) -> list[int]:
        """Apply retention on level ``index`` (rank 0, or a node's lowest rank for a
        node-local level); return the steps removed."""
        driver, level = self.drivers[index], self.levels[index]
        found = driver.scan()  # one look at the level: both lists from the same moment
        complete = list(found.committed)
        protected = set()
        if self._lanes is not None:  # the first level: every lane's; else the level's own
            protected = self._lanes.inflight_steps(None if index == 0 else driver)
        if index == 0:
            protected |= self._first_level_protected(complete)
            if self._saving is not None:
                protected |= self._saving()
        refs = self.deltas.refs(index, complete)
        with self._lock:
            quarantined = set(self._quarantined)
        doomed = self._rules[index].doomed(
            complete, found.uncommitted, protected, refs, quarantined
        )
        for step in doomed:
            driver.delete(step)
            logger.info("dcp_multilevel: retention removed step %d from %s", step, level.url)
        kept = [s for s in complete if s not in doomed]
        self.deltas.retained(index, kept)
        if index == 0:
            self.oldest = min(kept, default=None)
            self._forget_below(self.oldest)
        # (Higher levels' removals are not recorded in the delta history: only rank 0
        # sees them, and every rank must choose a drain's reference alike. A drain
        # whose reference retention removed stores its step whole, on every rank.)
        return doomed

    def _forget_below(self, oldest: int | None) -> None:
        """Drop the books of steps older than ``oldest``, the oldest step left on the
        first level: no drain can start from them any more, and no retention or
        restart asks about them (None: the first level holds nothing; keep all)."""
        if oldest is None:
            return
        with self._lock:
            for books in (*self._known.values(), *self._dropped.values()):
                books.difference_update([s for s in books if s < oldest])
            for step in [s for s in self._decided if s < oldest]:
                del self._decided[step]
            self._quarantined.difference_update([s for s in self._quarantined if s < oldest])

    def _first_level_protected(self, complete: Sequence[int]) -> set[int]:
        """First-level steps a higher level still needs from there: due and not known
        there yet, and the reference the next delta drained there reads."""
        protected: set[int] = set()
        for j in range(1, len(self.levels)):
            with self._lock:
                known, dropped = set(self._known[j]), set(self._dropped[j])
            protected |= not_yet_above(complete, lambda s, j=j: self.due(j, s), known, dropped)
            ref = self.deltas.reference(j)
            if ref is not None:
                protected.add(ref)
        return protected

    def removed_on_first(self, removed: Sequence[int], oldest: int | None = None) -> None:
        """Every rank, after rank 0's first-level retention: each node removes the same
        steps from its own view (one rank per node), the chains forget them, and the
        books the steps older than ``oldest``, the oldest step rank 0 kept there."""
        if _dist.world_size() > 1 and self._deletes_for_node():
            for step in removed:
                self.drivers[0].delete(step)
        self.deltas.removed(0, removed)
        self._forget_below(oldest)

    def _deletes_for_node(self) -> bool:
        """True on the rank that applies rank 0's first-level retention to its node's
        view: one rank per node (all but rank 0, when the topology is unknown)."""
        rank = _dist.rank()
        if self.topology is None:
            return rank != 0
        nodes = self.topology.nodes
        return nodes[rank] != nodes[0] and self.topology.leads(rank)

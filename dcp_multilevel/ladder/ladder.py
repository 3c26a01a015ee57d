"""One level list, bound in this process: :class:`Ladder`.

Every :class:`~dcp_multilevel.MultiLevelWriter` and
:class:`~dcp_multilevel.MultiLevelReader` given the same ``levels`` (and the
:class:`~dcp_multilevel.CheckpointManager` over them) uses one ladder of the
process (``registry.py``), whatever the number of writers a training stack
builds: one view of what each level holds, one lane of drains per level. It
composes the parts, each owning one thing:

- ``binding.py``: the levels checked, their drivers bound, the topology;
- ``commits.py``: what follows each save's commit, on every rank, in order;
- ``drains.py``: which drains a save starts, after a restart, after a restore;
- ``holdings.py``: what each level holds, and the retention that follows;
- ``chains.py`` / ``keyframes.py``: the delta histories;
- ``restore/loader.py``: loads through the levels, a lost node's files back first.

Call order (every rank; the reader's and writer's calls, see ``plugin/``)::

    ladder = ladder_for(levels)                  registry.py; collective
    ref = ladder.first_reference()               a writer of a first level with deltas
    ticket = ladder.begin(step, due)             as DCP starts a save (any thread)
    ... write_data, finish: the ticket's outcome (commits.py) ...
    restore = ladder.loader.choose(views, step)  a reader's read_metadata, collective
    ladder.loaded(restore, views)                after every rank read it, collective
    ladder.wait()                                every due drain landed (DrainError)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint, decoded_manifest
from ..errors import ConfigError, DcpMultilevelError
from ..levels import DrainResult
from ..levels.options import Level
from ..restore import Loader
from ..restore.agreement import Restore, Views
from ..restore.transfers import Transfers
from .binding import Binding
from .chains import DeltaChains
from .commits import Commits, SaveTicket
from .drains import DrainDecision, Drains
from .holdings import Holdings
from .naming import describe

__all__ = ["LEVELS_KEY", "Ladder"]

logger = logging.getLogger(__name__)

#: The manifest's ``extra`` key under which each save keeps what the ladder decided:
#: ``{"save": n, "due": [level URLs]}`` (the n-th save of the level list; the higher
#: levels it was due on, as the user wrote them). A restart goes on from there.
LEVELS_KEY = "dcp_multilevel.levels"


class Ladder:
    """One level list, bound in this process (see the module docstring).

    Args:
        given: the levels as the user passed them (``{node}`` kept).
        binding: the same levels checked and bound (``Binding.build``, collective).
        key: what the registry knows the ladder by (see ``registry.py``).
        instance: numbers the ladder's values in the c10d store: ladders are made
            collectively, in the same order on every rank, so the same everywhere.
        policy, timeout_s: the drains' (``levels/drainer.py``).
        part_share: a restore's threshold for copying items rather than files.
    """

    def __init__(
        self,
        given: Sequence[Level],
        binding: Binding,
        *,
        key: str,
        instance: int,
        policy: str,
        timeout_s: float,
        part_share: float,
    ) -> None:
        self.given = list(given)
        self.binding = binding
        self.levels, self.drivers = binding.levels, binding.drivers
        self.topology = binding.topology
        self.key = key
        self.policy = policy
        self.timeout_s = timeout_s
        self.part_share = part_share
        self.chains = DeltaChains(self.levels, self.drivers)
        self.holdings = Holdings(self.levels, self.drivers, None, self.chains, self.topology)
        self.drains = Drains(
            self.levels,
            self.drivers,
            self.chains,
            self.holdings,
            self.topology,
            policy=policy,
            timeout_s=timeout_s,
            instance=instance,
            on_result=self._drain_ended,
        )
        transfers = Transfers(
            self.drivers,
            binding.names,
            self.topology,
            binding.restore_group,
            self.drains.drainer,
            part_share,
        )
        self.loader = Loader(transfers)
        self.commits = Commits(
            f"L{instance}", timeout_s, self._decide, self._apply, name=describe(self.given)
        )
        self.holdings.spare(self.drains.drainer, lambda: {t.step for t in self.commits.pending()})
        # The race: a lane reports a drain while the main thread adds a listener.
        self._lock = threading.Lock()
        self._listeners: list[Callable[[DrainResult], None]] = []
        self._saves = 0  # saves begun in this process: each level's ``every`` counts them
        #: The step the last load resumed from (None: no load in this process).
        self.resumed_from: int | None = None
        #: Steps newer than :attr:`resumed_from` that its load passed over (not every
        #: rank could restore them, or quarantined): a timeline that no longer exists,
        #: whose copies the resumed run's saves of those steps replace, on every level.
        self.superseded: frozenset[int] = frozenset()
        # Steps newer than `resumed_from` some level holds that its load did not pass
        # over (the run chose an older step by its number): never replaced unasked.
        self._newer: frozenset[int] = frozenset()
        #: Managers using the ladder (``registry.release`` closes it after the last).
        self.holders = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"Ladder({[level.url for level in self.given]})"

    @property
    def first(self) -> Level:
        """The first level, ``{node}`` filled in for this rank."""
        return self.levels[0]

    # ------------------------------------------------------------------ saves

    def begin(
        self, step: int, due: Sequence[int] | None = None, reference: int | None = None
    ) -> SaveTicket:
        """A save of ``step`` starts (every rank, as DCP starts it): its ticket.

        ``due``: the higher levels it goes to (indices); None: each level whose
        ``every`` divides the number of saves of this level list so far.
        """
        with self._lock:
            self._saves += 1
            count = self._saves
        if due is None:
            due = [i for i in range(1, len(self.levels)) if count % self.levels[i].every == 0]
        due = self.check_due(due)
        self.holdings.decided(step, frozenset((0, *due)))
        return self.commits.begin(step, due, reference, count)

    def check_due(self, due: Sequence[int]) -> tuple[int, ...]:
        """``due`` as the sorted indices of higher levels (ConfigError naming the levels)."""
        bad = [
            i
            for i in due
            if isinstance(i, bool) or not isinstance(i, int) or not 0 < i < len(self.levels)
        ]
        if bad:
            raise ConfigError(
                f"due={list(due)!r}: {bad} are not indices of higher levels of "
                f"{describe(self.given)} (1 to {len(self.levels) - 1}; the first level takes "
                "every save)"
            )
        return tuple(sorted(set(due)))

    def follow_up(self) -> None:
        """Wait until every save begun so far is followed up. The calling thread's
        saves are over (its ``dcp.save`` calls have returned): one of them that got no
        outcome never will (``commits.py``); an async save's is waited for."""
        self.commits.abandon()
        self.commits.settle()

    def replaces(self, step: int) -> bool:
        """Whether a save of ``step`` replaces the committed copies of a timeline the last
        load passed over (see :attr:`superseded`)."""
        with self._lock:
            return step in self.superseded

    def newer_than_resumed(self, step: int) -> int | None:
        """The step the last load resumed from, when some level held ``step`` then and
        that load did not pass over it (the run chose an older step by its number);
        else None."""
        with self._lock:
            return self.resumed_from if step in self._newer else None

    def supersede(self, step: int) -> None:
        """A save of ``step`` replaces its copies on every level (``overwrite=True``).
        Every rank, as the save begins."""
        with self._lock:
            self.superseded = self.superseded | {step}
            self._newer = self._newer - {step}

    def record(self, ticket: SaveTicket) -> dict[str, Any]:
        """What the save's manifest keeps under :data:`LEVELS_KEY`."""
        return {"save": ticket.count, "due": [self.given[i].url for i in ticket.due]}

    def first_reference(self) -> tuple[int, StoredCheckpoint] | None:
        """The first level's step the next save codes its deltas against and its
        checkpoint, readable by every rank (None: save it whole). Collective.

        Only rank 0's node may hold its manifest (a node-local first level): rank 0
        sends it, and each node's lowest rank keeps a copy beside the step before any
        delta against it exists there (drains and loads find it on their own node).
        """
        self.follow_up()  # the saves before are in the delta history
        step = self.chains.reference(0)
        if step is None:
            return None
        driver = self.drivers[0]
        if _dist.world_size() == 1:
            return step, driver.checkpoint(step)

        def read() -> bytes | None:
            try:
                return driver.checkpoint(step).manifest_bytes()
            except (DcpMultilevelError, OSError) as e:
                logger.warning("dcp_multilevel: no delta against step %d: %s", step, e)
                return None

        data = _dist.rank0_decides(read)
        if data is None:
            return None
        self.loader.transfers.keep_manifest(step, data)
        return step, driver.checkpoint(step, manifest_bytes=data)

    def _decide(self, ticket: SaveTicket) -> dict[str, Any]:
        """Rank 0, after ``ticket``'s commit: which drains, what retention removes."""
        if ticket.quarantine is not None:  # before retention: it counts the step last
            self._quarantine(ticket)
        else:  # a step saved again, clean, over a quarantined one (a resumed run)
            self.holdings.cleared(ticket.step)
        decision = self.drains.decide(ticket.step, () if ticket.quarantine else ticket.due)
        try:
            removed = self.holdings.retain(0)
        except OSError as e:  # housekeeping: the save itself succeeded
            logger.warning("dcp_multilevel: retention on %s failed: %s", self.first.url, e)
            removed = []
        return {"drains": decision.to_json(), "removed": removed, "oldest": self.holdings.oldest}

    def _apply(self, ticket: SaveTicket, decision: dict[str, Any] | None) -> None:
        """Every rank, once ``ticket``'s outcome is known (in save order)."""
        if ticket.state == "failed":
            if ticket.reference_failed and ticket.reference is not None:
                # Every rank alike: the next save is whole, not coded against it again.
                self.chains.removed(0, [ticket.reference])
            return
        if decision is None:  # dropped: no outcome
            return
        if "error" in decision:
            logger.error(
                "dcp_multilevel: step %d is committed on %s, but no drain was started for it: %s",
                ticket.step,
                self.first.url,
                decision["error"],
            )
            return
        self.holdings.removed_on_first(decision["removed"], decision.get("oldest"))
        if ticket.quarantine is None:
            self.holdings.cleared(ticket.step)
        else:
            self._quarantine(ticket)
            logger.warning(
                "dcp_multilevel: step %d is quarantined on %s and goes to no other level: %s",
                ticket.step,
                self.first.url,
                ticket.quarantine,
            )
            return
        self.chains.stored(0, ticket.step, ticket.reference)
        ticket.sent = self.drains.submit(
            ticket.step,
            ticket.due,
            DrainDecision.from_json(decision["drains"]),
            ticket.committed_unix,
            supersedes=self.replaces(ticket.step),
        )
        with self._lock:  # saved again: a later save of the step replaces nothing unasked
            self.superseded = self.superseded - {ticket.step}
        logger.info(
            "dcp_multilevel: step %d committed on %s; draining to %s",
            ticket.step,
            self.first.url,
            ticket.sent.started or "no level",
        )

    def _quarantine(self, ticket: SaveTicket) -> None:
        """``ticket``'s step stays on the first level: due nowhere else (so the first
        level need not keep it for a drain), counted last by retention, and never
        in the delta history (no clean save is coded against it)."""
        self.holdings.decided(ticket.step, frozenset((0,)))
        self.holdings.quarantined([ticket.step])

    def quarantine_of(self, step: int) -> str | None:
        """Why the first level's copy of ``step`` is quarantined (its manifest says; the
        only level a quarantined step is on); None when it is clean, or not readable
        here (a step only higher levels hold was drained, so clean)."""
        try:
            manifest = self.drivers[0].checkpoint(step).manifest()
        except (DcpMultilevelError, OSError):
            return None
        return manifest.health.reason() if manifest.quarantined else None  # type: ignore[union-attr]

    # ------------------------------------------------------------------ loads

    def loaded(self, restore: Restore, views: Views) -> None:
        """After every rank loaded ``restore``'s step: the books learn what the levels
        hold, the due steps a crash left undrained are drained again, a replaced node's
        copies made again, the delta chains and the count of saves resumed. Collective."""
        for i in range(1, len(self.levels)):
            self.holdings.learned(i, views.everyone[0][i])
        superseded = {s for s in (*restore.unrestorable, *restore.passed_over) if s > restore.step}
        with self._lock:
            if restore.step == self.resumed_from:
                # The same step again, by its number (a state loaded in parts: the model
                # from "latest", then the optimizer): what the first load passed over
                # is still a timeline that no longer exists.
                superseded |= self.superseded
            newer = {s for s in views.candidates() if s > restore.step} - superseded
            self.resumed_from = restore.step
            self.superseded = frozenset(superseded)
            self._newer = frozenset(newer)
        if superseded:
            logger.warning(
                "dcp_multilevel: resumed from step %d; steps %s, passed over, are replaced "
                "when this run saves them",
                restore.step,
                sorted(superseded),
            )
        self._recall_quarantine(restore, views.everyone[0][0])
        # What is left of the steps no rank could restore (a timeline that no longer
        # exists) is treated as quarantined: retention counts it last (it must not
        # hold a slot of `keep` against the resumed run's steps), no drain takes it
        # and no save is coded against it, until the resumed run saves the step again.
        dead = [s for s in restore.unrestorable if s > restore.step]
        self.holdings.quarantined(dead)
        for step in dead:
            self.holdings.decided(step, frozenset((0,)))
        self.chains.removed(0, dead)
        record = self.loader.kept(restore, LEVELS_KEY)
        if isinstance(record, dict) and isinstance(record.get("save"), int):
            with self._lock:
                self._saves = max(self._saves, record["save"])
        # Newer steps were not restorable: their files are not all there to drain.
        view = {
            i: [s for s in steps if s <= restore.step] for i, steps in views.everyone[0].items()
        }
        self._recall_due(view)
        self.drains.resume(view)
        if not self.holdings.is_quarantined(restore.step):  # (never copied to other nodes)
            self.drains.reprotect(restore)
        self.chains.resume_from_levels(restore.step)
        # No save is coded against a quarantined step (the loaded one, if it is).
        self.chains.removed(0, [s for s in view[0] if self.holdings.is_quarantined(s)])

    def _recall_quarantine(self, restore: Restore, first: list[int]) -> None:
        """The first-level steps saved before a restart that are quarantined: those the
        load passed over, and the older ones their manifests say so of (rank 0 reads;
        every rank takes the same), so that retention counts them last. Collective."""
        older = [s for s in first if s < restore.step]

        def read() -> list[int]:
            return [s for s in older if self.quarantine_of(s) is not None]

        steps = [*restore.passed_over, *(_dist.rank0_decides(read) if older else [])]
        loaded = restore.manifest  # loaded all the same (by its number, or allowed)?
        if loaded is not None and decoded_manifest(loaded, f"step {restore.step}").quarantined:
            steps.append(restore.step)
        self.holdings.quarantined(steps)
        for step in steps:  # due nowhere: the first level need not keep them for a drain
            self.holdings.decided(step, frozenset((0,)))

    def _recall_due(self, view: dict[int, list[int]]) -> None:
        """The higher levels each first-level step newer than those levels' newest was due
        on, as its manifest recorded it (rank 0 reads; every rank takes the same), for the
        steps the books know nothing of (saved before a restart). Collective."""
        newest = min((max(view[i], default=-1) for i in range(1, len(self.levels))), default=-1)
        steps = [s for s in view[0] if s > newest]
        if not steps:
            return
        index = {level.url: i for i, level in enumerate(self.given)}

        def read() -> dict[int, list[int]]:
            out = {}
            for step in steps:
                try:
                    extra = self.drivers[0].checkpoint(step).manifest().extra
                except (DcpMultilevelError, OSError):
                    continue
                record = extra.get(LEVELS_KEY)
                if isinstance(record, dict) and isinstance(record.get("due"), list):
                    out[step] = [index[u] for u in record["due"] if u in index]
            return out

        for step, due in _dist.rank0_decides(read).items():
            if not self.holdings.is_quarantined(step):  # (due where it was saved for)
                self.holdings.decided(step, frozenset((0, *due)))

    # ------------------------------------------------------------------ drains

    def listen(self, listener: Callable[[DrainResult], None]) -> Callable[[], None]:
        """Call ``listener`` with every drain's outcome (from the thread that decided
        it); returns the call that stops it."""
        with self._lock:
            self._listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    def _drain_ended(self, result: DrainResult) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(result)

    def costs(self) -> tuple[dict[int, float], set[int]]:
        """The last drain's seconds per higher level, and the busy levels (schedules)."""
        return self.drains.costs()

    def wait(self) -> list[DrainResult]:
        """Wait until every save begun is followed up and every due drain has landed.

        A synchronous save of the calling thread that got no outcome is over (see
        ``commits.py``). Raises DrainError for the drains that failed since the last
        call; returns the newest outcomes.
        """
        self.follow_up()
        return self.drains.drainer.wait()

    def unfinished(self) -> list[str]:
        """What is left undone: saves with no outcome yet (for the exit's log)."""
        return [f"step {t.step} (no outcome yet from its save)" for t in self.commits.pending()]

    def close(self) -> None:
        """Stop the follower and the lanes (call :meth:`wait` first for errors)."""
        self.closed = True
        self.commits.close()
        self.drains.drainer.close()

"""One level list, bound in this process: :class:`Runtime`.

Every :class:`~dcp_multilevel.MultiLevelWriter` and
:class:`~dcp_multilevel.MultiLevelReader` given the same ``levels`` (and the
:class:`~dcp_multilevel.CheckpointManager` over them) uses one runtime of the
process, whatever the number of writers a training stack
builds: one view of what each level holds, one lane of drains per level. It
composes the parts, each owning one thing:

- :class:`Binding` (here): the levels checked, their drivers bound, the topology;
- ``follower.py``: what follows each save's commit, on every rank, in order;
- ``dispatch.py``: which drains a save starts, after a restart, after a restore;
  ``lanes.py`` runs them;
- ``books.py``: what each level holds, and the retention that follows;
- ``deltas.py``: the delta histories;
- ``restore.py``: loads through the levels, a lost node's files back first.

Call order (every rank; the reader's and writer's calls, see ``plugin/``)::

    runtime = runtime_for(levels)                  collective
    ref = runtime.first_reference()               a writer of a first level with deltas
    ticket = runtime.begin(step, due)             as DCP starts a save (any thread)
    ... write_data, finish: the ticket's outcome (follower.py) ...
    restore = runtime.restorer.choose(views, step)  a reader's read_metadata, collective
    runtime.loaded(restore, views)                after every rank read it, collective
    runtime.wait()                                every due drain landed (DrainError)

**Binding** (:class:`Binding`): a level list, checked and bound: which node each rank
is on, each level's driver, the group restores move bytes over.

Call order (construction, every rank, collective)::

    binding = Binding.build(levels, topology, timeout_s)
    binding.sweep(older_than_s)     crash leftovers on every level

**The process's runtimes** (:func:`runtime_for`): one per level list, shared by every
writer and reader.

Training stacks build a new writer for each save; the drains of a level list
must outlive them. :func:`runtime_for` returns the process's runtime for a
level list, binding it the first time (collective), so writers and readers
given the same levels share its drains and its view of what each level
holds. A process keeps one level list per first level: another list under
the same first root (while a runtime over it is in use) is a
:class:`~dcp_multilevel.ConfigError`, as are lists that differ between
ranks (but for the paths of each node's own disk, a first level's or a
node-local kind's, which each node may spell its own way, and the stores'
options).

:func:`wait` waits for every runtime's due drains (``dcp_multilevel.wait()``);
at interpreter exit the same is done for whatever is left, and what could not
be finished is logged by step and level. A runtime lives until the process
exits, or until the last :class:`~dcp_multilevel.CheckpointManager` over it
is closed (:func:`release`).

Call order (every rank, main thread, the same calls in the same order)::

    runtime = runtime_for(levels, topology=...)   each writer, reader or manager: collective
    wait()                                      any time; again at exit
    release(runtime)                             a manager's close
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint, decoded_manifest
from ..errors import TIMEOUT_ENV, ConfigError, DcpMultilevelError, DrainError, timeout_s
from ..stores.location import parse_location
from .base import LEVEL_KINDS, DrainResult, LevelContext, LevelDriver
from .books import Books
from .config import PART_SHARE, Level, check_codec, describe, level_kind, root_of
from .deltas import DeltaHistory
from .dispatch import Dispatcher, DrainDecision
from .follower import Follower, SaveTicket
from .restore import Restore, Restorer, Transfers, Views, gather_views
from .store import StoreLevel
from .topology import NODE_FIELD, Topology, expand_node, node_from_env

__all__ = [
    "LEVELS_KEY",
    "TIMEOUT_ENV",
    "Binding",
    "Runtime",
    "newest_step",
    "release",
    "root_of",
    "runtime_for",
    "runtimes",
    "timeout_s",
    "wait",
]


logger = logging.getLogger(__name__)

#: The manifest's ``extra`` key under which each save keeps what the runtime decided:
#: ``{"save": n, "due": [level URLs]}`` (the n-th save of the level list; the higher
#: levels it was due on, as the user wrote them). A restart goes on from there.
LEVELS_KEY = "dcp_multilevel.levels"


class Runtime:
    """One level list, bound in this process (see the module docstring).

    Args:
        given: the levels as the user passed them (``{node}`` kept).
        binding: the same levels checked and bound (``Binding.build``, collective).
        key: what the registry knows the runtime by (see ``registry.py``).
        instance: numbers the runtime's values in the c10d store: runtimes are made
            collectively, in the same order on every rank, so the same everywhere.
        policy, timeout_s: the drains' (``levels/lanes.py``).
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
        self.deltas = DeltaHistory(self.levels, self.drivers)
        self.books = Books(self.levels, self.drivers, None, self.deltas, self.topology)
        self.dispatcher = Dispatcher(
            self.levels,
            self.drivers,
            self.deltas,
            self.books,
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
            self.dispatcher.lanes,
            part_share,
        )
        self.restorer = Restorer(transfers)
        self.follower = Follower(
            f"L{instance}", timeout_s, self._decide, self._apply, name=describe(self.given)
        )
        self.books.spare(self.dispatcher.lanes, lambda: {t.step for t in self.follower.pending()})
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
        # Managers using the runtime (:func:`release` closes it after the last). Only
        # under the table's `_LOCK`: a manager dropped without close() releases from
        # its finalizer, on whatever thread collects it, while another manager holds.
        self._holders = 0
        self.closed = False

    def hold(self) -> None:
        """A manager uses this runtime until it calls :func:`release`."""
        with _LOCK:
            self._holders += 1

    def __repr__(self) -> str:
        return f"Runtime({[level.url for level in self.given]})"

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
        self.books.decided(step, frozenset((0, *due)))
        return self.follower.begin(step, due, reference, count)

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
        self.follower.abandon()
        self.follower.settle()

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
        step = self.deltas.reference(0)
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
        self.restorer.transfers.keep_manifest(step, data)
        return step, driver.checkpoint(step, manifest_bytes=data)

    def _decide(self, ticket: SaveTicket) -> dict[str, Any]:
        """Rank 0, after ``ticket``'s commit: which drains, what retention removes."""
        if ticket.quarantine is not None:  # before retention: it counts the step last
            self._quarantine(ticket)
        else:  # a step saved again, clean, over a quarantined one (a resumed run)
            self.books.cleared(ticket.step)
        decision = self.dispatcher.decide(ticket.step, () if ticket.quarantine else ticket.due)
        try:
            removed = self.books.retain(0)
        except OSError as e:  # housekeeping: the save itself succeeded
            logger.warning("dcp_multilevel: retention on %s failed: %s", self.first.url, e)
            removed = []
        return {"drains": decision.to_json(), "removed": removed, "oldest": self.books.oldest}

    def _apply(self, ticket: SaveTicket, decision: dict[str, Any] | None) -> None:
        """Every rank, once ``ticket``'s outcome is known (in save order)."""
        if ticket.state == "failed":
            if ticket.reference_failed and ticket.reference is not None:
                # Every rank alike: the next save is whole, not coded against it again.
                self.deltas.removed(0, [ticket.reference])
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
        self.books.removed_on_first(decision["removed"], decision.get("oldest"))
        if ticket.quarantine is None:
            self.books.cleared(ticket.step)
        else:
            self._quarantine(ticket)
            logger.warning(
                "dcp_multilevel: step %d is quarantined on %s and goes to no other level: %s",
                ticket.step,
                self.first.url,
                ticket.quarantine,
            )
            return
        self.deltas.stored(0, ticket.step, ticket.reference)
        ticket.sent = self.dispatcher.submit(
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
        self.books.decided(ticket.step, frozenset((0,)))
        self.books.quarantined([ticket.step])

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
            self.books.learned(i, views.everyone[0][i])
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
        self.books.quarantined(dead)
        for step in dead:
            self.books.decided(step, frozenset((0,)))
        self.deltas.removed(0, dead)
        record = self.restorer.kept(restore, LEVELS_KEY)
        if isinstance(record, dict) and isinstance(record.get("save"), int):
            with self._lock:
                self._saves = max(self._saves, record["save"])
        # Newer steps were not restorable: their files are not all there to drain.
        view = {
            i: [s for s in steps if s <= restore.step] for i, steps in views.everyone[0].items()
        }
        self._recall_due(view)
        self.dispatcher.resume(view)
        if not self.books.is_quarantined(restore.step):  # (never copied to other nodes)
            self.dispatcher.reprotect(restore)
        self.deltas.resume_from_levels(restore.step)
        # No save is coded against a quarantined step (the loaded one, if it is).
        self.deltas.removed(0, [s for s in view[0] if self.books.is_quarantined(s)])

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
        self.books.quarantined(steps)
        for step in steps:  # due nowhere: the first level need not keep them for a drain
            self.books.decided(step, frozenset((0,)))

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
            if not self.books.is_quarantined(step):  # (due where it was saved for)
                self.books.decided(step, frozenset((0, *due)))

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
        return self.dispatcher.costs()

    def wait(self) -> list[DrainResult]:
        """Wait until every save begun is followed up and every due drain has landed.

        A synchronous save of the calling thread that got no outcome is over (see
        ``commits.py``). Raises DrainError for the drains that failed since the last
        call; returns the newest outcomes.
        """
        self.follow_up()
        return self.dispatcher.lanes.wait()

    def unfinished(self) -> list[str]:
        """What is left undone: saves with no outcome yet (for the exit's log)."""
        return [f"step {t.step} (no outcome yet from its save)" for t in self.follower.pending()]

    def close(self) -> None:
        """Stop the follower and the lanes (call :meth:`wait` first for errors)."""
        self.closed = True
        self.follower.close()
        self.dispatcher.lanes.close()


@dataclass(frozen=True)
class Binding:
    """The levels of one runtime, fastest first, ready to use."""

    levels: list[Level]  # {node} replaced by this rank's node
    names: list[str]  # the levels as the user wrote them ({node} kept)
    drivers: list[LevelDriver]
    topology: Topology | None  # given, or gathered when a level needs it
    restore_group: Any  # the gloo group restores use (None: no level between nodes)

    @classmethod
    def build(
        cls,
        levels: Sequence[Level],
        topology: Topology | None,
        timeout_s: float,
    ) -> Binding:
        """Check the levels and bind their drivers (collective: every rank).

        Raises:
            ConfigError: what is wrong with the levels, and what to change.
        """
        given = list(levels)  # checked by runtime_for
        # The levels' kinds (name, driver class); store levels have none. {node}
        # does not change a kind.
        kinds = [(k, LEVEL_KINDS.get(k)) for k in map(level_kind, given) if k is not None]
        needs_nodes = any(NODE_FIELD in level.url for level in given) or any(
            kind.needs_topology for _, kind in kinds
        )
        if topology is None and needs_nodes:  # gathered from every rank's environment
            topology = Topology(tuple(_dist.all_gather_object(node_from_env())))
        for level in given:  # a codec (un)registered since the Level was made
            check_codec(level)
        _check_roots(given, topology)
        placed = list(given)
        if topology is not None:
            if topology.world_size != _dist.world_size():
                raise ConfigError(
                    f"the topology names {topology.world_size} ranks, the process group "
                    f"has {_dist.world_size()}"
                )
            placed = [_on_node(level, topology.nodes[_dist.rank()]) for level in given]
        first = placed[0]
        node_kinds = [name for name, kind in kinds if kind.node_local]
        if node_kinds and parse_location(first.url).scheme != "file":
            raise ConfigError(
                f"the first level ({first.url}) must be a path on each node's own disk "
                f"when a level keeps copies between nodes ({', '.join(node_kinds)}): those "
                "levels protect node-local checkpoints, and restore into that path"
            )
        if level_kind(first) is not None:
            raise ConfigError(
                f"the first level ({first.url}) must be a store (a path or URL): "
                "save() writes each checkpoint there, and the other levels start from it"
            )
        _check_deltas(placed)
        drivers = [driver_for(level) for level in placed]
        context = LevelContext(topology, timeout_s)
        for driver in drivers:
            driver.bind(context)  # collective: node-local kinds make their groups here
        # Restores move files between nodes over a group of their own (never a
        # drain's: a drain may be running in its thread while the main thread loads).
        group = _dist.new_group(timeout_s) if any(d.node_local for d in drivers) else None
        return cls(placed, [level.url for level in given], drivers, topology, group)

    def survives(self) -> list[str]:
        """What each level survives, for the schedule: the first level, a node, a store."""
        return ["first"] + ["node" if d.node_local else "store" for d in self.drivers[1:]]

    def sweep(self, older_than_s: float) -> None:
        """Remove crash leftovers older than ``older_than_s`` from every level."""
        for driver in self.drivers:
            try:
                driver.sweep(older_than_s)
            except OSError as e:  # housekeeping: never stops a run from starting
                logger.warning("dcp_multilevel: sweeping %s failed: %s", driver.url, e)


def _on_node(level: Level, node: int) -> Level:
    """``level`` with ``{node}`` in its path replaced (a plain Level: no second warning)."""
    if NODE_FIELD not in level.url:
        return level
    values = {f.name: getattr(level, f.name) for f in dataclasses.fields(Level)}
    return Level(**{**values, "url": expand_node(level.url, node)})


def _inside(outer: str, inner: str) -> bool:
    """Whether normalized path ``inner`` is ``outer`` or below it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _check_roots(levels: Sequence[Level], topology: Topology | None) -> None:
    """No level's root is another's or inside it (ConfigError naming both levels).

    Two levels in one place would see each other's checkpoints: retention,
    crash sweeps and loads of one would count, delete or read the other's.
    ``{node}`` paths are compared as each node's ranks expand them, for every
    node of the topology: ``/nvme/{node}/ckpt`` and ``partner:/nvme/{node}/copies``
    never meet; ``/nvme/{node}/ckpt`` and ``/nvme/0/ckpt`` do on node 0.
    """
    nodes = sorted(set(topology.nodes)) if topology is not None else [None]
    for node in nodes:
        urls = [lv.url if node is None else expand_node(lv.url, node) for lv in levels]
        roots = [root_of(url, level_kind(lv)) for url, lv in zip(urls, levels, strict=True)]
        for i, root_i in enumerate(roots):
            for j in range(i + 1, len(roots)):
                root_j = roots[j]
                if root_i is None or root_j is None or root_i[0] != root_j[0]:
                    continue
                path_i, path_j = root_i[1], root_j[1]
                templated = NODE_FIELD in levels[i].url or NODE_FIELD in levels[j].url
                on = f" on node {node}" if templated else ""
                first, second = f"{i} ({levels[i].url!r})", f"{j} ({levels[j].url!r})"
                if path_i == path_j:
                    what = f"levels {first} and {second} are the same location{on} ({urls[j]})"
                elif _inside(path_i, path_j):
                    what = f"level {second} is inside level {first}{on} ({urls[j]} is in {urls[i]})"
                elif _inside(path_j, path_i):
                    what = f"level {first} is inside level {second}{on} ({urls[i]} is in {urls[j]})"
                else:
                    continue
                raise ConfigError(
                    f"{what}: each level needs a root of its own, outside the others' (a "
                    "level's retention, crash sweeps and loads would see the other's "
                    "checkpoints)"
                )


def _check_deltas(levels: Sequence[Level]) -> None:
    """Deltas are for store levels (a level between nodes copies the first level's as
    they are, with their references)."""
    for level in levels:
        if level.deltas and level_kind(level) is not None:
            raise ConfigError(
                f"Level({level.url!r}, keyframe_every={level.keyframe_every}): deltas are stored "
                "on store levels (a path or URL); a level between nodes copies the first "
                "level's files as they are"
            )


#: Numbers the runtimes of this process (made collectively: the same number on every rank).
_INSTANCES = itertools.count()
# The race: two threads of one process asking for runtimes at once (a main thread
# and an exit hook); the runtimes themselves are made on the main thread.
_LOCK = threading.Lock()
_RUNTIMES: dict[Any, Runtime] = {}  # first level's root -> its runtime
_EXIT_HOOK: list[bool] = []  # [True] once the exit hook is registered

#: The options a runtime is made with when none are given (``timeout_s``: :func:`timeout_s`).
DEFAULTS = {"drain_policy": "latest", "part_share": PART_SHARE}


def runtime_for(
    levels: Sequence[Level] | None,
    *,
    topology: Topology | None = None,
    who: str = "MultiLevelWriter",
    **options: Any,
) -> Runtime:
    """This process's runtime for ``levels``, bound the first time. Collective.

    ``options`` (``drain_policy``, ``timeout_s``, ``part_share``) apply when the
    runtime is made; given for one that exists, they must match it. ``who``
    names the caller in messages.

    Raises:
        ConfigError: a bad level list; lists that differ between ranks (each rank's
            named); another list under the same first root in this process; options
            that differ from the runtime's.
    """
    given = _levels_argument(levels, who)
    key = _identity(given, topology)
    root = root_of(given[0].url, level_kind(given[0]))
    with _LOCK:
        existing = _RUNTIMES.get(root)
    state = "new" if existing is None else ("same" if existing.key == key else "changed")
    # First, before anything that could go another way on another rank.
    everyone = _dist.all_gather_object(
        (_digest(_identity(given, topology, per_node=True)), state, describe(given))
    )
    if len({digest for digest, _, _ in everyone}) > 1:
        raise ConfigError(
            f"{who}(levels=...): the level lists differ between ranks; every rank must pass "
            "the same levels: "
            + "; ".join(f"rank {r}: {d}" for r, (_, _, d) in enumerate(everyone))
        )
    if any(s == "changed" for _, s, _ in everyone):
        old = describe(existing.given) if existing is not None else "another list"
        raise ConfigError(
            f"{who}(levels={describe(given)}): this process saves under the first level "
            f"{given[0].url!r} with the levels {old}; a process keeps one level list per first "
            "level (its drains and retention follow that list). Pass the same levels, or "
            "close the CheckpointManager using the others first"
        )
    if len({s for _, s, _ in everyone}) > 1:
        raise ConfigError(
            f"{who}(levels={describe(given)}): some ranks have these levels in use and others "
            "not ("
            + ", ".join(f"rank {r}: {s}" for r, (_, s, _) in enumerate(everyone))
            + "); build writers, readers and managers in the same order on every rank"
        )
    settings = {
        **DEFAULTS,
        "timeout_s": timeout_s(),
        **{k: v for k, v in options.items() if v is not None},
    }
    if existing is not None:
        _check_options(existing, settings, options, who)
        return existing
    binding = Binding.build(given, topology, settings["timeout_s"])  # collective
    runtime = Runtime(
        given,
        binding,
        key=key,
        instance=next(_INSTANCES),
        policy=settings["drain_policy"],
        timeout_s=settings["timeout_s"],
        part_share=settings["part_share"],
    )
    with _LOCK:
        _RUNTIMES[root] = runtime
        _hook_exit()
    return runtime


def runtimes() -> list[Runtime]:
    """The runtimes of this process, in the order they were made."""
    with _LOCK:
        return list(_RUNTIMES.values())


def wait() -> list[DrainResult]:
    """:func:`dcp_multilevel.levels.wait`, once this module is loaded."""
    results: list[DrainResult] = []
    errors: list[str] = []
    for runtime in runtimes():
        try:
            results.extend(runtime.wait())
        except DrainError as e:
            errors.append(str(e))
    if errors:
        raise DrainError(" ".join(errors))
    return results


def newest_step(levels: Sequence[Level], *, topology: Topology | None = None) -> int | None:
    """:func:`dcp_multilevel.levels.newest_step` (collective)."""
    runtime = runtime_for(levels, topology=topology, who="newest_step")
    runtime.follow_up()  # the saves of this process are listed
    candidates = gather_views(runtime.drivers).candidates()
    return candidates[-1] if candidates else None


def release(runtime: Runtime, *, quiet: bool = False) -> None:
    """A manager is done with ``runtime``: after the last one, wait for its drains and
    forget it, so another level list may use its first root.

    Raises:
        DrainError: drains that failed since the last wait (``quiet``: logged instead,
            for a manager collected without ``close()``).
    """
    with _LOCK:
        runtime._holders -= 1
        if runtime._holders > 0 or runtime.closed:
            return
        for root, known in list(_RUNTIMES.items()):
            if known is runtime:
                del _RUNTIMES[root]
    try:
        runtime.wait()
    except DrainError as e:
        if not quiet:
            raise
        logger.error("dcp_multilevel: checkpoint drains had failed: %s", e)
    finally:
        runtime.close()


def _finish_at_exit() -> None:
    """At interpreter exit: finish every runtime's due drains, and log by step and level
    whatever did not reach its level."""
    with _LOCK:
        remaining = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    for runtime in remaining:
        try:
            runtime.wait()
        except DrainError as e:
            logger.error("dcp_multilevel: at exit, checkpoints did not reach their levels: %s", e)
        except Exception as e:  # noqa: BLE001 - the exit must go on to the other runtimes
            logger.error(
                "dcp_multilevel: at exit, %r could not finish: %s: %s  (left: %s)",
                runtime,
                type(e).__name__,
                e,
                runtime.unfinished(),
            )
        finally:
            runtime.close()


def _hook_exit() -> None:
    """Under the lock: run :func:`_finish_at_exit` at interpreter exit, once.

    Registered with threading's exit hooks where Python has them: those run
    before concurrent.futures refuses new work at shutdown (hooks run newest
    first), which a drain still running then needs; atexit runs after it.
    """
    if not _EXIT_HOOK:
        getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)
        _EXIT_HOOK.append(True)


def _levels_argument(levels: Sequence[Level] | None, who: str) -> list[Level]:
    out = list(levels or ())
    if not out or not all(isinstance(level, Level) for level in out):
        raise ConfigError(
            f"{who}(levels=...) needs a non-empty list of dcp_multilevel.Level(...) objects, "
            f"got {levels!r}"
        )
    return out


def _identity(levels: Sequence[Level], topology: Topology | None, per_node: bool = False) -> str:
    """The levels and topology as canonical JSON (values JSON cannot hold by their type:
    an object in ``storage_options`` is the same on every rank only by its type).

    ``per_node``: leave out what may differ between nodes (what ranks compare): the
    paths of each node's own disk, a first level's local path or a node-local kind's,
    and the stores' options (a node's own endpoint, credentials, spool directory).
    """

    def plain(value: Any) -> Any:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"

    docs = [asdict(level) for level in levels]
    if per_node:
        for i, (doc, level) in enumerate(zip(docs, levels, strict=True)):
            doc.pop("storage_options")
            kind = level_kind(level)
            local = kind is None and i == 0 and parse_location(level.url).scheme == "file"
            if local or (kind is not None and LEVEL_KINDS.get(kind).node_local):
                doc["url"] = f"<this node's: {kind or 'path'}>"
    doc = {
        "levels": docs,
        "topology": list(topology.nodes) if topology is not None else None,
    }
    return json.dumps(doc, sort_keys=True, default=plain)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _check_options(
    runtime: Runtime, settings: dict[str, Any], given: dict[str, Any], who: str
) -> None:
    """Options given for a runtime that exists must be the ones it was made with."""
    have = {
        "drain_policy": runtime.policy,
        "timeout_s": runtime.timeout_s,
        "part_share": runtime.part_share,
    }
    differ = {
        k: (have[k], settings[k])
        for k in have
        if given.get(k) is not None and have[k] != settings[k]
    }
    if differ:
        raise ConfigError(
            f"{who}: the levels {describe(runtime.given)} are in use in this process with "
            + ", ".join(f"{k}={old!r}" for k, (old, _) in differ.items())
            + "; asked for "
            + ", ".join(f"{k}={new!r}" for k, (_, new) in differ.items())
        )


def driver_for(level: Level) -> LevelDriver:
    """The driver of ``level``: its registered kind's, or a :class:`StoreLevel`.

    Raises:
        RegistryError: the level names a kind that is not installed.
    """
    kind = level_kind(level)
    if kind is None:
        return StoreLevel(level)
    return LEVEL_KINDS.get(kind)(level)

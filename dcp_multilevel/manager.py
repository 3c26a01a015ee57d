"""CheckpointManager: multi-level saves, the newest complete checkpoint, retention.

Call order (every rank, main thread; the same steps on every rank)::

    mgr = CheckpointManager([Level(local, every=1, keep=2), Level(remote, every=4)])
    step = mgr.load_latest(state_dict)   # None on a fresh start; resumes drains left behind
    mgr.step(state_dict, step=s, loss=l)  # each training step: saves when the schedule
                                          # says so (the same decision on every rank)
    mgr.save(state_dict, step=s)          # or save explicitly: returns once the first
                                          # level committed;
                                          # due higher levels are drained in the background
    mgr.wait()                            # drains done; DrainError if one failed
    mgr.close()                           # also run at interpreter exit (errors logged)

The manager composes the parts, each in its own place: levels and their
drivers (``levels/``: who sends which bytes where, drains, the collective
agreement on what to load, restores), the save-decision policy
(``schedule/``) and when ``step`` asks it (``cadence.py``), the load path
(``loading.py``), the retention rules (``retention.py``), stored
checkpoints (``checkpoint/``).

A checkpoint exists on a level iff its manifest there exists. The first
level may be node-local: then only rank 0's node has the manifest, and
loading agrees on the newest step every rank can read (``levels/agreement.py``);
each rank then reads its files from the first level and the rest, file by
file, from the higher levels.

Retention runs on rank 0: for the first level after each save (local listing
only; the other ranks then remove the same steps from their own view), for a
higher level in its drain worker after each commit there, so a slow or
unreachable remote never stalls ``save``. At construction, temporary files of
crashed writers older than ``sweep_older_than_s`` go too.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import signal
import statistics
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from . import _dist, retention
from .cadence import Cadence
from .checkpoint import StoredCheckpoint, decoded_manifest
from .config import Level
from .deltas import DeltaChains
from .errors import (
    BrokenChainError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpMultilevelError,
    DrainError,
)
from .levels import (
    LEVEL_KINDS,
    Drainer,
    DrainJob,
    DrainResult,
    LevelDriver,
    driver_for,
    level_kind,
)
from .levels.agreement import Restore, Views, gather_views
from .levels.base import LevelContext
from .levels.node_local import rank_files
from .levels.restore import RestoreReport
from .levels.topology import NODE_FIELD, Topology, expand_node, node_from_env
from .loading import Loader
from .metrics import MetricsSink, SaveMetrics
from .planner import BalancedSavePlanner
from .schedule import FixedInterval, SavePolicy
from .stores.location import parse_location
from .writer import MultiLevelWriter

__all__ = ["CheckpointManager", "SaveMetrics"]

#: The manifest's ``extra`` key under which each save keeps the schedule's state
#: (``cadence.py``: the job's clock, each level's last save, the policy's).
SCHEDULE_KEY = "dcp_multilevel.schedule"

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves to several levels with their own intervals and retention; loads the newest.

    Args:
        levels: fastest first. The first takes every :meth:`save` (its ``every``
            paces :meth:`step`) and must be a store level (``save`` writes there). It may be
            node-local (each node sees only its own ranks' files; only rank
            0's node has the manifest): drains and loads work, provided a
            higher level holds what a node cannot see.
        tiers: deprecated name of ``levels`` (warns; removed in 0.3).
        topology: which node each rank is on (``levels/topology.py``); default:
            from each rank's environment (``DCP_ML_NODE``, torchrun's
            ``GROUP_RANK``, ...), gathered when a level's path holds
            ``{node}``, which is then replaced by this rank's node index
            (``Level("/nvme/{node}/run")``: one directory per simulated node).
        schedule: which levels take each save (default
            :class:`~dcp_multilevel.schedule.FixedInterval`: each level's ``every``;
            ``Schedule.auto(mtbf_hours=...)``: measured, failure- and
            convergence-aware intervals, for :meth:`step`).
        planner: save planner (default: one :class:`BalancedSavePlanner`, reused
            so DCP's plan cache works across saves).
        drain_policy: what a save due on a level whose previous drain is still
            running does there (``levels/drainer.py``): ``"latest"`` (default) waits
            in that level's one slot, where a newer due step replaces it, so the
            newest due step always reaches the level and :meth:`wait` covers it;
            ``"skip"`` is not sent there; ``"wait"`` blocks :meth:`save` until the
            level is free.
        drain_timeout_s: how long a drain's ranks wait for each other.
        metrics_path: append every save's and drain's metrics record to this
            JSON-lines file (see ``metrics.py``; ``{rank}`` in the path gives each
            rank its own file, otherwise only rank 0 writes).
        on_metrics: called with every metrics record (a dict) on every rank;
            drain records arrive from the drain's background thread.
        save_on_sigterm: on SIGTERM, :meth:`step` saves the current step to the
            first level on every rank, then exits (``cadence.py``); the handler
            is restored by :meth:`close`.
        check_seconds: at most this much training time between two of
            :meth:`step`'s agreements across ranks (adaptive schedules, SIGTERM).
        sweep_older_than_s: at construction, temporary files older than this
            (crash leftovers: the first level's ``*.tmp-*``, remote stores' spool
            files of dead processes) are removed; None: no sweep.
    """

    def __init__(
        self,
        levels: Sequence[Level] | None = None,
        *,
        tiers: Sequence[Level] | None = None,
        topology: Topology | None = None,
        schedule: SavePolicy | None = None,
        planner: SavePlanner | None = None,
        drain_policy: str = "latest",
        drain_timeout_s: float = 3600.0,
        metrics_path: str | None = None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
        sweep_older_than_s: float | None = 3600.0,
        save_on_sigterm: bool = False,
        check_seconds: float = 10.0,
    ) -> None:
        self.levels = _levels_argument(levels, tiers)
        self._names = [level.url for level in self.levels]  # as written ({node} kept)
        # The levels' kinds (name, driver class); store levels have none. {node}
        # does not change a kind.
        kinds = [(k, LEVEL_KINDS.get(k)) for k in map(level_kind, self.levels) if k is not None]
        needs_nodes = any(NODE_FIELD in level.url for level in self.levels) or any(
            cls.needs_topology for _, cls in kinds
        )
        #: Which node each rank is on: given, or gathered from every rank's
        #: environment (collective) when a level's path names ``{node}``.
        self.topology = topology
        if topology is None and needs_nodes:
            self.topology = Topology(tuple(_dist.all_gather_object(node_from_env())))
        if self.topology is not None:
            if self.topology.world_size != _dist.world_size():
                raise ConfigError(
                    f"the topology names {self.topology.world_size} ranks, the process group "
                    f"has {_dist.world_size()}"
                )
            node = self.topology.nodes[_dist.rank()]
            self.levels = [_on_node(level, node) for level in self.levels]
        node_kinds = [name for name, cls in kinds if cls.node_local]
        if node_kinds and parse_location(self.levels[0].url).scheme != "file":
            raise ConfigError(
                f"the first level ({self.levels[0].url}) must be a path on each node's own disk "
                f"when a level keeps copies between nodes ({', '.join(node_kinds)}): those "
                "levels protect node-local checkpoints, and restore into that path"
            )
        if level_kind(self.levels[0]) is not None:
            raise ConfigError(
                f"the first level ({self.levels[0].url}) must be a store (a path or URL): "
                "save() writes each checkpoint there, and the other levels start from it"
            )
        _check_deltas(self.levels)
        self.drivers: list[LevelDriver] = [driver_for(level) for level in self.levels]
        context = LevelContext(self.topology, drain_timeout_s)
        for driver in self.drivers:
            driver.bind(context)  # collective: node-local kinds make their groups here
        # Restores move files between nodes over a group of their own (never a
        # drain's: a drain may be running in its thread while the main thread loads).
        self._restore_group = None
        if any(d.node_local for d in self.drivers):
            self._restore_group = _dist.new_group(drain_timeout_s)
        self.schedule = schedule if schedule is not None else FixedInterval()
        survives = ["first"] + ["node" if d.node_local else "store" for d in self.drivers[1:]]
        self._cadence = Cadence(self.schedule, self.levels, survives,
                                check_seconds=check_seconds,
                                save_on_sigterm=save_on_sigterm)  # fmt: skip
        # step -> the levels a decision sent it to (adaptive policies cannot be
        # asked again about a past step; retention and resumed drains look here).
        self._decided: dict[int, frozenset[int]] = {}
        self._planner = planner or BalancedSavePlanner()
        self._chains = DeltaChains(self.levels, self.drivers)
        self._sink = MetricsSink(metrics_path, on_metrics, _dist.rank())
        # Drain ids key values in the c10d store that every manager of the process
        # group shares: a second manager must not read the first one's. Managers are
        # built collectively, in the same order on every rank: the same number.
        self._instance = next(_INSTANCES)
        self._drainer = Drainer(
            policy=drain_policy, timeout_s=drain_timeout_s, on_committed=self._drained,
            on_result=self._drain_ended, key=f"m{self._instance}",
        )  # fmt: skip
        n = len(self.levels)
        # Steps known to be committed on each higher level (from drains and from
        # load_latest's listing): first-level retention consults this, never the
        # remote itself, so a slow or unreachable remote cannot stall save().
        # Steps skipped or superseded there need no protection on the first level.
        # Lane threads add to both (after a commit; when a newer step supersedes a
        # waiting one) while the main thread's retention reads them: `_books` guards
        # them and `_decided`. Never held during I/O or while waiting for a drain
        # (a lane's callback would wait for it, and save() behind the lane).
        self._books = threading.Lock()
        self._known: dict[int, set[int]] = {i: set() for i in range(n)}
        self._skipped: dict[int, set[int]] = {i: set() for i in range(n)}
        self._generation = 0
        self.metrics: list[SaveMetrics] = []
        self._loader = Loader(self.drivers, self._names, self.topology, self._restore_group,
                              self._drainer)  # fmt: skip
        if sweep_older_than_s is not None:
            for driver in self.drivers:
                try:
                    driver.sweep(sweep_older_than_s)
                except OSError as e:  # housekeeping: never stops a run from starting
                    logger.warning("dcp_multilevel: sweeping %s failed: %s", driver.url, e)
        # Drains must not be lost silently at exit: wait for them and log failures.
        # Registered with threading's exit hooks where Python has them: those run
        # before concurrent.futures refuses new work at shutdown (hooks run newest
        # first), which a drain still running then needs; atexit runs after it.
        self._exit_hook = weakref.finalize(self, _finish_at_exit, self._drainer)
        self._exit_hook.atexit = False
        getattr(threading, "_register_atexit", atexit.register)(self._exit_hook)

    def _due(self, index: int, step: int) -> bool:
        if step in self._decided:
            return index in self._decided[step]
        try:
            return self.schedule.due(index, self.levels[index], step)
        except NotImplementedError:  # an adaptive policy: only its recorded decisions count
            return False

    # ------------------------------------------------------------------ save

    def step(
        self, state_dict: dict[str, Any], step: int, *, loss: float | None = None
    ) -> SaveMetrics | None:
        """The training loop's hook: save ``step`` to the levels the schedule says are due.

        Call it after every training step, on every rank (collective at the
        schedule's check steps, see ``cadence.py``). ``loss``: the step's loss
        (a convergence-aware schedule reads rank 0's). Returns the save's
        metrics, or None when nothing was saved. With ``save_on_sigterm``,
        after a SIGTERM on any rank: saves ``step`` to the first level, waits
        for its commit, and raises ``SystemExit(143)`` on every rank.
        """
        _check_step(step)
        tick = self._cadence.tick(step, loss, self._costs)
        try:
            if tick.stop:
                self._save(state_dict, step, [])
                self._cadence.saved(step, [0])
                self._sink.emit({"kind": "sigterm", "rank": _dist.rank(), "step": step,
                                 "unix": time.time()})  # fmt: skip
                logger.warning("dcp_multilevel: step %d committed after SIGTERM; exiting", step)
                self._cadence.close()
                raise SystemExit(128 + signal.SIGTERM)
            if tick.decision is None:
                return None
            with self._books:
                self._decided[step] = tick.decision.levels
            self._sink.emit({**tick.decision.record(), "step": step, "rank": _dist.rank(),
                             "unix": time.time()})  # fmt: skip
            higher = sorted(i for i in tick.decision.levels if i > 0)
            metrics = self._save(state_dict, step, higher)
            started = [i for i in higher if self.levels[i].url in metrics.drains_started]
            self._cadence.saved(step, [0, *started])
            return metrics
        finally:
            self._cadence.stepped()

    def _costs(self) -> tuple[float | None, dict[int, float], set[int]]:
        """This rank's measured costs: the first level's blocked seconds per save (median
        of the last five), each higher level's last committed drain's seconds, and the
        levels a drain is running to."""
        recent = [m.blocked_seconds + m.waited_seconds for m in self.metrics[-5:]]
        blocked = statistics.median(recent) if recent else None
        drains: dict[int, float] = {}
        index_of = {d.url: i for i, d in enumerate(self.drivers)}
        for result in reversed(self._drainer.results):  # the newest first
            index = index_of.get(result.level)
            if result.committed and index is not None and index not in drains:
                drains[index] = result.seconds
                if len(drains) == len(self.drivers) - 1:
                    break
        busy = {i for i, d in enumerate(self.drivers) if i > 0 and self._drainer.busy(d)}
        return blocked, drains, busy

    def save(self, state_dict: dict[str, Any], step: int) -> SaveMetrics:
        """Save ``state_dict`` as ``step``; return once the first level has committed it.

        The first level takes every ``save`` (its ``every`` is for :meth:`step`);
        higher levels take it when the schedule says so. Collective (every rank,
        same step).
        """
        _check_step(step)
        return self._save(state_dict, step, [i for i in range(1, len(self.levels))
                                             if self._due(i, step)])  # fmt: skip

    def _save(self, state_dict: dict[str, Any], step: int, due: list[int]) -> SaveMetrics:
        first = self.levels[0]
        t0 = time.perf_counter()
        ref = self._chains.reference(0)
        reference = self._reference_checkpoint(ref)
        if reference is None:
            ref = None
        # Kept in the manifest (rank 0 writes it): a restart goes on with the schedule.
        extra = {SCHEDULE_KEY: self._cadence.state(step, [0, *due])} if _dist.rank() == 0 else None
        writer = self._first_save(state_dict, step, reference, extra)
        if writer is None:  # the reference failed while the save read it: save whole
            ref = None
            writer = self._first_save(state_dict, step, None, extra)
        self._chains.stored(0, step, ref)
        blocked = time.perf_counter() - t0
        committed = time.time()
        self._generation += 1
        metrics = SaveMetrics(step, first.url, writer.bytes_written, blocked)
        # Rank 0 decides which drains to skip (policy "skip", previous drain still
        # running) and applies first-level retention from its listing (its node
        # has the manifests); every rank follows: a drain needs every rank's
        # share, and a node-local first level holds every node's files apart.
        skip: list[int] = []
        removed: list[int] = []
        before: dict[int, list[int]] = {}
        if _dist.rank() == 0:
            policy = self._drainer.policy
            skip = [i for i in due if policy == "skip" and self._drainer.busy(self.drivers[i])]
            for i in due:
                if i not in skip:
                    if policy == "wait":  # retention then knows the outcome
                        self._drainer.finish(self.drivers[i])
                    before[i] = self._missing_references(i, step)
            removed = self._retain(0)  # local listing only; higher levels: after their drains
        if _dist.world_size() > 1:
            skip, removed, before = _dist.broadcast_object((skip, removed, before), 0)
            if self._deletes_for_node():
                for s in removed:
                    self.drivers[0].delete(s)
        self._chains.removed(0, removed)
        for i in due:
            ref = None if i in skip else self._chains.reference(i)
            job = self._drain_job(i, step, f"m{self._instance}-{i}-{step}-{self._generation}",
                                  committed, before.get(i, ()), ref)  # fmt: skip
            queued = self._drainer.busy(self.drivers[i])
            if self._drainer.submit(job, skip=i in skip) is None:
                with self._books:
                    self._skipped[i].add(step)
                metrics.drains_skipped.append(self.levels[i].url)
            else:
                self._chains.stored(i, step, ref)
                metrics.drains_started.append(self.levels[i].url)
                if queued:
                    metrics.drains_queued.append(self.levels[i].url)
        metrics.waited_seconds = time.perf_counter() - t0 - blocked
        self.metrics.append(metrics)
        logger.info(
            "dcp_multilevel: step %d committed on %s in %.3f s (%.2f GB/s on this rank); "
            "draining to %s", step, first.url, blocked, metrics.gbps,
            metrics.drains_started or "no level",
        )  # fmt: skip
        self._sink.emit(metrics.record(_dist.rank()))
        return metrics

    def _missing_references(self, index: int, step: int) -> list[int]:
        """Rank 0: the references of first-level ``step`` (its chain, oldest first) that
        level ``index`` must receive before it: a level between nodes copies the first
        level's deltas as they are, of use there only beside their references. Steps
        on rank 0's node's part of the level are not sent again (no drain runs there
        now: the caller waited for it)."""
        if not self._chains.holds_first_level_deltas(index):
            return []
        chain: list[int] = []
        driver = self.drivers[index]
        ref = self._chains.refs(0, [step]).get(step)
        while ref is not None and not driver.checkpoint(ref).is_committed() and ref not in chain:
            chain.append(ref)
            ref = self._chains.refs(0, [ref]).get(ref)
        return chain[::-1]

    def _drain_job(
        self,
        index: int,
        step: int,
        drain_id: str,
        committed: float,
        first: Sequence[int] = (),
        reference: int | None = None,
    ) -> DrainJob:
        """The drain of first-level ``step`` to level ``index``, after drains of the
        first-level steps ``first`` (see :meth:`_missing_references`)."""
        source, target = self.drivers[0], self.drivers[index]
        before = tuple(
            DrainJob(s, source.checkpoint(s), target, f"{drain_id}-ref{s}", committed)
            for s in first
        )
        return DrainJob(step, source.checkpoint(step), target, drain_id, committed, reference,
                        before)  # fmt: skip

    def _first_save(
        self,
        state_dict: dict[str, Any],
        step: int,
        reference: StoredCheckpoint | None,
        extra: dict[str, Any] | None,
    ) -> MultiLevelWriter | None:
        """Save ``step`` on the first level (against ``reference``, ``extra`` in its
        manifest); None when the save failed because of its reference (every rank
        sees the same failure)."""
        first = self.levels[0]
        writer = MultiLevelWriter(
            first.checkpoint_url(step), codec=first.codec, storage_options=first.storage_options,
            reference=reference, extra=extra,
        )  # fmt: skip
        try:
            dcp.save(state_dict, storage_writer=writer, planner=self._planner)
        except CheckpointException as e:
            why = None if reference is None else _reference_failed(e)
            if why is None:
                raise
            logger.warning(
                "dcp_multilevel: step %d could not be coded against %s (%s); saving it whole",
                step, reference.url, why,  # type: ignore[union-attr]
            )  # fmt: skip
            return None
        return writer

    def _reference_checkpoint(self, step: int | None) -> StoredCheckpoint | None:
        """The first level's checkpoint of ``step`` as a reference every rank can use.

        Only rank 0's node may hold its manifest (a node-local first level):
        rank 0 sends it. None on every rank when rank 0 cannot read it.
        """
        if step is None:
            return None
        ckpt = self.drivers[0].checkpoint(step)
        if _dist.world_size() == 1:
            return ckpt
        data = None
        if _dist.rank() == 0:
            try:
                data = ckpt.manifest_bytes()
            except (DcpMultilevelError, OSError) as e:
                logger.warning("dcp_multilevel: no delta against step %d: %s", step, e)
        data = _dist.broadcast_object(data, 0)
        if data is None:
            return None
        # The delta's ranks find its reference's manifest beside it later (drains,
        # loads), on their own node: a node-local first level has it on rank 0's
        # node only, so each node's lowest rank keeps a copy before any delta
        # against it exists there.
        self._loader.keep_manifest(step, data)
        return self.drivers[0].checkpoint(step, manifest_bytes=data)

    # ------------------------------------------------------------------ load

    @property
    def last_load_sources(self) -> dict[str, int]:
        """After a load: how many items each copy served on this rank."""
        return self._loader.last_load_sources

    @property
    def last_restore(self) -> RestoreReport | None:
        """The last load's restore: files brought onto this rank's node, by source."""
        return self._loader.last_restore

    def steps(self, level_index: int) -> list[int]:
        """Steps with a complete checkpoint on level ``level_index``, ascending."""
        return self.drivers[level_index].steps()

    def load_latest(
        self, state_dict: dict[str, Any], *, planner: LoadPlanner | None = None
    ) -> int | None:
        """Load the newest checkpoint every rank can reach; None if there is none.

        Collective. Raises CheckpointNotFoundError when checkpoints exist but
        none is readable by every rank (never a silent fresh start).
        Afterwards, checkpoints a higher level is due to hold but does not (a
        drain killed with the previous run) are drained again.
        """
        views = gather_views(self.drivers)
        with self._books:
            for i in range(1, len(self.levels)):
                self._known[i].update(views.everyone[0][i])
        candidates = views.candidates()
        newest: Restore | None = None
        for step in reversed(candidates):
            plan = self._loader.plan(step, views, state_dict, planner)
            newest = newest or plan
            if plan.ok:
                try:
                    self._loader.load(state_dict, plan, planner)
                except CheckpointNotFoundError as e:
                    # Damage found only while copying (every rank re-planned alike):
                    # the next older step may still be whole.
                    logger.warning("dcp_multilevel: %s; trying an older step", e)
                    plan.reasons.append(str(e))
                    continue
                # Newer steps were not restorable: their files are not all there to drain.
                self._resume_drains({i: [s for s in steps if s <= step]
                                     for i, steps in views.everyone[0].items()})  # fmt: skip
                self._reprotect(plan)
                self._resume_chains(step)
                self._resume_schedule(plan, views)
                return step
        if candidates:
            raise CheckpointNotFoundError(
                f"committed checkpoints exist (newest: step {candidates[-1]}), but for each of "
                f"them some rank cannot reach all of its data files on {self.levels[0].url} (a "
                "node-local level on a lost or new node?) and no higher level holds it"
                + _why(newest)
                + ". Restore the nodes' disks, or start fresh deliberately "
                "with a new level location.",
                checkpoint=self.levels[0].checkpoint_url(candidates[-1]),
            )
        return None

    def _deletes_for_node(self) -> bool:
        """True on the rank that applies rank 0's first-level retention to its node's
        view: one rank per node (all but rank 0, when the topology is unknown)."""
        rank = _dist.rank()
        if self.topology is None:
            return rank != 0
        nodes = self.topology.nodes
        return nodes[rank] != nodes[0] and self.topology.leads(rank)

    def load(
        self, state_dict: dict[str, Any], step: int, *, planner: LoadPlanner | None = None
    ) -> None:
        """Load ``step`` from the fastest level holding it; CheckpointNotFoundError if none.

        Collective.
        """
        views = gather_views(self.drivers)
        if not views.anywhere(step):
            raise CheckpointNotFoundError(
                f"step {step} has no complete checkpoint on any level ("
                + "; ".join(
                    f"{lv.url}: {views.mine[i][-3:] or 'none'}" for i, lv in enumerate(self.levels)
                )
                + " are the newest there). Refusing to start fresh silently: pick an existing "
                "step or call load_latest().",
                checkpoint=self.levels[0].checkpoint_url(step),
            )
        plan = self._loader.plan(step, views, state_dict, planner)
        if not plan.ok:
            raise CheckpointNotFoundError(
                f"step {step} is committed on {self.levels[0].url}, but not every rank can reach "
                "all of its data files there (a node-local level on a lost or new node?) and no "
                "higher level holds it" + _why(plan) + ". Load an earlier step that a higher "
                "level holds.",
                checkpoint=self.levels[0].checkpoint_url(step),
            )
        self._loader.load(state_dict, plan, planner)
        self._resume_schedule(plan, views)

    def _resume_schedule(self, plan: Restore, views: Views) -> None:
        """After a load: the schedule goes on from the state the loaded step's manifest
        kept (rank 0 reads it from the first level that has it; every rank takes it).
        A level that holds no checkpoint up to the step (wiped) has no last save."""
        state = None
        if _dist.rank() == 0:
            for index in plan.levels:
                try:
                    if index == 0 and plan.manifest is not None:
                        ckpt = self.drivers[0].checkpoint(plan.step, manifest_bytes=plan.manifest)
                    else:
                        ckpt = self.drivers[index].checkpoint(plan.step)
                    state = ckpt.manifest().extra.get(SCHEDULE_KEY)
                    break
                except (DcpMultilevelError, OSError):
                    continue  # the load read another copy: so does this
        if _dist.world_size() > 1:
            state = _dist.broadcast_object(state, 0)
        held = {
            i
            for i in range(len(self.levels))
            if any(s <= plan.step for view in views.everyone for s in view[i])
        }
        self._cadence.resume(state, plan.step, held)

    def _resume_chains(self, upto: int) -> None:
        """After a restart: each delta level's history from the manifests of the steps
        it holds up to ``upto`` (rank 0 reads them, every rank takes the same), so the
        next saves go on with the chain instead of starting a keyframe."""
        levels = [i for i in range(len(self.levels)) if self._chains.enabled(i)]
        if not levels:
            return
        histories = None
        if _dist.rank() == 0:
            histories = {}
            for i in levels:
                try:
                    steps = [s for s in self.drivers[i].steps() if s <= upto]
                except OSError as e:  # the chain starts over: costs bytes, never data
                    logger.warning("dcp_multilevel: listing %s failed: %s", self.levels[i].url, e)
                    continue
                histories[i] = sorted(self._chains.refs(i, steps).items())
        if _dist.world_size() > 1:
            histories = _dist.broadcast_object(histories, 0)
        for i, history in (histories or {}).items():
            self._chains.resume(i, history)

    def _reprotect(self, plan: Restore) -> None:
        """After a restore onto a replaced node: drain the loaded step (and the
        references it was restored with) again to each node-local level that some
        nodes hold it on and others lack, so the copies or parity the lost node held
        for the others are made again now, not at the next save on that level.

        Decided from the restore's inventories, the same on every rank (a restore
        that needed nothing keeps only this rank's: nothing to do). Collective.
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
            manifest = decoded_manifest(restored[step].manifest, first.url)  # type: ignore[arg-type]
            if manifest.world_size != _dist.world_size():
                return  # the copies follow the saving job's placement (node_local.py)
            own = own and set(rank_files(manifest, _dist.rank())) <= first.data_files()
        if not all(_dist.all_gather_object(own)):
            logger.warning("dcp_multilevel: step %d is not on every node of %s, and some rank's "
                           "files are not on its first level to copy again; the next save "
                           "there protects the nodes again", plan.step,
                           [self.levels[i].url for i in redo])  # fmt: skip
            return
        for i, steps in redo.items():
            for step in steps:
                logger.info("dcp_multilevel: step %d is on %s on nodes %s only; copying it "
                            "again for nodes %s", step, self.levels[i].url,
                            sorted(holders[i, step]), sorted(nodes - holders[i, step]))  # fmt: skip
            self._generation += 1
            drain_id = f"m{self._instance}-{i}-{steps[-1]}-{self._generation}-reprotect"
            job = self._drain_job(i, steps[-1], drain_id, time.time(), steps[:-1])
            self._drainer.submit(job, skip=False)

    def _resume_drains(self, view: dict[int, list[int]]) -> None:
        """Drain again the newest first-level step each higher level is due to hold and
        lacks (``view``: rank 0's listing). Collective."""
        first = view[0]
        resumed: dict[int, int] = {}
        for i in range(1, len(self.levels)):
            newest_there = max(view[i], default=-1)
            pending = [s for s in first if self._due(i, s) and s > newest_there]
            if pending:
                resumed[i] = pending[-1]
        before: dict[int, list[int]] = {}
        if _dist.rank() == 0:
            before = {i: self._missing_references(i, step) for i, step in resumed.items()}
        if resumed and _dist.world_size() > 1:
            before = _dist.broadcast_object(before, 0)
        for i, step in resumed.items():
            self._generation += 1
            logger.info("dcp_multilevel: resuming the drain of step %d to %s",
                        step, self.levels[i].url)  # fmt: skip
            drain_id = f"m{self._instance}-{i}-{step}-{self._generation}-resume"
            job = self._drain_job(i, step, drain_id, time.time(), before[i])
            # skip=False: the same decision on every rank (wait for a running drain).
            self._drainer.submit(job, skip=False)

    # ------------------------------------------------------------------ lifecycle

    @property
    def drain_results(self) -> list[DrainResult]:
        """Every drain's outcome on this rank so far (bytes, seconds, lag, errors, skips)."""
        return list(self._drainer.results)

    def wait(self) -> list[DrainResult]:
        """Wait for running drains; DrainError if any failed since the last call."""
        return self._drainer.wait()

    def _drained(self, job: DrainJob) -> None:
        """In the drain worker, after a commit: remember it; rank 0 applies retention there
        (on a node-local level, the lowest rank of each node, on its node's part)."""
        index = self.drivers.index(job.target)
        with self._books:
            self._known[index].add(job.step)
        if job.target.node_local and self.topology is not None:
            applies = self.topology.leads(_dist.rank())
        else:
            applies = _dist.rank() == 0
        if applies:
            try:
                self._retain(index)
            except OSError as e:  # retention is housekeeping: the drain itself succeeded
                logger.warning("dcp_multilevel: retention on %s failed: %s", job.target.url, e)

    def _drain_ended(self, result: DrainResult) -> None:
        """Every drain's outcome, in the thread that decided it: its metrics record; a
        superseded step needs no protection on the first level any more."""
        if result.superseded:
            index = next(i for i, d in enumerate(self.drivers) if d.url == result.level)
            with self._books:
                self._skipped[index].add(result.step)
        self._sink.emit(result.record(_dist.rank()))

    def close(self) -> None:
        """Wait for drains (raising their errors), then stop the workers; restore the
        SIGTERM handler (``save_on_sigterm``)."""
        try:
            self.wait()
        finally:
            self._cadence.close()
            self._drainer.close()
            self._exit_hook.detach()

    # ------------------------------------------------------------------ retention

    def _retain(self, index: int) -> list[int]:
        """Apply retention on level ``index`` (rank 0); return the steps removed.

        One thread per level runs it (the main thread for the first level, the
        level's lane for a higher one), so a level's listing and deletions never
        race; the books it reads are copied under the lock, and no I/O runs
        under it (a slow remote's listing must not stall the next ``save``).
        """
        driver, level = self.drivers[index], self.levels[index]
        complete = driver.steps()
        protected = self._drainer.inflight_steps(None if index == 0 else driver)
        if index == 0:
            for j in range(1, len(self.levels)):
                with self._books:
                    protected |= retention.not_yet_above(
                        complete, lambda s, j=j: self._due(j, s), self._known[j],
                        self._skipped[j],
                    )  # fmt: skip
                # The next delta drained to level j reads its reference from here.
                ref = self._chains.reference(j)
                if ref is not None:
                    protected.add(ref)
        refs = self._chains.refs(index, complete)
        doomed = retention.expired(complete, level.keep, protected, refs)
        # Abandoned by a crashed save or drain: no manifest, older than the newest.
        doomed += retention.abandoned(driver.uncommitted(), complete, protected)
        # A crash in the middle must never leave a delta without its reference.
        doomed = retention.deletion_order(doomed)
        for step in doomed:
            driver.delete(step)
            logger.info("dcp_multilevel: retention removed step %d from %s", step, level.url)
        # (Higher levels' removals are not recorded in the delta history: only rank 0
        # sees them, and every rank must choose a drain's reference alike. A drain
        # whose reference retention removed stores its step whole, on every rank.)
        return doomed


def _levels_argument(levels: Sequence[Level] | None, tiers: Sequence[Level] | None) -> list[Level]:
    if tiers is not None:
        if levels is not None:
            raise ConfigError("pass the levels once: CheckpointManager(levels), not also tiers=")
        warnings.warn(
            "CheckpointManager(tiers=...) is deprecated and will be removed in 0.3: pass the "
            "levels as the first argument (CheckpointManager([Level(...), ...]))",
            DeprecationWarning,
            stacklevel=3,
        )
        levels = tiers
    out = list(levels or ())
    if not out or not all(isinstance(lv, Level) for lv in out):
        raise ConfigError("CheckpointManager needs a non-empty list of Level(...) objects")
    return out


def _on_node(level: Level, node: int) -> Level:
    """``level`` with ``{node}`` in its path replaced (a plain Level: no second warning)."""
    if NODE_FIELD not in level.url:
        return level
    values = {f.name: getattr(level, f.name) for f in dataclasses.fields(Level)}
    return Level(**{**values, "url": expand_node(level.url, node)})


#: Numbers the managers of this process (see ``_instance``).
_INSTANCES = itertools.count()


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


def _reference_failed(e: CheckpointException) -> str | None:
    """The first rank's reference failure in a failed save (BrokenChainError or the
    commit's check), or None when the save failed for another reason."""
    for failure in e.failures.values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, (BrokenChainError, CorruptCheckpointError)):
            return str(err)
    return None


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative integer, got {step!r}")


def _why(plan: Restore | None) -> str:
    return f" ({'; '.join(plan.reasons)})" if plan is not None and plan.reasons else ""


def _finish_at_exit(drainer: Drainer) -> None:
    try:
        drainer.wait()
    except DrainError as e:
        logger.error("dcp_multilevel: at exit, checkpoint drains had failed: %s", e)
    finally:
        drainer.close()

"""CheckpointManager: multi-level saves, the newest complete checkpoint, retention.

Call order (every rank, main thread; the same steps on every rank)::

    mgr = CheckpointManager([Level(local, every=1, keep=2), Level(remote, every=4)])
    step = mgr.load_latest(state_dict)   # None on a fresh start; resumes drains left behind
    mgr.step(state_dict, step=s, loss=l)  # each training step: saves when the schedule
                                          # says so (the same decision on every rank)
    mgr.save(state_dict, step=s)          # or save explicitly: returns once the first
                                          # level committed; due higher levels drain
                                          # in the background
    mgr.wait()                            # the newest step due on each level is there;
                                          # DrainError if a drain failed
    mgr.close()                           # also run at interpreter exit (errors logged)

With ``CheckpointManager(..., async_save=True)``, :meth:`save` (and :meth:`step`)
return once the state is staged into the writer's reused host buffers (from
CUDA: pinned); DCP writes and commits the first level in its background
thread, over a gloo group of the manager's own. That save's books and drains
are finished on the main thread by the next save, :meth:`finish_save`,
:meth:`wait`, a load or :meth:`close` (every rank makes the same calls), which
also raise its error if it failed. With ``staging=StagingConfig(overlap=True)``
they return before the state is copied: call :meth:`wait_for_staging` before
it next changes (the optimizer step).

The manager is the step and schedule layer on top of the plugin: each save
is a ``dcp.save`` (or ``dcp.async_save``) with a
:class:`~dcp_multilevel.MultiLevelWriter` given its levels, each load a
``dcp.load`` with a :class:`~dcp_multilevel.MultiLevelReader` given them, and
the drains, retention and restores are the process's runtime for those levels
(``runtime/``), shared with any writer or reader given the same levels. What
the manager adds: when to save (``cadence.py``, the schedule), ``step()``,
SIGTERM, metrics (``metrics.py``).

A checkpoint exists on a level iff its manifest there exists. The first
level may be node-local: then only rank 0's node has the manifest, and
loading agrees on the newest step every rank can read; each rank then reads
its files from the first level and the rest, file by file, from the higher
levels.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from .. import _dist
from .. import levels as levels_pkg
from ..errors import ConfigError
from ..format import step_dir
from ..health import Checks
from ..levels.config import LATEST, PART_SHARE, Level
from ..plugin import BalancedSavePlanner, MultiLevelReader, MultiLevelWriter
from ..schedule import FixedInterval, SavePolicy
from ..staging import StagingConfig
from .cadence import Cadence
from .metrics import MetricsSink, SaveMetrics
from .saving import FirstLevelSaves

if TYPE_CHECKING:  # the levels machinery loads with the first manager
    from ..levels.base import DrainResult
    from ..levels.restore import Restore, Views
    from ..levels.restore_execute import RestoreReport
    from ..levels.topology import Topology

__all__ = ["CheckpointManager", "SaveMetrics"]

#: The manifest's ``extra`` key under which each save keeps the schedule's state
#: (``cadence.py``: the job's clock, each level's last save, the policy's).
SCHEDULE_KEY = "dcp_multilevel.schedule"

# The logger users configure, named as documented (not after this module).
logger = logging.getLogger("dcp_multilevel.manager")


class CheckpointManager:
    """Saves to several levels with their own intervals and retention; loads the newest.

    Args (details: ``docs/levels.md``, ``docs/schedule.md``, ``docs/async.md``):
        levels: fastest first. The first takes every :meth:`save` (its ``every``
            paces :meth:`step`), must be a store level, and may be node-local.
        topology: which node each rank is on (default: each rank's environment,
            ``DCP_ML_NODE``, else ``GROUP_RANK``, else ``NODE_RANK``, else
            ``RANK // LOCAL_WORLD_SIZE``, else node 0: ``docs/levels.md``,
            "Nodes"); ``{node}`` in a level's path is this rank's node.
        schedule: which levels take each save (default :class:`FixedInterval`:
            each level's ``every``; ``Schedule.auto(mtbf_hours=...)`` for :meth:`step`).
        planner: save planner (default: one reused :class:`BalancedSavePlanner`).
        drain_policy: a save due on a level whose drain is still running:
            ``"latest"`` (default) waits in the level's one slot, replaced by a
            newer due step, and :meth:`wait` covers it; ``"skip"`` is not sent
            there; ``"wait"`` blocks :meth:`save` until the level is free.
        drain_timeout_s: the bound of every wait of the levels (a drain's ranks for
            each other, :meth:`wait`, a save's outcome; default ``DCP_ML_TIMEOUT_S``,
            else 3600 s; ``docs/levels.md``, "Bounded waits").
        metrics_path: JSON-lines file for every save's and drain's record
            (``{rank}`` in the path: one file per rank; else rank 0's only).
        on_metrics: called with every record on every rank (drains: from their thread).
        save_on_sigterm: after a SIGTERM, :meth:`step` saves to the first level and exits.
        check_seconds: at most this much training between :meth:`step`'s agreements.
        sweep_older_than_s: remove crash leftovers older than this at construction.
        async_save: :meth:`save` returns once the state is staged (module docstring);
            with ``StagingConfig(overlap=True)`` at once: call
            :meth:`wait_for_staging` before the state next changes.
        staging: the async saves' staging (:class:`~dcp_multilevel.StagingConfig`).
        restore_whole_files: a restore after a node loss brings whole files, not
            only the byte ranges the node's ranks read.
        checks: the health checks every save runs (default: all on,
            :class:`~dcp_multilevel.Checks`; ``docs/health.md``): a step they find
            poisoned stays on the first level, quarantined, and
            :meth:`load_latest` passes over it. Its loss rule judges the
            ``loss`` given to :meth:`step` and :meth:`save`.
        overwrite: ``Level(overwrite=True)`` for every level: a save or drain of a
            step a level holds committed as another save replaces it atomically
            (the old one stays loadable until the new manifest commits). False
            (the default): each level's own ``overwrite`` decides, and a drain
            that would replace another save fails (:meth:`wait` raises
            :class:`~dcp_multilevel.DrainError` naming the level, the step and
            both saves) with the level's step kept as it is.
    """

    def __init__(
        self,
        levels: Sequence[Level] | None = None,
        *,
        topology: Topology | None = None,
        schedule: SavePolicy | None = None,
        planner: SavePlanner | None = None,
        drain_policy: str = "latest",
        drain_timeout_s: float | None = None,
        metrics_path: str | None = None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
        sweep_older_than_s: float | None = 3600.0,
        save_on_sigterm: bool = False,
        check_seconds: float = 10.0,
        async_save: bool = False,
        staging: StagingConfig | None = None,
        restore_whole_files: bool = False,
        overwrite: bool = False,
        checks: Checks | None = None,
    ) -> None:
        if overwrite and levels is not None:
            levels = [
                dataclasses.replace(lv, overwrite=True) if isinstance(lv, Level) else lv
                for lv in levels
            ]
        # Collective: the process's runtime for these levels (shared with any writer or
        # reader given them), made the first time.
        runtime = levels_pkg.runtime_for(
            levels,
            topology=topology,
            who="CheckpointManager",
            drain_policy=drain_policy,
            timeout_s=drain_timeout_s,
            part_share=0.0 if restore_whole_files else PART_SHARE,
        )
        runtime.hold()
        # A manager dropped without close() lets go of its runtime too (its drains
        # waited for); at interpreter exit the runtimes' own hook does that.
        self._release = weakref.finalize(self, levels_pkg.release, runtime, quiet=True)
        self._release.atexit = False
        self._runtime = runtime
        self._given = list(runtime.given)
        self._topology = topology
        self.levels, self.drivers, self.topology = runtime.levels, runtime.drivers, runtime.topology
        self.schedule = schedule if schedule is not None else FixedInterval()
        runtime.books.adopt_schedule(self.schedule)  # for steps no save recorded
        self._cadence = Cadence(
            self.schedule,
            self.levels,
            runtime.binding.survives(),
            check_seconds=check_seconds,
            save_on_sigterm=save_on_sigterm,
        )
        self._sink = MetricsSink(metrics_path, on_metrics, _dist.rank())
        self._drain_results: list[DrainResult] = []
        self._unlisten = runtime.listen(self._drain_ended)
        self._saves = FirstLevelSaves(
            runtime,
            self._given,
            topology,
            planner or BalancedSavePlanner(),
            async_save=async_save,
            staging=staging,
            timeout_s=runtime.timeout_s,
        )
        if checks is not None and not isinstance(checks, Checks):
            raise ConfigError(f"CheckpointManager(checks=...) takes a Checks, got {checks!r}")
        #: The health checks every save runs (its loss rule remembers :meth:`step`'s losses).
        self.checks = checks if checks is not None else Checks()
        self._saves.checks = self.checks
        self.async_save = async_save
        self.metrics: list[SaveMetrics] = []
        if sweep_older_than_s is not None:
            runtime.binding.sweep(sweep_older_than_s)

    # ------------------------------------------------------------------ save

    def step(
        self, state_dict: dict[str, Any], step: int, *, loss: float | None = None
    ) -> SaveMetrics | None:
        """The training loop's hook: save ``step`` to the levels the schedule says are due.

        Call it after every training step, on every rank (collective at the
        schedule's check steps, see ``manage/cadence.py``). ``loss``: the step's
        loss (a convergence-aware schedule reads rank 0's; the health checks'
        loss rule judges each rank's at a save, ``docs/health.md``). Returns the save's
        metrics, or None when nothing was saved. With ``save_on_sigterm``,
        after a SIGTERM on any rank: saves ``step`` to the first level, waits
        for its commit, and raises ``SystemExit(143)`` on every rank.
        """
        _check_step(step)
        tick = self._cadence.tick(step, loss, self._runtime.costs)
        self._saves.loss = loss  # judged by the save, if one is made
        try:
            if tick.stop:
                metrics = self._save(state_dict, step, [])
                self.finish_save()  # an async save: committed before the exit
                self._cadence.saved(step, [0], metrics.seconds)
                self._sink.emit(
                    {"kind": "sigterm", "rank": _dist.rank(), "step": step, "unix": time.time()}
                )
                logger.warning("dcp_multilevel: step %d committed after SIGTERM; exiting", step)
                self._cadence.close()
                raise SystemExit(128 + signal.SIGTERM)
            if tick.decision is None:
                if loss is not None and self.checks.loss is not None:
                    self.checks.loss.observe(loss)
                return None
            self._runtime.books.decided(step, tick.decision.levels)
            self._sink.emit(
                {**tick.decision.record(), "step": step, "rank": _dist.rank(), "unix": time.time()}
            )
            higher = sorted(i for i in tick.decision.levels if i > 0)
            metrics = self._save(state_dict, step, higher)
            if self._saves.pending is not None:  # async: its drains start at finish_save
                self._saves.pending.from_step = True
            started = [i for i in higher if self.levels[i].url in metrics.drains_started]
            self._cadence.saved(step, [0, *started], metrics.seconds)
            return metrics
        finally:
            self._saves.loss = None
            self._cadence.stepped()

    def save(
        self, state_dict: dict[str, Any], step: int, *, loss: float | None = None
    ) -> SaveMetrics:
        """Save ``state_dict`` as ``step``; return once the first level has committed it.

        The first level takes every ``save`` (its ``every`` is for :meth:`step`);
        higher levels take it when the schedule says so. Collective (every rank,
        same step). ``loss``: the step's loss, for the health checks' loss rule.
        """
        _check_step(step)
        holdings = self._runtime.books
        due = [i for i in range(1, len(self.levels)) if holdings.due(i, step, again=True)]
        self._saves.loss = loss
        try:
            return self._save(state_dict, step, due)
        finally:
            self._saves.loss = None

    def _save(self, state_dict: dict[str, Any], step: int, due: list[int]) -> SaveMetrics:
        """The first level's save, then rank 0's decisions for every rank (which drains
        to skip, what retention removed), then the drains (for an async save: at
        :meth:`finish_save`)."""
        self.finish_save()  # the async save before: committed, its drains started
        t0 = time.perf_counter()
        # Kept in the manifest (rank 0 writes it): a restart goes on with the schedule.
        extra = {SCHEDULE_KEY: self._cadence.state(step, [0, *due])} if _dist.rank() == 0 else None
        if self.async_save:
            return self._saves.save_async(state_dict, step, extra, due)
        writer = self._saves.save(state_dict, step, extra, due)
        metrics = SaveMetrics(
            step, self.levels[0].url, writer.bytes_written, time.perf_counter() - t0
        )
        self._committed(writer, metrics)
        return metrics

    def wait_for_staging(self) -> None:
        """Wait until the async save in flight no longer reads the state.

        Only ``staging=StagingConfig(overlap=True)`` needs it: :meth:`save`
        then returns before the state is copied (or, over the staging budget,
        written), and training must call this before the optimizer step, as
        torchtitan's ``maybe_wait_for_staging``. Returns at once otherwise.
        Not collective. Raises the staging's error.
        """
        self._saves.wait_for_staging()

    def finish_save(self) -> SaveMetrics | None:
        """Wait for the async save in flight to commit on the first level, then start
        its drains and retention; its metrics, or None when none was in flight.

        Collective (every rank calls it at the same point; :meth:`save`,
        :meth:`wait`, the loads and :meth:`close` call it first). Raises the
        save's error (DCP's ``CheckpointException``) if it failed.
        """
        p = self._saves.finish_async()
        if p is None:
            return None
        self._committed(p.writer, p.metrics)
        if p.from_step:  # the schedule learns where the step went, and what it cost
            started = [i for i in p.due if self.levels[i].url in p.metrics.drains_started]
            self._cadence.saved(p.step, started, None)
            self._cadence.waited(p.metrics.seconds - p.metrics.blocked_seconds)
        return p.metrics

    def _committed(self, writer: MultiLevelWriter, metrics: SaveMetrics) -> None:
        """After the first level committed a save: wait until the runtime followed it up
        (rank 0's decisions for every rank: which drains run, what first-level retention
        removed), and record where the step went."""
        t0 = time.perf_counter()
        ticket = writer.ticket
        assert ticket is not None  # a writer given levels, whose save began
        self._runtime.follower.settle(ticket)
        metrics.drains_started = list(ticket.sent.started)
        metrics.drains_skipped = list(ticket.sent.skipped)
        metrics.drains_queued = list(ticket.sent.queued)
        metrics.waited_seconds += time.perf_counter() - t0
        self.metrics.append(metrics)
        logger.info(
            "dcp_multilevel: step %d committed on %s in %.3f s (%.2f GB/s on this rank); "
            "draining to %s",
            metrics.step,
            metrics.level,
            metrics.blocked_seconds,
            metrics.gbps,
            metrics.drains_started or "no level",
        )
        self._sink.emit(metrics.record(_dist.rank()))

    def _drain_ended(self, result: DrainResult) -> None:
        """Every drain of the runtime: kept for :attr:`drain_results`, and a metrics record."""
        self._drain_results.append(result)
        self._sink.emit(result.record(_dist.rank()))

    # ------------------------------------------------------------------ load

    @property
    def last_load_sources(self) -> dict[str, int]:
        """After a load: how many items each copy served on this rank."""
        return self._runtime.restorer.last_load_sources

    @property
    def last_restore(self) -> RestoreReport | None:
        """The last load's restore: files brought onto this rank's node, by source."""
        return self._runtime.restorer.last_restore

    def steps(self, level_index: int) -> list[int]:
        """Steps with a complete checkpoint on level ``level_index``, ascending."""
        return self.drivers[level_index].steps()

    def load_latest(
        self,
        state_dict: dict[str, Any],
        *,
        planner: LoadPlanner | None = None,
        allow_quarantined: bool = False,
    ) -> int | None:
        """Load the newest clean checkpoint every rank can reach; None if there is none.

        Quarantined steps (``docs/health.md``) are passed over and logged, unless
        ``allow_quarantined``. Collective. Raises CheckpointNotFoundError when
        checkpoints exist but none is readable by every rank, or every one is
        quarantined (never a silent fresh start).
        Afterwards, the newest step a higher level is due to hold but does not
        (a drain killed with the previous run) is drained again.
        """
        self.finish_save()
        if levels_pkg.newest_step(self._given, topology=self._topology) is None:
            return None
        return self._load(state_dict, LATEST, planner, allow_quarantined)

    def load(
        self, state_dict: dict[str, Any], step: int, *, planner: LoadPlanner | None = None
    ) -> None:
        """Load ``step`` from the fastest level holding it; CheckpointNotFoundError if none.

        Collective.
        """
        self.finish_save()
        self._load(state_dict, step_dir(step), planner)

    def _load(
        self,
        state_dict: dict[str, Any],
        what: str,
        planner: LoadPlanner | None,
        allow_quarantined: bool = False,
    ) -> int:
        """``dcp.load`` of ``what`` through the levels; the step loaded. Collective."""
        reader = MultiLevelReader(
            what, levels=self._given, topology=self._topology, allow_quarantined=allow_quarantined
        )
        loads = reader.loads
        assert loads is not None
        # What each rank reads, from a dry run of the load planner: the restore brings
        # exactly that, in one round, and damage found while copying it makes the load
        # go on to an older step.
        loads.reads = lambda manifest: levels_pkg.needed_ranges(state_dict, manifest, planner)
        try:
            dcp.load(state_dict, storage_reader=reader, planner=planner)
        except CheckpointException as e:  # the ranks could not agree on the step, or bring it
            if loads.failure is not None:
                raise loads.failure from e
            raise
        assert loads.restore is not None and loads.views is not None
        self._sink.emit(self._runtime.restorer.record(loads.restore.step))
        self._resume_schedule(loads.restore, loads.views)
        return loads.restore.step

    def _resume_schedule(self, plan: Restore, views: Views) -> None:
        """After a load: the schedule goes on from the state the loaded step's manifest
        kept. A level that holds no checkpoint up to the step (wiped) has no last save."""
        held = {
            i
            for i in range(len(self.levels))
            if any(s <= plan.step for view in views.everyone for s in view[i])
        }
        self._cadence.resume(self._runtime.restorer.kept(plan, SCHEDULE_KEY), plan.step, held)

    # ------------------------------------------------------------------ lifecycle

    @property
    def drain_results(self) -> list[DrainResult]:
        """Every drain's outcome on this rank so far (bytes, seconds, lag, errors, skips)."""
        return list(self._drain_results)

    def wait(self) -> list[DrainResult]:
        """Finish an async save in flight (:meth:`finish_save`), then wait until the
        newest step due on each level is there (or its drain failed); DrainError if
        any drain failed since the last call."""
        self.finish_save()
        self._runtime.wait()
        return self.drain_results

    def close(self) -> None:
        """Wait for drains (raising their errors), then let go of the levels (the last
        manager over them stops their lanes); restore the SIGTERM handler
        (``save_on_sigterm``)."""
        try:
            self.wait()
        finally:
            self._cadence.close()
            self._saves.close()
            self._unlisten()
            if self._release.detach() is not None:  # once, however often close() is called
                levels_pkg.release(self._runtime)


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative integer, got {step!r}")

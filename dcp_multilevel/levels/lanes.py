"""Drains in the background: one lane per target level, and what happens to a due
step while that level is busy.

A drain brings one committed checkpoint of the first level onto a higher
level; *how* is the level's driver's (``LevelDriver.drain``); this module
runs drains, one at a time per level, and keeps their outcomes.

Call order (driven by :class:`~dcp_multilevel.CheckpointManager`)::

    every rank, main thread   lanes.submit(job)       after the first level's commit,
                                                         in the same order on every rank
    every rank, lane thread   run_one(job)             the source manifest shared
                              through the link (rank 0 reads it), then
                              job.target.drain(job, manifest, link)
    any thread                lanes.wait(timeout_s)    every lane idle; raises DrainError
                                                         (WaitTimeoutError past the bound)

One lane (one thread) per target level: at most one drain per level runs.
When a save is due on a level whose lane is busy, ``policy`` decides:

- ``"latest"`` (default): the step waits in the lane; when the running drain
  ends, the lane runs the newest waiting step and reports the older waiting
  ones as *superseded* (``DrainResult.superseded_by``), not as errors. So
  the newest due step always reaches the level, and ``save`` never blocks on
  a drain.
- ``"skip"``: the step is not sent there at all (the caller decides, see
  :meth:`Lanes.submit`); the result says so.
- ``"wait"``: ``submit`` blocks until the lane is idle.

Which waiting step a lane runs next is one decision for every rank (a drain
needs every rank's share): rank 0's lane picks it and publishes its drain id
through the c10d store under ``dcp_multilevel/lane/<lanes key>/<lane>/<n>``
(the n-th drain that lane starts); the other ranks' lanes run exactly that
one, dropping the waiting jobs older than it. Lanes never use the trainer's
process group (see ``link.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, DcpMultilevelError, DrainError, WaitTimeoutError
from ..staging._priority import lower_thread_priority
from .base import DrainChannel, DrainJob, DrainResult, LevelDriver

__all__ = ["DRAIN_POLICIES", "Lanes", "run_one"]

logger = logging.getLogger(__name__)

#: What a save does when its level's previous drain is still running.
DRAIN_POLICIES = ("latest", "skip", "wait")

#: How many of the newest outcomes :attr:`Lanes.results` keeps.
RESULTS_KEPT = 64


def run_one(job: DrainJob, *, timeout_s: float) -> DrainResult:
    """Run this rank's part of ``job`` (every rank calls it for the same job).

    Every failure is told to the other ranks through the link, so no rank
    waits out ``timeout_s`` for a peer that already failed.
    """
    link = DrainChannel(job.drain_id, timeout_s)
    try:
        raw = link.share_manifest(job.source.manifest_bytes, job.source.url)
        source = StoredCheckpoint(
            job.source.store, location=job.source.location, manifest_bytes=raw
        )
        manifest = source.manifest()
        return job.target.drain(replace(job, source=source), manifest, link)
    except Exception as e:
        link.fail(e)
        raise


@dataclass
class _Waiting:
    """A submitted drain that has not started: its job, its future, when it came."""

    job: DrainJob
    future: Future[DrainResult]
    since: float = field(default_factory=time.perf_counter)  # submitted
    queued_seconds: float = 0.0  # submitted -> started (set when it starts)
    #: Steps of ``job.before`` that an earlier job of the lane was to bring there
    #: when this one was submitted: dropped from ``before`` if they are there by
    #: the time this job starts (the others are sent as asked: a re-protection
    #: sends steps that rank 0's node holds but others lack).
    recheck: frozenset[int] = frozenset()


@dataclass
class _Lane:
    """One target level's drains. Guarded by the lanes' condition, except ``started``,
    which only the lane's own thread reads and writes."""

    name: str
    waiting: list[_Waiting] = field(default_factory=list)  # oldest first
    running: _Waiting | None = None
    started: int = 0  # drains this lane started: the same count on every rank
    thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def levels(self) -> str:
        """The level(s) its jobs go to, for messages."""
        entries = [e for e in (self.running, *self.waiting) if e is not None]
        return ", ".join(sorted({e.job.target.url for e in entries})) or self.name


class Lanes:
    """Runs drains in the background, one lane per target level (see the module docstring).

    Args:
        policy: ``"latest"``, ``"skip"`` or ``"wait"`` (see the module docstring).
        timeout_s: how long a drain's ranks wait for each other.
        on_committed: ``on_committed(job)`` runs in the lane's thread after a commit.
        on_result: ``on_result(result)`` after every drain (also failed, skipped and
            superseded ones), in the thread that decided it. Neither is called with
            the lanes' lock held.
        key: names these lanes in the c10d store: the same on every rank,
            unique among the drainers of one process group.
        nice: the lanes' threads run at this nice value (Linux; threads they start
            inherit it), so that on a node whose cores are busy the training loop
            could win the CPU from a drain. 0 (the default): unchanged; nice 10
            made no difference to ``save()`` on 2 cores.
    """

    def __init__(
        self,
        *,
        policy: str = "latest",
        timeout_s: float = 3600.0,
        on_committed: Callable[[DrainJob], None] | None = None,
        on_result: Callable[[DrainResult], None] | None = None,
        key: str = "lanes",
        nice: int = 0,
    ) -> None:
        if policy not in DRAIN_POLICIES:
            raise ConfigError(
                f"drain_policy must be one of {', '.join(map(repr, DRAIN_POLICIES))}, "
                f"got {policy!r}"
            )
        self.policy = policy
        self.timeout_s = timeout_s
        self._on_committed = on_committed
        self._on_result = on_result
        self._key = key
        self._nice = nice
        # One condition guards every lane's waiting/running, the results and
        # `_closed`: the main thread submits and waits while lane threads pick and
        # finish jobs. Callbacks and I/O never run under it.
        self._cond = threading.Condition()
        self._lanes: dict[LevelDriver, _Lane] = {}
        self._closed = False
        # The newest outcomes (bounded: a long run keeps no state per drain; a
        # caller that wants them all collects them through ``on_result``).
        self._results: deque[DrainResult] = deque(maxlen=RESULTS_KEPT)
        self._unreported: list[DrainResult] = []  # failures wait() has not raised yet

    @property
    def results(self) -> list[DrainResult]:
        """The newest outcomes, oldest first (at most :data:`RESULTS_KEPT`).

        A copy taken under the condition: lane threads append while the main thread
        reads (iterating the deque itself could raise "deque mutated during
        iteration")."""
        with self._cond:
            return list(self._results)

    def busy(self, target: LevelDriver) -> bool:
        """True while a drain to ``target`` runs or waits to run."""
        with self._cond:
            lane = self._lanes.get(target)
            return lane is not None and lane.busy

    def finish(self, target: LevelDriver) -> None:
        """Block until the lane of ``target`` is idle (nothing running or waiting).

        Errors are not raised here; :meth:`wait` reports them.

        Raises:
            WaitTimeoutError: still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            lane = self._lanes.get(target)
            while lane is not None and lane.busy:
                self._wait_until(deadline, [lane])

    def submit(self, job: DrainJob, *, skip: bool | None = None) -> Future[DrainResult] | None:
        """Queue ``job`` on its level's lane; None when it is skipped.

        ``skip``: None lets this Lanes's policy decide (``"skip"`` skips when
        the lane is busy). With several ranks the decision must be the same
        everywhere (a drain needs every rank's share), so the manager takes
        rank 0's and passes it: True skips; False queues the job. Under
        ``"wait"`` this blocks until the lane is idle first; under ``"latest"``
        a newer job submitted before this one starts supersedes it. Every rank
        must submit the same jobs in the same order.
        """
        if skip is None:
            skip = self.policy == "skip" and self.busy(job.target)
        if skip:
            logger.warning(
                "dcp_multilevel: step %d not copied to %s: the drain of an earlier step "
                "is still running (policy 'skip')",
                job.step,
                job.target.url,
            )
            self._record(DrainResult(job.step, job.target.url, skipped=True))
            return None
        if self.policy == "wait":
            self.finish(job.target)
        entry = _Waiting(job, Future())
        with self._cond:
            if self._closed:
                raise DrainError(
                    f"the lanes are closed: step {job.step} cannot drain to {job.target.url}"
                )
            lane = self._lanes.get(job.target)
            if lane is None:
                # Lanes are named in the order their levels are first submitted to,
                # which is the same on every rank (submit's contract).
                lane = self._lanes[job.target] = _Lane(f"{self._key}/{len(self._lanes)}")
            ahead = {e.job.step for e in (lane.running, *lane.waiting) if e is not None}
            entry.recheck = frozenset(b.step for b in job.before if b.step in ahead)
            lane.waiting.append(entry)
            if lane.thread is None:
                lane.thread = threading.Thread(
                    target=self._serve,
                    args=(lane,),
                    daemon=True,
                    name=f"dcp-ml-drain-{len(self._lanes)}",
                )
                lane.thread.start()
            self._cond.notify_all()
        return entry.future

    def inflight_steps(self, target: LevelDriver | None = None) -> set[int]:
        """Source steps a drain runs or waits to run on, with the steps those drains
        read beside them (references, references sent first): retention must not
        delete them from the first level (``target`` None: every lane's), nor a
        reference from the level ``target`` while a drain there codes against it
        (that lane's only)."""
        with self._cond:
            lanes = [lane for t, lane in self._lanes.items() if target in (None, t)]
            entries = [e for lane in lanes for e in (lane.running, *lane.waiting) if e is not None]
        out: set[int] = set()
        for e in entries:
            out.add(e.job.step)
            out.update(b.step for b in e.job.before)
            if e.job.reference is not None:
                out.add(e.job.reference)
        return out

    def wait(self, timeout_s: float | None = None) -> list[DrainResult]:
        """Block until every lane is idle; raise DrainError for any drain that failed
        since the last call (superseded and skipped steps are not failures). Returns
        the newest outcomes (:attr:`results`).

        Raises:
            WaitTimeoutError: a lane still busy after ``timeout_s`` (None: the
                lanes' ``timeout_s``), naming its steps and level.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while any(lane.busy for lane in self._lanes.values()):
                self._wait_until(deadline, [lane for lane in self._lanes.values() if lane.busy])
            failed, self._unreported = self._unreported, []
            results = list(self._results)
        if failed:
            raise DrainError(
                "; ".join(f"step {r.step} to {r.level}: {r.error}" for r in failed)
                + ". The first level still holds these checkpoints."
            )
        return results

    def _wait_until(self, deadline: float, lanes: list[_Lane]) -> None:
        """Under the condition: wait for a change, or WaitTimeoutError naming what the
        busy ``lanes`` run and hold once ``deadline`` (monotonic) has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            what = "; ".join(
                f"{lane.levels()}: "
                + ", ".join(f"step {e.job.step}" for e in (lane.running, *lane.waiting) if e)
                for lane in lanes
            )
            raise WaitTimeoutError(
                f"rank {_dist.rank()} waited {self.timeout_s:g} s for drains still running or "
                f"queued ({what}), in vain: a drain stuck on its level or on another rank. "
                "Raise the bound (DCP_ML_TIMEOUT_S) if drains take longer"
            )
        self._cond.wait(left)

    def close(self) -> None:
        """Stop the lanes once nothing waits (call :meth:`wait` first for errors); a lane
        that does not stop within ``timeout_s`` is logged and left to the exit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            lanes = [lane for lane in self._lanes.values() if lane.thread is not None]
        deadline = time.monotonic() + self.timeout_s
        for lane in lanes:
            if lane.thread is not threading.current_thread():
                lane.thread.join(max(0.0, deadline - time.monotonic()))
                if lane.thread.is_alive():
                    logger.error(
                        "dcp_multilevel: the drains to %s did not stop within %g s",
                        lane.levels(),
                        self.timeout_s,
                    )

    # ------------------------------------------------------------------ lane threads

    def _serve(self, lane: _Lane) -> None:
        """A lane's thread: run the job every rank agrees on next, until closed."""
        lower_thread_priority(self._nice)
        while True:
            entry = self._next(lane)
            if entry is None:
                return
            result = self._run(entry.job, entry.queued_seconds)
            entry.future.set_result(result)
            with self._cond:
                lane.running = None
                self._cond.notify_all()

    def _next(self, lane: _Lane) -> _Waiting | None:
        """Take the lane's next job (rank 0 chooses, every rank takes the same), after
        reporting the waiting jobs it supersedes; None once closed and idle."""
        with self._cond:
            while not lane.waiting:
                if self._closed:
                    return None
                self._cond.wait()
        leader = _dist.rank() == 0
        key = f"dcp_multilevel/lane/{lane.name}/{lane.started}"
        lane.started += 1
        chosen: tuple[_Waiting, list[_Waiting]] | None = None
        try:
            if leader:
                with self._cond:
                    pick = len(lane.waiting) - 1 if self.policy == "latest" else 0
                    chosen = self._take(lane, lane.waiting[pick].job.drain_id)
                picked = chosen[0]
                before = [
                    b
                    for b in picked.job.before
                    if b.step not in picked.recheck or not _committed(b)
                ]
                if _dist.world_size() > 1:
                    _dist.store_set(
                        key,
                        {"drain": chosen[0].job.drain_id, "before": [b.drain_id for b in before]},
                    )
            else:
                (value,) = _dist.store_wait_get([key], self.timeout_s)
                chosen = self._take_when_submitted(lane, value["drain"])
                before = [b for b in chosen[0].job.before if b.drain_id in value["before"]]
        except Exception as e:  # noqa: BLE001 - the lane must go on and wait() must hear of it
            self._fail_waiting(lane, e, [] if chosen is None else [chosen[0], *chosen[1]])
            return self._next(lane)
        entry, superseded = chosen
        for old in superseded:
            result = DrainResult(old.job.step, old.job.target.url, superseded_by=entry.job.step)
            logger.info(
                "dcp_multilevel: step %d is not drained to %s: step %d, due there too, replaces it",
                old.job.step,
                old.job.target.url,
                entry.job.step,
            )
            self._record(result)
            old.future.set_result(result)
        entry.queued_seconds = time.perf_counter() - entry.since
        entry.job = replace(entry.job, before=tuple(before))
        return entry

    def _take(self, lane: _Lane, drain_id: str) -> tuple[_Waiting, list[_Waiting]]:
        """Under the lock: make the waiting job ``drain_id`` the running one; return it
        and the waiting jobs before it (superseded)."""
        ids = [e.job.drain_id for e in lane.waiting]
        pick = ids.index(drain_id)
        entry, superseded = lane.waiting[pick], lane.waiting[:pick]
        del lane.waiting[: pick + 1]
        lane.running = entry
        return entry, superseded

    def _take_when_submitted(self, lane: _Lane, drain_id: str) -> tuple[_Waiting, list[_Waiting]]:
        """:meth:`_take` once this rank's main thread submitted ``drain_id`` (rank 0's
        lane may pick a job before this rank's save returned)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while drain_id not in {e.job.drain_id for e in lane.waiting}:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DrainError(
                        f"rank 0 chose drain {drain_id}, which this rank was "
                        f"not given within {self.timeout_s:.0f} s"
                    )
                self._cond.wait(left)
            return self._take(lane, drain_id)

    def _fail_waiting(self, lane: _Lane, error: Exception, taken: list[_Waiting]) -> None:
        """The ranks could not agree on the lane's next job: fail it (``taken``: what
        this rank had already taken for it) and everything waiting there."""
        with self._cond:
            failed, lane.waiting = [*taken, *lane.waiting], []
            lane.running = None
            self._cond.notify_all()
        why = f"the ranks could not agree which drain runs next ({type(error).__name__}: {error})"
        logger.error("dcp_multilevel: lane %s: %s", lane.name, why)
        for entry in failed:
            result = DrainResult(entry.job.step, entry.job.target.url, error=why)
            self._record(result)
            entry.future.set_result(result)

    def _run(self, job: DrainJob, queued_seconds: float = 0.0) -> DrainResult:
        """Run ``job`` (after the jobs it needs first) and record its result."""
        for first in job.before:
            done = self._run(first)
            if done.committed:
                continue
            if done.error is None:  # skipped (another world size): so is this one
                result = DrainResult(job.step, job.target.url, skipped=True)
            else:
                result = DrainResult(
                    job.step,
                    job.target.url,
                    error=f"step {first.step}, which it needs there, was not "
                    f"copied first ({done.error})",
                )
            self._record(result)
            return result
        t0 = time.perf_counter()
        try:
            result = run_one(job, timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure must reach wait() and metrics
            result = DrainResult(job.step, job.target.url, error=f"{type(e).__name__}: {e}")
            logger.error(
                "dcp_multilevel: drain of step %d to %s failed: %s",
                job.step,
                job.target.url,
                result.error,
            )
        result.seconds = time.perf_counter() - t0
        result.queued_seconds = queued_seconds
        self._record(result)
        if result.committed and self._on_committed is not None:
            self._on_committed(job)
        return result

    def _record(self, result: DrainResult) -> None:
        with self._cond:
            self._results.append(result)
            if result.error:
                self._unreported.append(result)
        if self._on_result is not None:
            self._on_result(result)


def _committed(job: DrainJob) -> bool:
    """Whether ``job``'s step is committed on its target already, as rank 0 sees it
    (a reference that an earlier drain, still running when the job was submitted,
    has brought there since). Unreadable counts as not there: send it."""
    try:
        return job.target.checkpoint(job.step).is_committed()
    except (OSError, DcpMultilevelError):
        return False

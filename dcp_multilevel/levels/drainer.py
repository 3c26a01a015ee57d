"""Drains in the background: one worker per target level, a skip-or-wait policy.

A drain brings one committed checkpoint of the first level onto a higher
level; *how* is the level's driver's (``LevelDriver.drain``); this module
runs drains, one at a time per level, and keeps their outcomes.

Call order (driven by :class:`~dcp_multilevel.manager.CheckpointManager`)::

    every rank, main thread   drainer.submit(job)       after the first level's commit
    every rank, background    run_drain(job)             the source manifest shared
                              through the link (rank 0 reads it), then
                              job.target.drain(job, manifest, link)
    any thread                drainer.wait()             raises DrainError

One worker per target level: at most one drain per level is in flight. When
a save asks for a drain while one is running on that level, ``policy``
decides: ``"skip"`` (default: this step is not copied there, and the result
says so) or ``"wait"`` (the caller blocks until the running drain ends). A
drain's ranks agree only through a :class:`~.link.DrainLink` (the c10d
store), never the trainer's process group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, DrainError
from .base import DrainJob, DrainResult, LevelDriver
from .link import DrainLink

__all__ = ["DRAIN_POLICIES", "Drainer", "run_drain"]

logger = logging.getLogger(__name__)

#: What a save does when its level's previous drain is still running.
DRAIN_POLICIES = ("skip", "wait")


def run_drain(job: DrainJob, *, timeout_s: float) -> DrainResult:
    """Run this rank's part of ``job`` (every rank calls it for the same job).

    Every failure is told to the other ranks through the link, so no rank
    waits out ``timeout_s`` for a peer that already failed.
    """
    link = DrainLink(job.drain_id, timeout_s)
    try:
        raw = link.share_manifest(job.source.manifest_bytes, job.source.url)
        source = StoredCheckpoint(job.source.store, location=job.source.location,
                                  manifest_bytes=raw)  # fmt: skip
        manifest = source.manifest()
        return job.target.drain(replace(job, source=source), manifest, link)
    except Exception as e:
        link.fail(e)
        raise


class Drainer:
    """Runs drains in the background, one worker per target level."""

    def __init__(
        self,
        *,
        policy: str = "skip",
        timeout_s: float = 3600.0,
        on_committed: Callable[[DrainJob], None] | None = None,
        on_result: Callable[[DrainResult], None] | None = None,
    ) -> None:
        """``on_committed(job)`` runs in the drain's worker thread after a commit;
        ``on_result(result)`` after every drain (also failed and skipped ones),
        in the thread that decided it."""
        if policy not in DRAIN_POLICIES:
            raise ConfigError(f"drain_policy must be 'skip' or 'wait', got {policy!r}")
        self.policy = policy
        self.timeout_s = timeout_s
        self._on_committed = on_committed
        self._on_result = on_result
        self._workers: dict[LevelDriver, ThreadPoolExecutor] = {}
        # target level -> (source step, future) of the drain running there
        self._inflight: dict[LevelDriver, tuple[tuple[int, ...], Future[DrainResult]]] = {}
        self._lock = threading.Lock()
        self.results: list[DrainResult] = []
        self._unreported: list[DrainResult] = []

    def busy(self, target: LevelDriver) -> bool:
        """True while a drain to ``target`` is running."""
        with self._lock:
            _, running = self._inflight.get(target, (None, None))
        return running is not None and not running.done()

    def finish(self, target: LevelDriver) -> None:
        """Block until the drain running to ``target`` (if any) ended.

        Its errors are not raised here; :meth:`wait` reports them.
        """
        with self._lock:
            _, running = self._inflight.get(target, (None, None))
        if running is not None:
            running.result()  # _run catches every error: this never raises

    def submit(self, job: DrainJob, *, skip: bool | None = None) -> Future[DrainResult] | None:
        """Start ``job`` in the background; None when it is skipped.

        ``skip``: None lets this Drainer's policy decide (skip, or wait for the
        running drain, when one is running on the level). With several ranks the
        decision must be the same everywhere (a drain needs every rank's share),
        so the manager takes rank 0's decision and passes it: True skips; False
        runs, after waiting for a running drain.
        """
        if skip is None:
            skip = self.policy == "skip" and self.busy(job.target)
        if skip:
            result = DrainResult(job.step, job.target.url, skipped=True)
            logger.warning(
                "dcp_multilevel: step %d not copied to %s: the drain of an earlier step "
                "is still running (policy 'skip')", job.step, job.target.url,
            )  # fmt: skip
            self._record(result)
            return None
        self.finish(job.target)
        worker = self._workers.get(job.target)
        if worker is None:
            worker = self._workers[job.target] = ThreadPoolExecutor(
                1, thread_name_prefix=f"dcp-ml-drain-{len(self._workers) + 1}"
            )
        future = worker.submit(self._run, job)
        with self._lock:
            refs = () if job.reference is None else (job.reference,)
            firsts = tuple(j.step for j in job.before)
            self._inflight[job.target] = ((job.step, *refs, *firsts), future)
        return future

    def inflight_steps(self) -> set[int]:
        """Source steps being drained right now, and the steps those drains code deltas
        against (read from the source level too): retention must not delete them."""
        with self._lock:
            return {s for steps, f in self._inflight.values() if not f.done() for s in steps}

    def wait(self) -> list[DrainResult]:
        """Block until every drain ended; raise DrainError for any that failed since last time."""
        with self._lock:
            futures = [f for _, f in self._inflight.values()]
        for f in futures:
            f.result()
        with self._lock:
            failed = [r for r in self._unreported if r.error]
            self._unreported.clear()
        if failed:
            raise DrainError(
                "; ".join(f"step {r.step} to {r.level}: {r.error}" for r in failed)
                + ". The first level still holds these checkpoints."
            )
        return list(self.results)

    def close(self) -> None:
        """Stop the workers after the drains they run (call :meth:`wait` first for errors)."""
        for worker in self._workers.values():
            worker.shutdown(wait=True)

    def _run(self, job: DrainJob) -> DrainResult:
        for first in job.before:
            done = self._run(first)
            if done.committed:
                continue
            if done.error is None:  # skipped (another world size): so is this one
                result = DrainResult(job.step, job.target.url, skipped=True)
            else:
                result = DrainResult(job.step, job.target.url,
                                     error=f"step {first.step}, which it needs there, was not "
                                           f"copied first ({done.error})")  # fmt: skip
            self._record(result)
            return result
        t0 = time.perf_counter()
        try:
            result = run_drain(job, timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure must reach wait() and metrics
            result = DrainResult(job.step, job.target.url, error=f"{type(e).__name__}: {e}")
            logger.error("dcp_multilevel: drain of step %d to %s failed: %s",
                         job.step, job.target.url, result.error)  # fmt: skip
        result.seconds = time.perf_counter() - t0
        self._record(result)
        if result.committed and self._on_committed is not None:
            self._on_committed(job)
        return result

    def _record(self, result: DrainResult) -> None:
        with self._lock:
            self.results.append(result)
            self._unreported.append(result)
        if self._on_result is not None:
            self._on_result(result)

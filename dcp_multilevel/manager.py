"""CheckpointManager: multi-level saves, the newest complete checkpoint, retention.

Call order (every rank, main thread; the same steps on every rank)::

    mgr = CheckpointManager(tiers=[Tier(local, every=1, keep=2), Tier(remote, every=4)])
    step = mgr.load_latest(state_dict)   # None on a fresh start; resumes drains left behind
    mgr.save(state_dict, step=s)          # returns once the first tier committed;
                                          # due higher tiers are drained in the background
    mgr.wait()                            # drains done; DrainError if one failed
    mgr.close()                           # also run at interpreter exit (errors logged)

A checkpoint exists on a tier iff ``<tier>/step-<N>/manifest.json`` exists.
The first tier may be node-local: then only rank 0's node has the manifest.
Loading agrees, collectively, on the newest step every rank can read: rank 0
(or the lowest rank that has it) sends the first tier's manifest to all, and
a rank can read the step if a higher tier holds it or its own view of the
first tier has every data file; each rank then reads its files from the
first tier and the rest, file by file, from the higher tiers.

Retention runs on rank 0: for the first tier after each save (local listing
only; the other ranks then remove the same steps from their own view), for a
higher tier in its drain worker after each commit there, so a
slow or unreachable remote never stalls ``save``. On each tier keep the newest
``keep`` complete checkpoints; on the first tier, never delete a checkpoint
that is being drained or not known to be on a higher tier that is due to hold
it (a remote outage therefore grows the first tier instead of losing data);
never delete the newest complete checkpoint. A checkpoint is deleted manifest
first, so a half-deleted one is invisible, and directories without a manifest
older than the newest complete checkpoint are swept as abandoned. At
construction, temporary files of crashed writers (``*.tmp-*`` on a local
tier, spool files of dead processes) older than ``sweep_older_than_s`` go too.
"""

from __future__ import annotations

import atexit
import logging
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from . import _dist
from .config import Tier
from .errors import CheckpointNotFoundError, ConfigError, DcpMultilevelError, DrainError
from .flush import Drainer, DrainJob, DrainResult
from .format import DATA_DIR, MANIFEST_NAME, decode_manifest
from .metrics import MetricsSink, SaveMetrics
from .planner import BalancedSavePlanner
from .reader import MultiLevelReader
from .stores import store_for
from .writer import MultiLevelWriter

__all__ = ["CheckpointManager", "SaveMetrics"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointManager:
    """Saves to several tiers with their own intervals and retention; loads the newest.

    Args:
        tiers: fastest first. The first takes every save (``every=1``). It may
            be node-local (each node sees only its own ranks' files; only rank
            0's node has the manifest): drains and loads work, provided a higher
            tier holds what a node cannot see.
        planner: save planner (default: one :class:`BalancedSavePlanner`, reused
            so DCP's plan cache works across saves).
        drain_policy: ``"skip"`` or ``"wait"`` when a save is due on a tier whose
            previous drain is still running (see ``flush.py``).
        drain_timeout_s: how long rank 0 waits for the other ranks' share of a drain.
        metrics_path: append every save's and drain's metrics record to this
            JSON-lines file (see ``metrics.py``; ``{rank}`` in the path gives each
            rank its own file, otherwise only rank 0 writes).
        on_metrics: called with every metrics record (a dict) on every rank;
            drain records arrive from the drain's background thread.
        sweep_older_than_s: at construction, temporary files older than this
            (crash leftovers: the first tier's ``*.tmp-*``, remote tiers' spool
            files of dead processes) are removed; None: no sweep.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        planner: SavePlanner | None = None,
        drain_policy: str = "skip",
        drain_timeout_s: float = 3600.0,
        metrics_path: str | None = None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
        sweep_older_than_s: float | None = 3600.0,
    ) -> None:
        self.tiers = list(tiers)
        if not self.tiers or not all(isinstance(t, Tier) for t in self.tiers):
            raise ConfigError("CheckpointManager needs a non-empty list of Tier(...) objects")
        if self.tiers[0].every != 1:
            raise ConfigError(
                f"the first tier ({self.tiers[0].url}) must take every save (every=1): save() "
                "returns once it is committed there, and higher tiers are copied from it"
            )
        self._backends = [store_for(t.url, **t.storage_options) for t in self.tiers]
        self._planner = planner or BalancedSavePlanner()
        self._sink = MetricsSink(metrics_path, on_metrics, _dist.rank())
        self._drainer = Drainer(
            policy=drain_policy, timeout_s=drain_timeout_s, on_committed=self._drained,
            on_result=lambda r: self._sink.emit(r.record(_dist.rank())),
        )  # fmt: skip
        # Steps known to be committed on each higher tier (from drains and from
        # load_latest's listing): first-tier retention consults this, never the
        # remote itself, so a slow or unreachable remote cannot stall save().
        self._known: dict[int, set[int]] = {i: set() for i in range(len(self.tiers))}
        self._generation = 0
        self._skipped: dict[int, set[int]] = {i: set() for i in range(len(self.tiers))}
        self.metrics: list[SaveMetrics] = []
        self.last_load_sources: dict[str, int] = {}
        if sweep_older_than_s is not None:
            self._sweep(sweep_older_than_s)
        # Drains must not be lost silently at exit: wait for them and log failures.
        self._exit_hook = weakref.finalize(self, _finish_at_exit, self._drainer)
        atexit.register(self._exit_hook)

    def _sweep(self, older_than_s: float) -> None:
        """Remove crash leftovers: local temporaries and spool files (local listings only)."""
        for tier, backend in zip(self.tiers, self._backends, strict=True):
            try:
                backend.sweep(older_than_s)
            except OSError as e:  # housekeeping: never stops a run from starting
                logger.warning("dcp_multilevel: sweeping %s failed: %s", tier.url, e)

    # ------------------------------------------------------------------ save

    def save(self, state_dict: dict[str, Any], step: int) -> SaveMetrics:
        """Save ``state_dict`` as ``step``; return once the first tier has committed it.

        Collective (every rank, same step).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        first = self.tiers[0]
        url = first.checkpoint_url(step)
        writer = MultiLevelWriter(url, codec=first.codec, storage_options=first.storage_options)
        t0 = time.perf_counter()
        dcp.save(state_dict, storage_writer=writer, planner=self._planner)
        blocked = time.perf_counter() - t0
        committed = time.time()
        self._generation += 1
        metrics = SaveMetrics(step, first.url, writer.bytes_written, blocked)
        due = [i for i in range(1, len(self.tiers)) if self.tiers[i].due(step)]
        # Rank 0 decides which drains to skip (policy "skip", previous drain still
        # running) and applies first-tier retention from its listing (its node
        # has the manifests); every rank follows: a drain needs every rank's
        # share, and a node-local first tier holds every node's files apart.
        skip: list[int] = []
        removed: list[str] = []
        if _dist.rank() == 0:
            skip = [i for i in due if self._drainer.policy == "skip" and self._drainer.busy(i)]
            for i in due:
                if i not in skip:
                    self._drainer.finish(i)  # policy "wait": retention then knows its outcome
            removed = self._retain(0)  # local listing only; higher tiers: after their drains
        if _dist.world_size() > 1:
            skip, removed = _dist.broadcast_object((skip, removed), 0)
            if _dist.rank() != 0:
                for name in removed:
                    self._backends[0].remove_tree(name)
        for i in due:
            tier = self.tiers[i]
            job = DrainJob(step, url, dict(first.storage_options), tier, i,
                           f"{i}-{step}-{self._generation}", committed)  # fmt: skip
            if self._drainer.submit(job, skip=i in skip) is None:
                self._skipped[i].add(step)
                metrics.drains_skipped.append(tier.url)
            else:
                metrics.drains_started.append(tier.url)
        metrics.waited_seconds = time.perf_counter() - t0 - blocked
        self.metrics.append(metrics)
        logger.info(
            "dcp_multilevel: step %d committed on %s in %.3f s (%.2f GB/s on this rank); "
            "draining to %s", step, first.url, blocked, metrics.gbps,
            metrics.drains_started or "no tier",
        )  # fmt: skip
        self._sink.emit(metrics.record(_dist.rank()))
        return metrics

    # ------------------------------------------------------------------ load

    def steps(self, tier_index: int) -> list[int]:
        """Steps with a complete checkpoint on tier ``tier_index``, ascending."""
        backend = self._backends[tier_index]
        out = []
        for name in backend.listdir(""):
            m = _STEP_DIR.match(name)
            if m and backend.exists(f"{name}/{MANIFEST_NAME}"):
                out.append(int(m.group(1)))
        return sorted(out)

    def load_latest(
        self, state_dict: dict[str, Any], *, planner: LoadPlanner | None = None
    ) -> int | None:
        """Load the newest checkpoint every rank can reach; None if there is none.

        Collective. Raises CheckpointNotFoundError when checkpoints exist but
        none is readable by every rank (never a silent fresh start).
        Afterwards, checkpoints a higher tier is due to hold but does not (a
        drain killed with the previous run) are drained again.
        """
        views = self._views()
        everyone = _dist.all_gather_object(views)
        for i in range(1, len(self.tiers)):
            self._known[i].update(everyone[0][i])
        candidates = sorted(set().union(*(set(s) for v in everyone for s in v.values())))
        for step in reversed(candidates):
            manifest, reachable = self._reachable(step, views, everyone)
            if reachable:
                self._load(state_dict, step, views, manifest, planner)
                self._resume_drains(everyone[0])
                return step
        if candidates:
            # Checkpoints exist but no rank set can read them all: never a silent fresh start.
            raise CheckpointNotFoundError(
                f"committed checkpoints exist (newest: step {candidates[-1]}), but for each of "
                f"them some rank cannot reach all of its data files on {self.tiers[0].url} (a "
                "node-local tier on a lost or new node?) and no higher tier holds it. Restore "
                "the nodes' disks, or start fresh deliberately with a new tier location.",
                checkpoint=self.tiers[0].checkpoint_url(candidates[-1]),
            )
        return None

    def load(
        self, state_dict: dict[str, Any], step: int, *, planner: LoadPlanner | None = None
    ) -> None:
        """Load ``step`` from the fastest tier holding it; CheckpointNotFoundError if none.

        Collective.
        """
        views = self._views()
        everyone = _dist.all_gather_object(views)
        if not any(step in v[i] for v in everyone for i in v):
            raise CheckpointNotFoundError(
                f"step {step} has no complete checkpoint on any tier ("
                + "; ".join(f"{t.url}: {views[i][-3:] or 'none'}" for i, t in enumerate(self.tiers))
                + " are the newest there). Refusing to start fresh silently: pick an existing "
                "step or call load_latest().",
                checkpoint=self.tiers[0].checkpoint_url(step),
            )
        manifest, reachable = self._reachable(step, views, everyone)
        if not reachable:
            raise CheckpointNotFoundError(
                f"step {step} is committed on {self.tiers[0].url}, but not every rank can reach "
                "all of its data files there (a node-local tier on a lost or new node?) and no "
                "higher tier holds it. Load an earlier step that a higher tier holds.",
                checkpoint=self.tiers[0].checkpoint_url(step),
            )
        self._load(state_dict, step, views, manifest, planner)

    def _views(self) -> dict[int, list[int]]:
        return {i: self.steps(i) for i in range(len(self.tiers))}

    def _reachable(
        self, step: int, views: dict[int, list[int]], everyone: list[dict[int, list[int]]]
    ) -> tuple[bytes | None, bool]:
        """(first-tier manifest, whether every rank can read ``step``). Collective.

        A step committed on the first tier (its manifest on some node) is sent
        from the lowest rank that has it to all. A rank can read the step if a
        higher tier it sees holds it, or if all data files the manifest names
        are in its own view of the first tier (shared, or one node).
        """
        holders = [r for r, v in enumerate(everyone) if step in v[0]]
        manifest: bytes | None = None
        if holders:
            mine = None
            if _dist.rank() == holders[0]:
                mine = self._read_first_manifest(step)
            manifest = _dist.broadcast_object(mine, holders[0])
        ok = any(step in views[i] for i in range(1, len(self.tiers)))
        if not ok and manifest is not None:
            ok = self._first_has_files(step, manifest)
        return manifest, all(_dist.all_gather_object(ok))

    def _read_first_manifest(self, step: int) -> bytes | None:
        try:
            return self._backends[0].read_bytes(f"step-{step}/{MANIFEST_NAME}")
        except OSError as e:  # deleted since listing: this step is not on the first tier
            logger.warning("dcp_multilevel: cannot read the manifest of step %d: %s", step, e)
            return None

    def _first_has_files(self, step: int, manifest: bytes) -> bool:
        try:
            files = decode_manifest(manifest, checkpoint=self.tiers[0].checkpoint_url(step)).files
        except DcpMultilevelError:
            return False
        here = {f"{DATA_DIR}/{n}" for n in self._backends[0].listdir(f"step-{step}/{DATA_DIR}")}
        return set(files) <= here

    def _load(self, state_dict, step: int, views, manifest: bytes | None, planner) -> None:
        # The first tier serves what this rank sees there; the rest comes, file
        # by file, from the higher tiers (the reader's per-item fallback).
        order = [0] if manifest is not None else []
        order += [i for i in range(1, len(self.tiers)) if step in views[i]]
        tiers = [self.tiers[i] for i in order]
        reader = MultiLevelReader(
            tiers[0].checkpoint_url(step),
            fallbacks=[t.checkpoint_url(step) for t in tiers[1:]],
            storage_options=tiers[0].storage_options,
            fallback_storage_options=[t.storage_options for t in tiers[1:]],
            primary_manifest=manifest if order[0] == 0 else None,
        )
        dcp.load(state_dict, storage_reader=reader, planner=planner)
        self.last_load_sources = dict(reader.last_load_sources)

    def _resume_drains(self, view: dict[int, list[int]]) -> None:
        first = view[0]
        for i, tier in enumerate(self.tiers[1:], start=1):
            newest_there = max(view[i], default=-1)
            pending = [s for s in first if tier.due(s) and s > newest_there]
            if pending:
                step = pending[-1]
                self._generation += 1
                logger.info("dcp_multilevel: resuming the drain of step %d to %s", step, tier.url)
                # skip=False: the same decision on every rank (wait for a running drain).
                self._drainer.submit(DrainJob(
                    step, self.tiers[0].checkpoint_url(step), dict(self.tiers[0].storage_options),
                    tier, i, f"{i}-{step}-{self._generation}-resume", time.time(),
                ), skip=False)  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    @property
    def drain_results(self) -> list[DrainResult]:
        """Every drain's outcome on this rank so far (bytes, seconds, lag, errors, skips)."""
        return list(self._drainer.results)

    def wait(self) -> list[DrainResult]:
        """Wait for running drains; DrainError if any failed since the last call."""
        return self._drainer.wait()

    def _drained(self, job: DrainJob) -> None:
        """In the drain worker, after a commit: remember it; rank 0 applies retention there."""
        self._known[job.tier_index].add(job.step)
        if _dist.rank() == 0:
            try:
                self._retain(job.tier_index)
            except OSError as e:  # retention is housekeeping: the drain itself succeeded
                logger.warning("dcp_multilevel: retention on %s failed: %s", job.target.url, e)

    def close(self) -> None:
        """Wait for drains (raising their errors), then stop the workers."""
        try:
            self.wait()
        finally:
            self._drainer.close()
            self._exit_hook.detach()

    # ------------------------------------------------------------------ retention

    def _retain(self, index: int) -> list[str]:
        """Apply retention on tier ``index`` (rank 0); return the names removed."""
        tier, backend = self.tiers[index], self._backends[index]
        complete = self.steps(index)
        removed: list[str] = []
        if not complete:
            return removed
        protected = self._drainer.inflight_steps() | {complete[-1]}
        if index == 0:
            # Not yet known to be on a tier it is due for: keep it (a remote outage
            # grows the first tier rather than losing the only copy).
            for j, higher in enumerate(self.tiers[1:], start=1):
                protected |= {
                    s for s in complete
                    if higher.due(s) and s not in self._known[j] and s not in self._skipped[j]
                }  # fmt: skip
        keep = set(complete[-tier.keep :]) if tier.keep else set(complete)
        for step in complete:
            if step not in keep and step not in protected:
                backend.remove_tree(f"step-{step}/{MANIFEST_NAME}")  # uncommit first
                backend.remove_tree(f"step-{step}")
                removed.append(f"step-{step}")
                logger.info("dcp_multilevel: retention removed step %d from %s", step, tier.url)
        newest = complete[-1]
        for name in backend.listdir(""):
            m = _STEP_DIR.match(name)
            old = m is not None and int(m.group(1)) < newest and int(m.group(1)) not in protected
            if old and not backend.exists(f"{name}/{MANIFEST_NAME}"):
                backend.remove_tree(name)  # abandoned by a crashed save or drain
                removed.append(name)
        return removed


def _finish_at_exit(drainer: Drainer) -> None:
    try:
        drainer.wait()
    except DrainError as e:
        logger.error("dcp_multilevel: at exit, checkpoint drains had failed: %s", e)
    finally:
        drainer.close()

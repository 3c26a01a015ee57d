"""CheckpointManager: multi-level saves, the newest complete checkpoint, retention.

Call order (every rank, main thread; the same steps on every rank)::

    mgr = CheckpointManager(tiers=[Tier(local, every=1, keep=2), Tier(remote, every=4)])
    step = mgr.load_latest(state_dict)   # None on a fresh start; resumes drains left behind
    mgr.save(state_dict, step=s)          # returns once the first tier committed;
                                          # due higher tiers are drained in the background
    mgr.wait()                            # drains done; DrainError if one failed
    mgr.close()                           # also run at interpreter exit (errors logged)

A checkpoint exists on a tier iff ``<tier>/step-<N>/manifest.json`` exists.
Retention runs on rank 0: for the first tier after each save (local listing
only), for a higher tier in its drain worker after each commit there, so a
slow or unreachable remote never stalls ``save``. On each tier keep the newest
``keep`` complete checkpoints; on the first tier, never delete a checkpoint
that is being drained or not known to be on a higher tier that is due to hold
it (a remote outage therefore grows the first tier instead of losing data);
never delete the newest complete checkpoint. A checkpoint is deleted manifest
first, so a half-deleted one is invisible, and directories without a manifest
older than the newest complete checkpoint are swept as abandoned.
"""

from __future__ import annotations

import atexit
import logging
import re
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from . import _dist
from .config import Tier
from .errors import CheckpointNotFoundError, ConfigError, DrainError
from .flush import Drainer, DrainJob, DrainResult
from .format import MANIFEST_NAME
from .planner import BalancedSavePlanner
from .reader import MultiLevelReader
from .tiers import tier_for
from .writer import MultiLevelWriter

__all__ = ["CheckpointManager", "SaveMetrics"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class SaveMetrics:
    """One ``save`` on this rank: what blocked training, and what was sent where."""

    step: int
    tier: str
    bytes_written: int
    blocked_seconds: float
    drains_started: list[str] = field(default_factory=list)
    drains_skipped: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.blocked_seconds / 1e9 if self.blocked_seconds else 0.0


class CheckpointManager:
    """Saves to several tiers with their own intervals and retention; loads the newest.

    Args:
        tiers: fastest first. The first takes every save (``every=1``).
        planner: save planner (default: one :class:`BalancedSavePlanner`, reused
            so DCP's plan cache works across saves).
        drain_policy: ``"skip"`` or ``"wait"`` when a save is due on a tier whose
            previous drain is still running (see ``flush.py``).
        drain_timeout_s: how long rank 0 waits for the other ranks' share of a drain.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        planner: SavePlanner | None = None,
        drain_policy: str = "skip",
        drain_timeout_s: float = 3600.0,
    ) -> None:
        self.tiers = list(tiers)
        if not self.tiers or not all(isinstance(t, Tier) for t in self.tiers):
            raise ConfigError("CheckpointManager needs a non-empty list of Tier(...) objects")
        if self.tiers[0].every != 1:
            raise ConfigError(
                f"the first tier ({self.tiers[0].url}) must take every save (every=1): save() "
                "returns once it is committed there, and higher tiers are copied from it"
            )
        self._backends = [tier_for(t.url, **t.storage_options) for t in self.tiers]
        self._planner = planner or BalancedSavePlanner()
        self._drainer = Drainer(
            policy=drain_policy, timeout_s=drain_timeout_s, on_committed=self._drained
        )
        # Steps known to be committed on each higher tier (from drains and from
        # load_latest's listing): first-tier retention consults this, never the
        # remote itself, so a slow or unreachable remote cannot stall save().
        self._known: dict[int, set[int]] = {i: set() for i in range(len(self.tiers))}
        self._generation = 0
        self._skipped: dict[int, set[int]] = {i: set() for i in range(len(self.tiers))}
        self.metrics: list[SaveMetrics] = []
        self.last_load_sources: dict[str, int] = {}
        # Drains must not be lost silently at exit: wait for them and log failures.
        self._exit_hook = weakref.finalize(self, _finish_at_exit, self._drainer)
        atexit.register(self._exit_hook)

    # ------------------------------------------------------------------ save

    def save(self, state_dict: dict[str, Any], step: int) -> SaveMetrics:
        """Save ``state_dict`` as ``step``; return once the first tier has committed it."""
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
        for i, tier in enumerate(self.tiers[1:], start=1):
            if tier.due(step):
                job = DrainJob(step, url, dict(first.storage_options), tier, i,
                               f"{i}-{step}-{self._generation}", committed)  # fmt: skip
                if self._drainer.submit(job) is None:
                    self._skipped[i].add(step)
                    metrics.drains_skipped.append(tier.url)
                else:
                    metrics.drains_started.append(tier.url)
        if _dist.rank() == 0:
            self._retain(0)  # local listing only; higher tiers: after their drains
        self.metrics.append(metrics)
        logger.info(
            "dcp_multilevel: step %d committed on %s in %.3f s (%.2f GB/s on this rank); "
            "draining to %s", step, first.url, blocked, metrics.gbps,
            metrics.drains_started or "no tier",
        )  # fmt: skip
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

        Collective. Afterwards, checkpoints a higher tier is due to hold but does
        not (a drain killed with the previous run) are drained again.
        """
        views = self._views()
        everyone = _dist.all_gather_object(views)
        common: set[int] | None = None
        for view in everyone:
            visible = set().union(*map(set, view.values()))
            common = visible if common is None else common & visible
        if not common:
            return None
        step = max(common)
        for i in range(1, len(self.tiers)):
            self._known[i].update(everyone[0][i])
        self._load(state_dict, step, views, planner)
        self._resume_drains(everyone[0])
        return step

    def load(
        self, state_dict: dict[str, Any], step: int, *, planner: LoadPlanner | None = None
    ) -> None:
        """Load ``step`` from the fastest tier holding it; CheckpointNotFoundError if none."""
        self._load(state_dict, step, self._views(), planner)

    def _views(self) -> dict[int, list[int]]:
        return {i: self.steps(i) for i in range(len(self.tiers))}

    def _load(self, state_dict, step: int, views, planner) -> None:
        order = [i for i in range(len(self.tiers)) if step in views[i]]
        if not order:
            raise CheckpointNotFoundError(
                f"step {step} has no complete checkpoint on any tier ("
                + "; ".join(f"{t.url}: {views[i][-3:] or 'none'}" for i, t in enumerate(self.tiers))
                + " are the newest there). Refusing to start fresh silently: pick an existing "
                "step or call load_latest().",
                checkpoint=self.tiers[0].checkpoint_url(step),
            )
        tiers = [self.tiers[i] for i in order]
        reader = MultiLevelReader(
            tiers[0].checkpoint_url(step),
            fallbacks=[t.checkpoint_url(step) for t in tiers[1:]],
            storage_options=tiers[0].storage_options,
            fallback_storage_options=[t.storage_options for t in tiers[1:]],
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
                self._drainer.submit(DrainJob(
                    step, self.tiers[0].checkpoint_url(step), dict(self.tiers[0].storage_options),
                    tier, i, f"{i}-{step}-{self._generation}-resume", time.time(),
                ))  # fmt: skip

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

    def _retain(self, index: int) -> None:
        tier, backend = self.tiers[index], self._backends[index]
        complete = self.steps(index)
        if not complete:
            return
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
                logger.info("dcp_multilevel: retention removed step %d from %s", step, tier.url)
        newest = complete[-1]
        for name in backend.listdir(""):
            m = _STEP_DIR.match(name)
            old = m is not None and int(m.group(1)) < newest and int(m.group(1)) not in protected
            if old and not backend.exists(f"{name}/{MANIFEST_NAME}"):
                backend.remove_tree(name)  # abandoned by a crashed save or drain


def _finish_at_exit(drainer: Drainer) -> None:
    try:
        drainer.wait()
    except DrainError as e:
        logger.error("dcp_multilevel: at exit, checkpoint drains had failed: %s", e)
    finally:
        drainer.close()

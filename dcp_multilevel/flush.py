"""Background drain of committed checkpoints from the first tier to higher tiers.

A drain copies one committed checkpoint (``<tier0>/step-N``) to a higher tier
(``<tierK>/step-N``), re-encoding items when the tiers use different codecs.

Call order (driven by :class:`~dcp_multilevel.manager.CheckpointManager`)::

    every rank, main thread   Drainer.submit(job)         # after the L1 commit
    rank 0, background        read the source manifest, publish it in the c10d store
    rank != 0, background     take the source manifest from the store
    every rank, background    copy this rank's data files (data/<rank>-*) from its
                              own view of the first tier, verifying every item's
                              checksum on the way (``_transfer.py``: verbatim when
                              the codecs agree, re-encoded otherwise)
    rank != 0, background     publish its new item locations in the c10d store
    rank 0, background        wait for every rank's locations, then write the
                              target manifest last (the commit on that tier),
                              and publish the outcome; the other ranks' drains
                              end only then, so wait() means "committed" everywhere
    any thread                Drainer.wait()              # raises DrainError

One worker per target tier: at most one drain per tier is in flight. When a
save asks for a drain while one is running on that tier, ``policy`` decides:
``"skip"`` (default: this step is not copied there, and the result says so)
or ``"wait"`` (the caller blocks until the running drain ends). Background
threads never use the trainer's process group (see ``_dist.py``).

The first tier may be node-local: a rank only reads the data files it wrote
itself, and the manifest comes from rank 0 through the store. (Restoring from
a node-local tier after losing a node needs a higher tier holding the step.)
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from . import _dist
from ._transfer import copy_rank_files
from .config import Compression, Tier
from .errors import DrainError
from .format import MANIFEST_NAME, ItemLocation, Manifest, decode_manifest, encode_manifest
from .stores import Store, store_for

__all__ = ["DrainJob", "DrainResult", "Drainer", "drain"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainJob:
    """Copy ``step`` from ``source`` (a checkpoint URL) to ``target`` (a tier)."""

    step: int
    source: str
    source_options: dict[str, Any]
    target: Tier
    tier_index: int
    drain_id: str  # identical on every rank for the same drain
    committed_unix: float  # when the source checkpoint was committed


@dataclass
class DrainResult:
    """What one drain did on this rank (metrics; the coordinator's says whether it committed)."""

    step: int
    tier: str
    bytes_stored: int = 0
    seconds: float = 0.0
    lag_seconds: float = 0.0  # source commit -> target commit (coordinator)
    committed: bool = False
    skipped: bool = False
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Bytes stored on the target per second of this rank's drain, in GB/s."""
        return self.bytes_stored / self.seconds / 1e9 if self.seconds else 0.0

    def record(self, rank: int) -> dict[str, Any]:
        """This drain as a metrics record (see ``metrics.py``)."""
        return {
            "kind": "drain", "rank": rank, "step": self.step, "tier": self.tier,
            "bytes": self.bytes_stored, "seconds": self.seconds, "gbps": self.gbps,
            "lag_seconds": self.lag_seconds, "committed": self.committed,
            "skipped": self.skipped, "error": self.error, **self.details,
            "unix": time.time(),
        }  # fmt: skip


class Drainer:
    """Runs drains in the background, one worker per target tier."""

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
        if policy not in ("skip", "wait"):
            raise ValueError(f"drain policy must be 'skip' or 'wait', got {policy!r}")
        self.policy = policy
        self.timeout_s = timeout_s
        self._on_committed = on_committed
        self._on_result = on_result
        self._workers: dict[int, ThreadPoolExecutor] = {}
        # tier index -> (source step, future) of the drain running there
        self._inflight: dict[int, tuple[int, Future[DrainResult]]] = {}
        self._lock = threading.Lock()
        self.results: list[DrainResult] = []
        self._unreported: list[DrainResult] = []

    def busy(self, tier_index: int) -> bool:
        """True while a drain to tier ``tier_index`` is running."""
        with self._lock:
            _, running = self._inflight.get(tier_index, (None, None))
        return running is not None and not running.done()

    def finish(self, tier_index: int) -> None:
        """Block until the drain running to tier ``tier_index`` (if any) ended.

        Its errors are not raised here; :meth:`wait` reports them.
        """
        with self._lock:
            _, running = self._inflight.get(tier_index, (None, None))
        if running is not None:
            running.result()  # _run catches every error: this never raises

    def submit(self, job: DrainJob, *, skip: bool | None = None) -> Future[DrainResult] | None:
        """Start ``job`` in the background; None when it is skipped.

        ``skip``: None lets this Drainer's policy decide (skip, or wait for the
        running drain, when one is running on the tier). With several ranks the
        decision must be the same everywhere (a drain needs every rank's share),
        so the manager takes rank 0's decision and passes it: True skips; False
        runs, after waiting for a running drain.
        """
        if skip is None:
            skip = self.policy == "skip" and self.busy(job.tier_index)
        if skip:
            result = DrainResult(job.step, job.target.url, skipped=True)
            logger.warning(
                "dcp_multilevel: step %d not copied to %s: the drain of an earlier step "
                "is still running (policy 'skip')", job.step, job.target.url,
            )  # fmt: skip
            self._record(result)
            return None
        self.finish(job.tier_index)
        worker = self._workers.get(job.tier_index)
        if worker is None:
            worker = self._workers[job.tier_index] = ThreadPoolExecutor(
                1, thread_name_prefix=f"dcp-ml-drain-{job.tier_index}"
            )
        future = worker.submit(self._run, job)
        with self._lock:
            self._inflight[job.tier_index] = (job.step, future)
        return future

    def inflight_steps(self) -> set[int]:
        """Source steps being drained right now (retention must not delete them)."""
        with self._lock:
            return {step for step, f in self._inflight.values() if not f.done()}

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
                "; ".join(f"step {r.step} to {r.tier}: {r.error}" for r in failed)
                + ". The first tier still holds these checkpoints."
            )
        return list(self.results)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)

    def _run(self, job: DrainJob) -> DrainResult:
        t0 = time.perf_counter()
        try:
            result = drain(job, timeout_s=self.timeout_s)
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


def _key(job: DrainJob, rank: int | str) -> str:
    return f"dcp_multilevel/drain/{job.drain_id}/{rank}"


def _publish(job: DrainJob, value: Any) -> None:
    _dist.store_set(_key(job, _dist.rank()), value)


def drain(job: DrainJob, *, timeout_s: float) -> DrainResult:
    """Copy this rank's share of ``job``; on rank 0 also commit the target manifest.

    Every failure is published in the store (a rank's own key, or rank 0's
    commit key), so no rank waits out the timeout for a peer that already failed.
    """
    rank, world = _dist.rank(), _dist.world_size()
    try:
        source = store_for(job.source, **job.source_options)
        manifest = _source_manifest(job, source, rank, world, timeout_s)
        target = store_for(job.target.checkpoint_url(job.step), **job.target.storage_options)
        token = uuid.uuid4().hex[:16]
        stats = copy_rank_files(
            manifest, source, target, rank, token, Compression.of(job.target.codec)
        )
        result = DrainResult(job.step, job.target.url, bytes_stored=stats.bytes_stored)
        result.details = {
            "bytes_read": stats.bytes_read,
            "files_verbatim": stats.files_verbatim,
            "files_encoded": stats.files_encoded,
        }
        locations, files = stats.locations, stats.files
        if rank == 0:
            _commit(job, manifest, target, locations, files, result, timeout_s)
        else:
            _publish(job, {"locations": _locations_to_json(locations), "files": files})
            # Done only once rank 0 committed: wait() then means "on the tier" everywhere.
            (outcome,) = _dist.store_wait_get([_key(job, "commit")], timeout_s)
            if "error" in outcome:
                raise DrainError(f"rank 0 could not commit: {outcome['error']}")
            result.committed = True
    except Exception as e:
        if world > 1:
            key = _key(job, "commit" if rank == 0 else rank)
            _dist.store_set(key, {"error": f"{type(e).__name__}: {e}"})
        raise
    if world > 1 and rank == 0:
        _dist.store_set(_key(job, "commit"), {"ok": True})
    return result


def _source_manifest(
    job: DrainJob, source: Store, rank: int, world: int, timeout_s: float
) -> Manifest:
    """The source checkpoint's manifest, as rank 0 reads it.

    Rank 0 publishes the manifest's bytes in the c10d store and the other ranks
    take them from there: with a node-local first tier only rank 0's node holds
    the manifest (every node holds its own ranks' data files), and even on a
    shared one all ranks then copy by the same manifest.
    """
    key = _key(job, "manifest")
    if world == 1:
        raw = source.read_bytes(MANIFEST_NAME)
    elif rank == 0:
        try:
            raw = source.read_bytes(MANIFEST_NAME)
        except Exception as e:
            _dist.store_set(key, {"error": f"{type(e).__name__}: {e}"})
            raise
        _dist.store_set(key, {"manifest": base64.b64encode(raw).decode("ascii")})
    else:
        (value,) = _dist.store_wait_get([key], timeout_s)
        if "error" in value:
            raise DrainError(
                f"rank 0 could not read the manifest of {source.url}: {value['error']}"
            )
        raw = base64.b64decode(value["manifest"])
    return decode_manifest(raw, checkpoint=source.url)


def _commit(job, manifest, target, locations, files, result, timeout_s) -> None:
    """Rank 0: merge every rank's locations and write the target manifest last."""
    world = _dist.world_size()
    if world > 1:
        others = _dist.store_wait_get([_key(job, r) for r in range(1, world)], timeout_s)
        for r, value in enumerate(others, start=1):
            if "error" in value:
                raise DrainError(f"rank {r} failed: {value['error']}")
            locations.update(_locations_from_json(value["locations"]))
            files.update(value["files"])
    missing = set(manifest.locations) - set(locations)
    if missing:
        raise DrainError(
            f"{len(missing)} items were copied by no rank (e.g. {next(iter(missing))})"
        )
    doc = encode_manifest(
        manifest.metadata, locations, files, save_id=manifest.save_id,
        world_size=manifest.world_size, created_unix=time.time(),
    )  # fmt: skip
    target.write_atomic(MANIFEST_NAME, doc)  # the commit on this tier
    result.committed = True
    result.bytes_stored = sum(files.values())
    result.lag_seconds = time.time() - job.committed_unix
    logger.info("dcp_multilevel: step %d committed on %s (%d bytes, lag %.2f s)",
                job.step, job.target.url, result.bytes_stored, result.lag_seconds)  # fmt: skip


def _locations_to_json(locations: dict[MetadataIndex, ItemLocation]) -> list[dict[str, Any]]:
    return [
        {"fqn": i.fqn, "offsets": None if i.offset is None else list(i.offset), "file": loc.file,
         "pos": loc.offset, "length": loc.length, "raw_length": loc.raw_length,
         "checksum": loc.checksum, "transforms": list(loc.transforms)}
        for i, loc in locations.items()
    ]  # fmt: skip


def _locations_from_json(items: list[dict[str, Any]]) -> dict[MetadataIndex, ItemLocation]:
    return {
        MetadataIndex(d["fqn"], d["offsets"]): ItemLocation(
            d["file"],
            d["pos"],
            d["length"],
            d["raw_length"],
            d["checksum"],
            tuple(d["transforms"]),
        )
        for d in items
    }

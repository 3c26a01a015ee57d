"""The store level: each rank copies its own files of a checkpoint to one URL.

Who sends which bytes where: every rank reads the data files it wrote on
the first level (from its own node's view) and writes them to this level's
store (``checkpoint/copy.py``: verbatim when the codecs agree, re-encoded
otherwise, every item verified on the way). Rank 0 then gathers every
rank's new item locations and writes this level's manifest last (the
commit). On a level with deltas (``Level.keyframe_every``), a drain given a
reference step codes tensor items against that checkpoint on this level,
reading its bytes from the first level's copy of the same save when that
one is still there; a reference that is missing here, or another save than
expected, makes the drain store the step whole (a keyframe). A failed
drain leaves objects that no manifest names; retention sweeps them, or the
next drain of the same step, which removes what its manifest does not name
right after its commit.

A step committed here as another save is never replaced unasked (the drain
fails before any byte moves; ``LevelDriver.refuse_replacing``). With
``Level(overwrite=True)`` it is replaced the way every drain commits: the
new files under new names beside the old ones (an object store has no
atomic rename), the new manifest last, then the old files removed, so a
drain interrupted before its commit leaves the old step loadable.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from .. import _dist
from .._phases import reached
from ..checkpoint import StoredCheckpoint
from ..checkpoint.copy import DeltaTarget, copy_rank_files
from ..checkpoint.stored import sibling_location
from ..codecs import Compression
from ..errors import DcpMultilevelError, DrainError
from ..format import Manifest, Reference, locations_from_json, locations_to_json, step_dir
from .base import DrainChannel, DrainJob, DrainResult, LevelDriver

__all__ = ["StoreLevel"]

logger = logging.getLogger(__name__)


class StoreLevel(LevelDriver):
    """A level at a store URL (a path, ``s3://...``, any fsspec URL)."""

    def drain(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> DrainResult:
        """Copy this rank's files of ``job.source`` here; rank 0 also commits."""
        self.refuse_replacing(job, manifest, link)  # before any byte is written here
        target = self.checkpoint(job.step)
        # New names every drain: a step replaced here keeps its files until the commit.
        token = uuid.uuid4().hex[:16]
        delta = self._delta_target(job)
        stats = copy_rank_files(
            manifest,
            job.source,
            target.store,
            _dist.rank(),
            token,
            Compression.of(self.level.codec),
            delta,
        )
        reached("drain", job.step)
        result = DrainResult(job.step, self.url, bytes_stored=stats.bytes_stored)
        result.details = {
            "bytes_read": stats.bytes_read,
            "files_verbatim": stats.files_verbatim,
            "files_encoded": stats.files_encoded,
        }
        if link.rank != 0:
            link.send({"locations": locations_to_json(stats.locations), "files": stats.files})
            # Done only once rank 0 committed: a finished drain means "on the level".
            link.wait_commit()
            result.committed = True
            return result
        locations, files = stats.locations, dict(stats.files)
        for r, sent in enumerate(link.gather(), start=1):
            locations.update(_peer_locations(sent, r, target))
            files.update(sent["files"])
        missing = set(manifest.locations) - set(locations)
        if missing:
            raise DrainError(
                f"{len(missing)} items were copied by no rank (e.g. {next(iter(missing))})"
            )
        reference = None
        if any(loc.reference is not None for loc in locations.values()):
            if delta is None:  # every rank chose alike, from the same store
                raise DrainError(f"a rank coded deltas of step {job.step} that rank 0 could not")
            reference = Reference(delta.manifest.save_id, step_dir(job.reference))  # type: ignore[arg-type]
        target.commit(
            manifest.metadata,
            locations,
            files,
            save_id=manifest.save_id,
            world_size=manifest.world_size,
            reference=reference,
            extra=manifest.extra,
        )
        link.announce_commit()
        result.committed = True
        # bytes_stored stays this rank's share (as on every rank: sums add up);
        # the level's total is in the details.
        result.details["level_bytes"] = sum(files.values())
        result.lag_seconds = time.time() - job.committed_unix
        logger.info(
            "dcp_multilevel: step %d committed on %s (%d bytes, lag %.2f s)",
            job.step,
            self.url,
            result.details["level_bytes"],
            result.lag_seconds,
        )
        # As a save's commit does: what an earlier attempt at this drain left (it died),
        # or the files of the save this one replaced (overwrite=True), go now (after
        # the announcement: no peer waits for it). The sweep of a local level then
        # passes over this step's data/ (``LocalStore.sweep``).
        target.sweep(files)
        return result

    def _delta_target(self, job: DrainJob) -> DeltaTarget | None:
        """The checkpoint on this level that ``job`` codes its step against, or None."""
        if job.reference is None or not self.level.deltas:
            return None
        try:
            manifest = self.checkpoint(job.reference).manifest()
        except (DcpMultilevelError, OSError) as e:
            logger.warning(
                "dcp_multilevel: step %d goes to %s whole: its reference, step %d, is not "
                "usable there (%s)",
                job.step,
                self.url,
                job.reference,
                e,
            )
            return None
        # The first level's copy of the same save, when it is still there: local reads.
        local = StoredCheckpoint.at(
            sibling_location(job.source.location, step_dir(job.reference)),
            job.source.storage_options,
        )
        try:
            if local.manifest().save_id == manifest.save_id:
                return DeltaTarget(manifest, local)
        except (DcpMultilevelError, OSError):
            pass
        return DeltaTarget(manifest, self.checkpoint(job.reference))


def _peer_locations(sent: Any, rank: int, target: StoredCheckpoint) -> dict:
    """The item locations rank ``rank`` sent, checked (a malformed entry is an error)."""
    if not isinstance(sent, dict) or not isinstance(sent.get("files"), dict):
        raise DrainError(f"rank {rank} sent a malformed share of the drain to {target.url}")
    return locations_from_json(sent.get("locations"), checkpoint=target.url)

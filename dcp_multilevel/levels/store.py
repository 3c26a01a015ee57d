"""The store level: each rank copies its own files of a checkpoint to one URL.

Who sends which bytes where: every rank reads the data files it wrote on
the first level (from its own node's view) and writes them to this level's
store (``transfer.py``: verbatim when the codecs agree, re-encoded
otherwise, every item verified on the way). Rank 0 then gathers every
rank's new item locations and writes this level's manifest last (the
commit). A failed drain leaves objects that no manifest names; retention
sweeps them.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..codecs import Compression
from ..errors import DrainError
from ..format import Manifest, locations_from_json, locations_to_json
from .base import DrainJob, DrainResult, LevelDriver
from .link import DrainLink
from .transfer import copy_rank_files

__all__ = ["StoreLevel"]

logger = logging.getLogger(__name__)


class StoreLevel(LevelDriver):
    """A level at a store URL (a path, ``s3://...``, any fsspec URL)."""

    def drain(self, job: DrainJob, manifest: Manifest, link: DrainLink) -> DrainResult:
        """Copy this rank's files of ``job.source`` here; rank 0 also commits."""
        target = self.checkpoint(job.step)
        token = uuid.uuid4().hex[:16]
        stats = copy_rank_files(
            manifest, job.source, target.store, _dist.rank(), token,
            Compression.of(self.level.codec),
        )  # fmt: skip
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
        target.commit(
            manifest.metadata, locations, files, save_id=manifest.save_id,
            world_size=manifest.world_size,
        )  # fmt: skip
        link.announce_commit()
        result.committed = True
        # bytes_stored stays this rank's share (as on every rank: sums add up);
        # the level's total is in the details.
        result.details["level_bytes"] = sum(files.values())
        result.lag_seconds = time.time() - job.committed_unix
        logger.info(
            "dcp_multilevel: step %d committed on %s (%d bytes, lag %.2f s)",
            job.step, self.url, result.details["level_bytes"], result.lag_seconds,
        )  # fmt: skip
        return result


def _peer_locations(sent: Any, rank: int, target: StoredCheckpoint) -> dict:
    """The item locations rank ``rank`` sent, checked (a malformed entry is an error)."""
    if not isinstance(sent, dict) or not isinstance(sent.get("files"), dict):
        raise DrainError(f"rank {rank} sent a malformed share of the drain to {target.url}")
    return locations_from_json(sent.get("locations"), checkpoint=target.url)

"""What a :class:`~dcp_multilevel.MultiLevelReader` given ``levels`` does around DCP's calls.

The reader reads one step from the copies the process's runtime for the
levels names, fastest first (its usual per-item fallback); :class:`LevelLoads`
has the runtime agree on the step and bring each node what it lacks first::

    all ranks   MultiLevelReader(path, levels=...)   runtime_for (collective); the step the
                              path names ("latest" or None: the newest every rank can read)
    all ranks   reset(checkpoint_id)   the step it names
    all ranks   read_metadata          loads.prepare(), collective: the saves before
                                       followed up; every rank's view of every level; the
                                       step agreed; each node's own ranks' files brought
                                       back (Restorer.choose). The copies to read
    all ranks   read_data              loads.complete(items), collective: what each rank
                                       reads of the other ranks' files brought too
                                       (Restorer.complete); the copies, with the parts copy
                                       ... the reader reads ...
                                       loads.repaired(failed), collective: when a rank's
                                       read failed, damaged first-level files set aside
                                       and fetched intact, then read again (once)
                                       loads.finished(ok), collective: when every rank's
                                       read succeeded, the runtime goes on from the step
                                       (drains a crash left, a replaced node's copies)

Every step runs on every rank: ``read_metadata`` is the first call of DCP's
load on each rank, and ``read_data`` the first after its plan reached all of
them, so no rank is elsewhere while the others run a collective.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import CheckpointNotFoundError, ConfigError, DcpMultilevelError
from ..format import Manifest
from .config import LATEST, step_of
from .restore import Needs, Restore, Views, gather_views
from .restore_execute import RestoreReport
from .restore_plan import merge_ranges
from .runtime import Runtime

__all__ = ["LevelLoads"]

#: A copy to read: its location and its store's options.
Copy = tuple[str, "dict[str, Any] | None"]


class LevelLoads:
    """One reader's loads through a runtime (see the module docstring)."""

    def __init__(self, runtime: Runtime, path: str | os.PathLike[str] | None) -> None:
        self.runtime = runtime
        self.target: int | None = None
        self.aim(path)
        #: After ``read_metadata``: the step being loaded, and how (None before).
        self.restore: Restore | None = None
        self.views: Views | None = None
        #: What each rank's load reads, when the caller knows it before DCP's plan (the
        #: manager: a dry run of its load planner): the restore then brings exactly that,
        #: all at once, before the step is read (``Restorer.choose``).
        self.reads: Needs | None = None
        #: Why the ranks could not agree on the step or bring it (DCP reports an error in
        #: read_metadata as an AssertionError quoting it): raised again by the manager.
        self.failure: DcpMultilevelError | None = None
        #: Load a quarantined step when it is the newest (else it is passed over).
        self.allow_quarantined = False

    def aim(self, path: str | os.PathLike[str] | None) -> None:
        """Load the step ``path`` names (None or ``"latest"``: the newest)."""
        if path is None or os.fspath(path) == LATEST:
            self.target = None
        else:
            self.target = step_of(path, self.runtime.first, self.runtime.given[0])

    @property
    def location(self) -> str:
        """Where the first level holds the step (``"latest"`` until one is chosen)."""
        step = self.restore.step if self.restore is not None else self.target
        return LATEST if step is None else self.runtime.first.checkpoint_url(step)

    @property
    def last_restore(self) -> RestoreReport | None:
        """The last load's restore: what was brought onto this rank's node, by source."""
        return self.runtime.restorer.last_restore

    def prepare(self) -> tuple[list[Copy], bytes | None]:
        """Agree on the step and bring each node its own ranks' files (collective); the
        copies to read, and the first one's manifest when this rank may not see it.

        Raises:
            CheckpointNotFoundError: the step (or any) cannot be loaded by every rank.
        """
        self.runtime.follow_up()  # what the saves sent is in the books before levels are listed
        self.views = gather_views(self.runtime.drivers)
        self.failure = None
        try:
            self.restore = self.runtime.restorer.choose(
                self.views, self.target, self.reads, self.allow_quarantined
            )
            if self.restore is None:
                names = ", ".join(lv.url for lv in self.runtime.given)
                raise CheckpointNotFoundError(
                    f"no level holds a checkpoint ({names}): nothing to load. Start fresh, "
                    "or check the levels' locations.",
                    checkpoint=self.runtime.first.url,
                )
        except DcpMultilevelError as e:
            self.failure = e
            raise
        return self.runtime.restorer.copies(self.restore)

    def complete(self, indices: list[MetadataIndex]) -> list[Copy]:
        """Bring what this rank reads (the items ``indices`` names, of the step and of its
        delta references). Collective. The copies to read."""
        assert self.restore is not None and self.views is not None

        def reads(manifest: Manifest) -> dict[str, list[list[int]]]:
            out: dict[str, list[list[int]]] = {}
            for index in indices:
                loc = manifest.locations.get(index)
                if loc is not None:
                    out.setdefault(loc.file, []).append([loc.offset, loc.offset + loc.length])
            return {f: [list(r) for r in merge_ranges(rs)] for f, rs in sorted(out.items())}

        known = self.reads is not None  # then brought with the step
        try:
            self.restore = self.runtime.restorer.complete(
                self.restore, self.views, None if known else reads
            )
        except DcpMultilevelError as e:
            self.failure = e
            raise
        return self.runtime.restorer.copies(self.restore)[0]

    def repaired(self, failed: bool) -> bool:
        """Collective, after every rank read: when some rank's read ``failed``, set damaged
        first-level files aside and fetch intact copies; True when the failed reads are
        worth trying again."""
        if not any(_dist.all_gather_object(failed)):
            return False
        assert self.restore is not None
        return self.runtime.restorer.repair(self.restore)

    def finished(self, ok: bool, sources: dict[str, int]) -> None:
        """Collective: when every rank's read was ``ok``, the runtime goes on from the step.
        ``sources``: how many items each copy served on this rank."""
        self.runtime.restorer.last_load_sources = dict(sources)
        if all(_dist.all_gather_object(ok)):
            assert self.restore is not None and self.views is not None
            self.runtime.loaded(self.restore, self.views)

    @staticmethod
    def checkpoints(
        copies: list[Copy], have: list[StoredCheckpoint], manifest: bytes | None = None
    ) -> list[StoredCheckpoint]:
        """``copies`` as a reader's, reusing those it ``have`` (with their manifests);
        ``manifest``: the first copy's, when this rank may not see it there."""
        known = {c.location: c for c in have}
        out = []
        for i, (location, options) in enumerate(copies):
            copy = known.get(location)
            if copy is None:
                primary = manifest if i == 0 else None
                copy = StoredCheckpoint.at(location, options, manifest_bytes=primary)
            out.append(copy)
        return out

    @staticmethod
    def refuse(fallbacks: object, primary_manifest: object) -> None:
        """A reader's own copies do not go with levels (the runtime names them)."""
        if fallbacks or primary_manifest is not None:
            raise ConfigError(
                "MultiLevelReader(levels=...) finds the step's copies on the levels itself: "
                "fallbacks and primary_manifest go without levels"
            )

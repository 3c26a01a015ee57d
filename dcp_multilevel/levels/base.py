"""The level interface: what one rung of the multi-level ladder does with checkpoints.

A :class:`~dcp_multilevel.Level` says where a level is, how often it
takes a save, how many it keeps and how it codes them. Its
:class:`LevelDriver` says *who sends which bytes where* to bring a
committed first-level checkpoint onto it (a drain), and where a load finds
its copy. A store level (``store.py``) has each rank copy its own files to
a URL; other kinds (copies on partner nodes, erasure-coded parity across a
group) are further drivers, each in its own file, registered by kind name
(``__init__.py``).

Call order (the manager makes every call; every rank unless said)::

    driver = driver_for(level)            construction
    driver.bind(context)                  construction, collective (every rank, drivers in
                                          level order): the topology; a kind that moves
                                          bytes between nodes makes its process group here
    driver.sweep(older_than_s)            construction: crash leftovers
    driver.steps()                        main thread: discovery
    driver.scan()                         retention (rank 0, or a node's lowest rank): the
                                          committed and the unfinished steps, in one pass
    driver.checkpoint(step)               main thread: the copy a load reads from
    driver.drain(job, manifest, link)     a background drain thread, on every rank at
                                          once: bring ``job.source`` onto this level;
                                          collective agreement only through ``link``
                                          (the c10d store, never the trainer's group);
                                          first ``refuse_replacing`` (below)
    driver.delete(step)                   retention, main thread or drain thread: rank 0
                                          for every level, and every other rank too for
                                          the first level (each node its own view)

``steps``/``uncommitted``/``scan``/``checkpoint``/``delete``/``sweep`` default to
checkpoints below the level's ``url`` (``<url>/step-<N>/``); a kind that
keeps them elsewhere overrides them.

A *node-local* kind (``node_local = True``: partner copies, erasure parity)
keeps each node's part on that node's own disk: each node sees, and
retention deletes, its own part (every rank calls ``delete`` then, like
for the first level), and a load asks every rank what its node holds
(``restore/inventory.py``) instead of trusting one listing.

No drain replaces a committed step of another save (another ``save_id``)
unasked: a driver's ``drain`` calls :meth:`LevelDriver.refuse_replacing`
before it writes anything, which raises :class:`DrainError` on every rank
unless the level says ``overwrite=True``, or the job ``supersedes`` the step
(a run that resumed from an older step saved it again: the load passed over
the old copy as not restorable or quarantined). The same save again (a retry) is
not a replacement. A replacing drain writes its files under new names and
its manifest last, so the old step stays loadable until the new one commits.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import CheckpointRoot, StoredCheckpoint
from ..checkpoint.root import StepDirs
from ..errors import ConfigError, DcpMultilevelError, DrainError
from ..format import Manifest
from .link import DrainLink
from .options import Level
from .rebuild import Rebuilder
from .topology import Topology

__all__ = ["DrainJob", "DrainResult", "LevelContext", "LevelDriver"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelContext:
    """What a driver learns about the job when it is bound (``LevelDriver.bind``)."""

    topology: Topology | None  # which node each rank is on (None: not gathered)
    timeout_s: float  # how long ranks wait for each other (the drain timeout)


@dataclass(frozen=True)
class DrainJob:
    """Bring the committed checkpoint ``source`` (of ``step``) onto the level ``target``."""

    step: int
    source: StoredCheckpoint  # this rank's view of the first level's copy
    target: LevelDriver
    drain_id: str  # identical on every rank for the same drain
    committed_unix: float  # when the source checkpoint was committed
    #: A level with deltas: the step on the target to code this one against
    #: (None: store it whole). The drain stores it whole when that step is
    #: not there, or is not what a delta can use.
    reference: int | None = None
    #: Drains to run first, in order, in the same worker (the first level's
    #: references of a delta step, for a level that copies files as they are and
    #: does not hold them yet). This one fails when one of them does.
    before: tuple[DrainJob, ...] = ()
    #: The step a run resumed from an older step saved again: the level's copy, of a
    #: timeline that no longer exists (the load passed over it), is replaced (logged).
    supersedes: bool = False


@dataclass
class DrainResult:
    """What one drain did on this rank (metrics; the coordinator's says whether it committed)."""

    step: int
    level: str  # URL of the target level
    bytes_stored: int = 0
    seconds: float = 0.0
    lag_seconds: float = 0.0  # source commit -> target commit (coordinator)
    committed: bool = False
    skipped: bool = False  # never sent (policy "skip", or another world size)
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    #: Policy "latest": this step waited while an earlier drain ran, and this newer
    #: step, due on the level too, went there instead (not an error).
    superseded_by: int | None = None
    queued_seconds: float = 0.0  # submitted -> started: waited for the level's lane

    @property
    def superseded(self) -> bool:
        """Whether a newer due step replaced this one before it started."""
        return self.superseded_by is not None

    @property
    def gbps(self) -> float:
        """Bytes stored on the target per second of this rank's drain, in GB/s."""
        return self.bytes_stored / self.seconds / 1e9 if self.seconds else 0.0

    def record(self, rank: int) -> dict[str, Any]:
        """This drain as a metrics record (see ``metrics.py``)."""
        return {
            "kind": "drain",
            "rank": rank,
            "step": self.step,
            "level": self.level,
            "bytes": self.bytes_stored,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "lag_seconds": self.lag_seconds,
            "queued_seconds": self.queued_seconds,
            "committed": self.committed,
            "skipped": self.skipped,
            "superseded_by": self.superseded_by,
            "error": self.error,
            **self.details,
            "unix": time.time(),
        }


class LevelDriver(abc.ABC):
    """How one level holds checkpoints; see the module docstring for the call order.

    Args:
        level: the user's configuration of this level.
        root: where this level's checkpoints are (default: below ``level.url``).
    """

    #: True for a kind whose copies are on node-local disks (see the module docstring).
    node_local: bool = False
    #: True for a kind that needs to know which node each rank is on.
    needs_topology: bool = False
    #: How this kind rebuilds a lost file from blocks in a restore (``rebuild.py``);
    #: None: its nodes hold whole files, which a restore copies.
    rebuilder: Rebuilder | None = None

    def __init__(self, level: Level, root: CheckpointRoot | None = None) -> None:
        self.level = level
        self.root = root if root is not None else CheckpointRoot(level.url, level.storage_options)
        self._check_options()

    def _check_options(self) -> None:
        """Refuse kind options this kind does not take (override to accept some)."""
        if self.level.kind_options():
            raise ConfigError(
                f"level {self.level.url!r} sets {sorted(self.level.kind_options())}: options "
                f"of a level kind (Level('<kind>:...')), which {type(self).__name__} does not "
                "take"
            )

    def bind(self, context: LevelContext) -> None:
        """Learn the job (collective; see the call order). The default keeps nothing."""
        return None

    @property
    def url(self) -> str:
        """The level's root as the user wrote it (names it in logs, metrics and errors)."""
        return self.level.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def steps(self) -> list[int]:
        """Steps committed on this level, as this rank sees it, ascending."""
        return self.root.steps()

    def uncommitted(self) -> list[int]:
        """Steps begun here but never committed (their leftovers are swept by retention)."""
        return self.root.uncommitted()

    def scan(self) -> StepDirs:
        """:meth:`steps` and :meth:`uncommitted` from one look at the level (retention
        needs both; see ``CheckpointRoot.scan`` for what that look costs)."""
        return self.root.scan()

    def checkpoint(self, step: int, *, manifest_bytes: bytes | None = None) -> StoredCheckpoint:
        """This level's copy of ``step`` (``manifest_bytes``: as another rank read it)."""
        return self.root.checkpoint(step, manifest_bytes=manifest_bytes)

    def delete(self, step: int) -> None:
        """Remove this level's copy of ``step`` (committed or not; manifest first)."""
        self.root.delete(step)

    def sweep(self, older_than_s: float) -> list[str]:
        """Remove crash leftovers older than ``older_than_s`` seconds; return what went."""
        return self.root.sweep(older_than_s)

    def holdings(self, step: int) -> dict[str, Any] | None:
        """What this node holds of ``step`` besides whole data files, for a restore's
        inventory (``restore/inventory.py``): ``{"groups": {group: description},
        "parity": [[group, block], ...]}`` for a level of erasure-coded groups;
        None (the default) for a level that holds whole files only."""
        return None

    def held_save(self, step: int, link: DrainLink, incoming: str) -> str | None:
        """The ``save_id`` of the committed ``step`` on this level (None: not committed),
        the same on every rank of the drain: rank 0 looks and tells the others through
        ``link`` (a node-local kind asks every node, ``node_local.py``, and returns a
        save other than ``incoming``, the drain's, where some node holds one).

        Raises:
            DrainError: the level could not be read (on every rank).
        """
        if link.rank == 0:
            found = self._held_here(step)
            link.put("held", found)
        else:
            (found,) = link.get(["held"])
        return self._verdict(found, step)

    def _held_here(self, step: int) -> dict[str, Any]:
        """What this rank sees committed at ``step`` here, as a JSON-able value."""
        try:
            return {"save_id": self.checkpoint(step).held_save_id()}
        except (DcpMultilevelError, OSError) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def _verdict(self, found: dict[str, Any], step: int) -> str | None:
        """The save id in ``found`` (what a rank saw at ``step``), or DrainError saying why
        there is none."""
        if "error" in found:
            raise DrainError(
                f"could not tell whether step {step} is committed on {self.url} already (the "
                f"drain must not replace it unasked): {found['error']}"
            )
        return found["save_id"]

    def refuse_replacing(self, job: DrainJob, manifest: Manifest, link: DrainLink) -> bool:
        """Raise :class:`DrainError` (every rank alike) when ``job.step`` is committed on
        this level as another save than ``manifest``'s and the level does not say
        ``overwrite=True``; a drain calls it before it writes anything. Collective.

        Returns:
            True when the drain replaces another save (``overwrite=True``).
        """
        held = self.held_save(job.step, link, manifest.save_id)
        if held is None or held == manifest.save_id:
            return False
        if job.supersedes:
            logger.warning(
                "dcp_multilevel: replacing step %d on %s (save %s, which the load of an older "
                "step passed over) with save %s of the resumed run",
                job.step,
                self.url,
                held,
                manifest.save_id,
            )
            return True
        if not self.level.overwrite:
            raise DrainError(
                f"step {job.step} is committed on level {self.url} as save {held}; the drain "
                f"of save {manifest.save_id} would replace it, so the level keeps it as it "
                "is. Move or delete that step there, or pass Level(..., overwrite=True) to "
                "replace it (the old one stays loadable until the new one commits)"
            )
        logger.warning(
            "dcp_multilevel: replacing step %d on %s (save %s) with save %s (overwrite=True)",
            job.step,
            self.url,
            held,
            manifest.save_id,
        )
        return True

    @abc.abstractmethod
    def drain(self, job: DrainJob, manifest: Manifest, link: DrainLink) -> DrainResult:
        """Bring ``job.source`` (whose manifest is ``manifest``) onto this level.

        Runs in a background thread on every rank at once; ranks agree only
        through ``link`` (see ``link.py``). The
        coordinator's result says ``committed=True`` once this level's copy is
        committed (its manifest written last); every rank returns only after
        that, so a finished drain means "on this level" everywhere.

        Raises:
            Exception: any failure; the drainer records it and tells the other ranks.
        """

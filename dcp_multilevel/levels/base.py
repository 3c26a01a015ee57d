"""The level-kind contract: what one level does with checkpoints, and what it is handed.

A :class:`~dcp_multilevel.Level` says where a level is, how often it
takes a save, how many it keeps and how it codes them. Its
:class:`LevelDriver` says *who sends which bytes where* to bring a
committed first-level checkpoint onto it (a drain), and where a load finds
its copy. A store level (``store.py``) has each rank copy its own files to
a URL; other kinds (copies on partner nodes, erasure-coded parity across a
group) are further drivers, each in its own file, registered by kind name
(:data:`LEVEL_KINDS`).

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
(``levels/restore_inventory.py``) instead of trusting one listing.

No drain replaces a committed step of another save (another ``save_id``)
unasked: a driver's ``drain`` calls :meth:`LevelDriver.refuse_replacing`
before it writes anything, which raises :class:`DrainError` on every rank
unless the level says ``overwrite=True``, or the job ``supersedes`` the step
(a run that resumed from an older step saved it again: the load passed over
the old copy as not restorable or quarantined). The same save again (a retry) is
not a replacement. A replacing drain writes its files under new names and
its manifest last, so the old step stays loadable until the new one commits.

**The drain channel** (:class:`DrainChannel`): how the ranks of one drain agree, from
background threads, through the c10d store.

A drain runs in a background thread on every rank. Background threads never
use the trainer's process group (a collective issued there can interleave
with the trainer's own and deadlock), so ranks exchange small JSON values
through the c10d store instead, under keys unique to the drain
(``dcp_multilevel/drain/<drain id>/<what>``). Large data never goes
through the store.

Call order for one drain (``link = DrainChannel(drain_id, timeout_s)``)::

    every rank    link.share_manifest(read)   rank 0 reads and publishes the
                                              source manifest, the others take it
    rank != 0     link.send(value)            e.g. the item locations it wrote
    rank 0        link.gather()               every other rank's value, in rank order
    rank 0        link.announce_commit()      after its commit on the level
    rank != 0     link.wait_commit()          returns once rank 0 committed
    any rank      link.put(name, value)       a named value for any rank (e.g.
                  link.get(names)             parity checksums)
    every rank    link.done()                 this rank's part is done
    node's lowest link.wait_all_done(nodes)   every rank's is (by node: R + 2N gets)
    any rank      link.fail(error)            on any failure: no rank waits out
                                              the timeout for a peer that failed

With one rank (or no process group) nothing is exchanged.

**Rebuilds** (:class:`Rebuilder`): what a level kind that rebuilds lost files from coded
blocks brings to a restore.

A restore (``restore.py``) copies a file a node lacks from another node when
some node holds it; a kind whose nodes hold *blocks* instead (erasure
parity) rebuilds it. The restore knows nothing of how: it asks the level's
driver for its :class:`Rebuilder` (``LevelDriver.rebuilder``) and treats
what the kind reports in the inventories (``LevelDriver.holdings``: its
groups' descriptions and the blocks this node holds) as opaque.

Call order, for one restore (every rank computes the same plan)::

    holdings = driver.holdings(step)       each node, into its inventory
    r = driver.rebuilder                   the restore's planner, for each level
    r.plan(level, file, wanted, ...)       for a file no node can copy: which group's
                                           members to rebuild, from which blocks
    r.receive(desc, members, sources, ...) the receiving rank, carrying it out
    r.send(desc, block, source, dst, ...)  each rank that holds a source block

Pure in ``plan`` (no I/O); ``receive`` and ``send`` move bytes over the
restore's group, point to point.
"""

from __future__ import annotations

import abc
import base64
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import _dist
from .._registry import Registry
from ..checkpoint import CheckpointRoot, StoredCheckpoint
from ..checkpoint.root import StepDirs
from ..errors import ConfigError, DcpMultilevelError, DrainError
from ..format import Manifest
from ..stores import Store
from .config import Level
from .topology import Topology

__all__ = [
    "DrainChannel",
    "DrainJob",
    "DrainResult",
    "LevelContext",
    "LevelDriver",
    "RebuildChoice",
    "Rebuilder",
]


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
        inventory (``levels/restore_inventory.py``): ``{"groups": {group: description},
        "parity": [[group, block], ...]}`` for a level of erasure-coded groups;
        None (the default) for a level that holds whole files only."""
        return None

    def held_save(self, step: int, link: DrainChannel, incoming: str) -> str | None:
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

    def refuse_replacing(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> bool:
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
    def drain(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> DrainResult:
        """Bring ``job.source`` (whose manifest is ``manifest``) onto this level.

        Runs in a background thread on every rank at once; ranks agree only
        through ``link`` (see ``link.py``). The
        coordinator's result says ``committed=True`` once this level's copy is
        committed (its manifest written last); every rank returns only after
        that, so a finished drain means "on this level" everywhere.

        Raises:
            Exception: any failure; its lane records it and tells the other ranks.
        """


class DrainChannel:
    """The ranks of one drain, talking through the c10d store (see the module docstring)."""

    def __init__(self, drain_id: str, timeout_s: float) -> None:
        self.drain_id = drain_id
        self.timeout_s = timeout_s
        self.rank = _dist.rank()
        self.world_size = _dist.world_size()

    def _key(self, what: int | str) -> str:
        return f"dcp_multilevel/drain/{self.drain_id}/{what}"

    def _wait(self, keys: list[str]) -> list[Any]:
        return _dist.store_wait_get(keys, self.timeout_s)

    def share_manifest(self, read: Callable[[], bytes], source: str) -> bytes:
        """The source manifest's bytes as rank 0 reads them with ``read()``, on every rank.

        With a node-local first level only rank 0's node holds the manifest
        (every node holds its own ranks' data files); on a shared one, all
        ranks then still copy by the very same manifest.

        Raises:
            DrainError: rank 0 could not read it (names ``source``).
        """
        key = self._key("manifest")
        if self.world_size == 1:
            return read()
        if self.rank == 0:
            try:
                raw = read()
            except Exception as e:
                _dist.store_set(key, {"error": f"{type(e).__name__}: {e}"})
                raise
            _dist.store_set(key, {"manifest": base64.b64encode(raw).decode("ascii")})
            return raw
        (value,) = self._wait([key])
        if "error" in value:
            raise DrainError(f"rank 0 could not read the manifest of {source}: {value['error']}")
        return base64.b64decode(value["manifest"])

    def send(self, value: Any) -> None:
        """Publish this rank's JSON-able ``value`` for rank 0 (ranks other than 0)."""
        _dist.store_set(self._key(self.rank), {"value": value})

    def gather(self) -> list[Any]:
        """Every other rank's sent value, ranks 1..n-1 in order (rank 0).

        Raises:
            DrainError: a rank reported a failure instead (names the rank).
        """
        if self.world_size == 1:
            return []
        others = self._wait([self._key(r) for r in range(1, self.world_size)])
        for r, value in enumerate(others, start=1):
            if "error" in value:
                raise DrainError(f"rank {r} failed: {value['error']}")
        return [value["value"] for value in others]

    def announce_commit(self) -> None:
        """Rank 0 committed the drain on its level: the other ranks' drains may end."""
        if self.world_size > 1:
            _dist.store_set(self._key("commit"), {"ok": True})

    def wait_commit(self) -> None:
        """Block until rank 0 committed (ranks other than 0).

        Raises:
            DrainError: rank 0 could not commit (its error in the message).
        """
        (outcome,) = self._wait([self._key("commit")])
        if "error" in outcome:
            raise DrainError(f"rank 0 could not commit: {outcome['error']}")

    def put(self, name: str, value: Any) -> None:
        """Publish a JSON-able ``value`` under ``name`` for any rank of this drain."""
        if self.world_size > 1:
            _dist.store_set(self._key(f"named/{name}"), {"value": value})

    def get(self, names: list[str]) -> list[Any]:
        """The values published under ``names`` (waits for each).

        Raises:
            DrainError: the rank that was to publish one failed instead.
        """
        values = self._wait([self._key(f"named/{n}") for n in names])
        for name, value in zip(names, values, strict=True):
            if "error" in value:
                raise DrainError(f"{name}: {value['error']}")
        return [value["value"] for value in values]

    def done(self) -> None:
        """This rank's part of the drain is done (see :meth:`wait_done`)."""
        self.put(f"done/{self.rank}", True)

    def wait_done(self, ranks: list[int]) -> None:
        """Block until every rank in ``ranks`` called :meth:`done` (or raise its failure)."""
        self.get([f"done/{r}" for r in ranks if r != self.rank])

    def wait_all_done(self, nodes: Sequence[int]) -> None:
        """Block until every rank called :meth:`done` (or raise the first failure seen);
        called by each node's lowest rank (``nodes``: each rank's node).

        By node, so the store serves ``R + 2N`` gets, not ``N x R`` (every node's
        lowest rank waiting on every rank's key): each waits on its node's ranks
        and publishes ``node-done/<rank>``; rank 0 (the lowest of its node) waits
        on those and publishes ``all-done``, which the others wait on. A failure
        travels the same way (:meth:`fail` publishes it under all three names).
        """
        if self.world_size == 1:
            return
        mine = nodes[self.rank]
        self.wait_done([r for r, n in enumerate(nodes) if n == mine])
        self.put(f"node-done/{self.rank}", True)
        if self.rank != 0:
            self.get(["all-done"])
            return
        leaders: dict[int, int] = {}
        for r, n in enumerate(nodes):
            leaders.setdefault(n, r)
        self.get([f"node-done/{r}" for r in sorted(leaders.values()) if r != 0])
        self.put("all-done", True)

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks this rank's part of the drain failed with ``error``."""
        if self.world_size > 1:
            why = f"{type(error).__name__}: {error}"
            _dist.store_set(self._key("commit" if self.rank == 0 else self.rank), {"error": why})
            done = {"error": f"rank {self.rank} failed: {why}"}
            _dist.store_set(self._key(f"named/done/{self.rank}"), done)
            # (Only a node's lowest rank's is waited on; rank 0's all-done, by all of those.)
            _dist.store_set(self._key(f"named/node-done/{self.rank}"), done)
            if self.rank == 0:
                _dist.store_set(self._key("named/all-done"), done)


@dataclass(frozen=True)
class RebuildChoice:
    """Rebuild ``members`` of ``group`` from ``sources`` (``(block, rank)`` pairs);
    ``brings``: the files the rebuilt members hold."""

    group: str
    members: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    brings: tuple[str, ...]


class Rebuilder(Protocol):
    """A level kind's rebuilds (see the module docstring for the call order)."""

    def plan(
        self,
        level: int,
        file: str,
        wanted: set[str],
        groups: dict[str, dict[str, Any]],
        inventories: Sequence[Any],
        copyable: Callable[[str], bool],
        block_damaged: Callable[[str, int, int], bool],
    ) -> RebuildChoice | str | None:
        """How to rebuild ``file`` on a node that needs ``wanted`` (files the node
        lacks), or why it cannot be (a reason naming the group), or None (no group
        holds it). ``level``: this level's index (inventories key by it);
        ``groups``: every group's description any node reported there;
        ``inventories``: every rank's (``.rank``, ``.files[level]``, the kind's
        blocks in ``.parity[level]``); ``copyable(f)``: another node holds ``f``;
        ``block_damaged(group, block, rank)``: that source was found damaged."""
        ...

    def receive(
        self,
        desc: dict[str, Any],
        members: Sequence[int],
        sources: Sequence[tuple[int, int]],
        local: dict[int, StoredCheckpoint],
        into: StoredCheckpoint,
        store: Store,
        group: Any,
    ) -> list[tuple[int, int]]:
        """Rebuild ``members`` into ``store`` (``into``'s), reading the blocks this
        rank holds from ``local`` and receiving the others; the ``(block, rank)``
        sources found damaged."""
        ...

    def send(
        self, desc: dict[str, Any], block: int, source: StoredCheckpoint, dst: int, group: Any
    ) -> None:
        """Stream block ``block`` of ``desc``'s group from ``source`` to rank ``dst``."""
        ...


#: kind name -> LevelDriver subclass (constructed as ``cls(level)``).
LEVEL_KINDS: Registry[type[LevelDriver]] = Registry("dcp_multilevel.levels", "level kind")

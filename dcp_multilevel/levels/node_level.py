"""What the levels between nodes share: a directory on every node's own disk.

A node-local level (``partner:``, ``erasure:``) keeps, on each node, below
the path after its kind (``Level("partner:/nvme/{node}/partner")``)::

    step-<N>/data/<file>            this node's own files of the checkpoint (hard
                                    links to the first level's: no second copy
                                    while both keep the step) and, for a partner
                                    level, the copies it holds for other nodes
    step-<N>/parity/...             an erasure level's parity blocks and group
                                    descriptions
    step-<N>/placement.json         which node each rank of the save was on
    step-<N>/manifest.json          the checkpoint's manifest, written last by
                                    the node's lowest rank: the node's part is
                                    committed

The manifest is the first level's, byte for byte: the files keep their names,
offsets and checksums, so a load reads a node-local copy like any other.

One drain, every rank in a background thread (``drain``)::

    every rank      exchange(job, manifest, target)   the kind's transfers over
                                                      its own gloo group
    every rank      link own files, link.done()
    lowest rank     wait until every rank is done, then sidecars and the
    of each node    manifest (the node's commit)
    rank 0          gather, announce the commit (the level holds the step)

A drain of a step saved by another world size (a drain resumed after a
restart with fewer ranks) is skipped: the copies follow the saving job's
placement, which this job cannot reproduce.

A step some node holds committed as another save is never replaced unasked:
each node's lowest rank looks at its own part before anything moves
(:meth:`NodeLevel.held_save`), and the drain fails on every rank
(``LevelDriver.refuse_replacing``). With ``Level(overwrite=True)`` it is
replaced: the new save's data files have names of their own, and its
manifest is written last, so a node's old step stays loadable until then;
then its other files go.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import time
from typing import Any

from .. import _dist
from .._phases import reached
from ..checkpoint import CheckpointRoot, StoredCheckpoint
from ..errors import ConfigError, DrainError
from ..format import PLACEMENT_NAME, TMP_MARKER, Manifest, rank_files
from ..stores import Store
from ..stores.location import parse_location
from .base import DrainChannel, DrainJob, DrainResult, LevelContext, LevelDriver
from .config import Level
from .topology import NODE_ENV, Topology

__all__ = ["NodeLevel", "hard_link_or_copy"]

logger = logging.getLogger(__name__)


class NodeLevel(LevelDriver):
    """A level whose copies live on the nodes' own disks (see the module docstring).

    Subclasses set :attr:`kind` and implement :meth:`exchange` (and may check
    the topology in :meth:`check_topology`).
    """

    node_local = True
    needs_topology = True
    #: The kind name (``"partner"``), for messages.
    kind = ""
    #: The kind options this kind takes.
    options: tuple[str, ...] = ()

    def __init__(self, level: Level) -> None:
        _, _, path = level.url.partition(":")
        example = f"{self.kind}:/local_nvme/{{node}}/{self.kind}"
        if not path.strip():
            raise ConfigError(
                f"level {level.url!r} names no directory: give the path on each node's own "
                f"disk where it keeps its part, e.g. {example!r}"
            )
        if parse_location(path).scheme != "file":
            raise ConfigError(
                f"level {level.url!r}: {path!r} is not a local path; a {self.kind} level keeps "
                f"its copies on each node's own disk ({example!r}). A store URL is a level of "
                "its own: Level(url)."
            )
        if level.codec is not None:
            raise ConfigError(
                f"level {level.url!r} sets codec={level.codec!r}; a {self.kind} level keeps the "
                "first level's files byte for byte (set the codec on the first level)"
            )
        self.path = path
        super().__init__(level, CheckpointRoot(path, level.storage_options))
        self.topology: Topology | None = None
        self.group: Any = None
        #: Whether the running drain replaces another save (``overwrite=True``): a kind
        #: whose files have fixed names writes them under new ones then.
        self.replacing = False

    def _check_options(self) -> None:
        extra = set(self.level.kind_options()) - set(self.options)
        if extra:
            raise ConfigError(
                f"level {self.level.url!r} sets {sorted(extra)}; a {self.kind} level takes "
                f"{list(self.options)}"
            )

    def bind(self, context: LevelContext) -> None:
        """Check the placement on this topology, then make the level's gloo group (collective)."""
        if context.topology is None:
            raise ConfigError(f"level {self.url!r} needs the topology (which node each rank is on)")
        self.check_topology(context.topology)
        self.topology = context.topology
        self.group = _dist.new_group(context.timeout_s)

    def check_topology(self, topology: Topology) -> None:
        """Refuse a placement that keeps a copy on its source's node (ConfigError)."""
        if len(topology.node_ids) < 2:
            raise ConfigError(
                f"level {self.url!r} keeps copies on other nodes, but every rank is on node "
                f"{topology.node_ids[0]}: a copy on the same node is lost with it. Run on several "
                f"nodes (set {NODE_ENV} per process to simulate them on one machine), or drop "
                "this level."
            )

    def held_save(self, step: int, link: DrainChannel, incoming: str) -> str | None:
        """The ``save_id`` of ``step`` where some node holds it committed (None: no node
        does), the same on every rank: each node's lowest rank looks at its own part,
        rank 0 takes a save other than ``incoming`` if any node holds one (else the
        one held), and tells everyone.

        Raises:
            DrainError: a node's part could not be read (on every rank).
        """
        topology = self.topology
        assert topology is not None
        if link.world_size == 1:
            return super().held_save(step, link, incoming)
        rank = link.rank
        if topology.leads(rank) and rank != 0:
            link.put(f"held/{rank}", self._held_here(step))
        if rank != 0:
            (verdict,) = link.get(["held"])
            return self._verdict(verdict, step)
        leaders = sorted({topology.leader(n) for n in topology.node_ids} - {0})
        seen = [self._held_here(step), *link.get([f"held/{r}" for r in leaders])]
        # An error first (nothing may be replaced unseen), then another save, then this one.
        verdict = next((s for s in seen if "error" in s), None)
        for wanted in (lambda held: held not in (None, incoming), lambda held: held is not None):
            verdict = verdict or next((s for s in seen if wanted(s["save_id"])), None)
        verdict = verdict or {"save_id": None}
        link.put("held", verdict)
        return self._verdict(verdict, step)

    @abc.abstractmethod
    def exchange(
        self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint, link: DrainChannel
    ) -> dict[str, int]:
        """This rank's transfers of one drain; returns byte counts for the metrics
        (``bytes_stored``: new bytes on this node's disk, ``bytes_sent``)."""

    def after_commit(self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint) -> None:
        """The node's lowest rank, after the node's commit: remove what an earlier save
        left that the commit's own sweep does not (default: nothing). Never raises."""
        return None

    def sidecars(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> dict[str, bytes]:
        """Files the node's lowest rank writes before the manifest (default: the placement)."""
        assert self.topology is not None
        return {PLACEMENT_NAME: json.dumps({"nodes": list(self.topology.nodes)}).encode()}

    def drain(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> DrainResult:
        """Bring ``job.source`` onto every node's part of this level (see the module docstring)."""
        topology = self.topology
        if topology is None:
            raise DrainError(f"level {self.url!r} was never bound to a topology")
        result = DrainResult(job.step, self.url)
        if manifest.world_size != topology.world_size:
            logger.warning(
                "dcp_multilevel: not copying step %d to %s: it was saved by %d ranks, this job "
                "has %d (its files follow the saving job's placement)",
                job.step,
                self.url,
                manifest.world_size,
                topology.world_size,
            )
            result.skipped = True
            return result
        # Before anything moves. The drains of one level run one at a time (one lane), so
        # this per-drain flag on the shared driver is never another drain's.
        self.replacing = self.refuse_replacing(job, manifest, link)
        rank = _dist.rank()
        target = self.checkpoint(job.step)
        counts = self.exchange(job, manifest, target, link)
        reached(self.kind, job.step)
        linked = self._own_files(job.source, target, manifest, rank)
        link.done()
        if topology.leads(rank):
            # The node commits only once every rank's part is done (all of them: a
            # level holds a step on every node or is not asked for it).
            link.wait_all_done(topology.nodes)
            for name, data in self.sidecars(job, manifest, link).items():
                target.store.write_atomic(name, data)
            target.commit_manifest(job.source.manifest_bytes())
            target.sweep(manifest.files)
            self.after_commit(job, manifest, target)
        result.bytes_stored = counts.get("bytes_stored", 0)
        result.details = {"bytes_sent": counts.get("bytes_sent", 0), "bytes_linked": linked}
        if rank != 0:
            link.send({"node": topology.nodes[rank]})
            link.wait_commit()
            result.committed = True
            return result
        link.gather()
        link.announce_commit()
        result.committed = True
        result.lag_seconds = time.time() - job.committed_unix
        logger.info(
            "dcp_multilevel: step %d committed on %s on every node (lag %.2f s)",
            job.step,
            self.url,
            result.lag_seconds,
        )
        return result

    def _own_files(
        self, source: StoredCheckpoint, target: StoredCheckpoint, manifest: Manifest, rank: int
    ) -> int:
        """Link (or copy) this rank's own files into this node's part; their bytes."""
        total = 0
        for file in rank_files(manifest.files, rank):
            total += manifest.files[file]
            hard_link_or_copy(source.store, target.store, file)
        return total


def hard_link_or_copy(source: Store, target: Store, file: str) -> None:
    """Make ``file`` of ``source`` appear in ``target``: a hard link when both are local
    directories on one file system (no bytes move), else a copy."""
    src = source.local_path(file)
    dst = target.local_path(file)
    if src is not None and dst is not None:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = f"{dst}{TMP_MARKER}link{os.getpid()}"
        try:
            os.link(src, tmp)
            os.replace(tmp, dst)
            return
        except OSError:  # another file system, or no hard links: copy
            if os.path.exists(tmp):
                os.unlink(tmp)
        target.put_file(src, file)
        return
    with source.open_read(file) as handle, target.open_write(file) as out:
        buf = memoryview(bytearray(16 << 20))
        pos = 0
        while pos < handle.size:
            n = handle.read_into(pos, buf)
            if n == 0:
                raise OSError(f"{source.url}/{file} ended at byte {pos} while copying it")
            out.write(buf[:n])
            pos += n

"""The partner level: copies of every rank's files on ``replicas - 1`` other nodes.

``Level("partner:/nvme/{node}/partner", replicas=2, jump=1)``: after the first
level commits a step, each rank sends its data files to its partners
(:meth:`Topology.partners`: the rank with the same local index ``jump``,
``2*jump``, ... nodes further along the ring), over the level's own gloo
group, verified item by item as they are read. Each node keeps what it
receives, plus hard links to its own files, below its directory
(``node_local.py``). A node lost with its disk is then rebuilt from the
copies on its partners (``restore/``): any ``replicas - 1`` lost nodes
whose copies are not all on lost nodes too.

Cost: ``replicas - 1`` times the checkpoint on the network and on the
nodes' disks, per save on this level (NVIDIA resiliency-ext's replication;
the erasure level stores less, ``erasure.py``).
"""

from __future__ import annotations

from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, DrainError
from ..format import Manifest, rank_files
from .base import DrainChannel, DrainJob
from .config import Level
from .node_level import NodeLevel
from .topology import Topology
from .wire import recv_file, send_file

__all__ = ["PartnerLevel"]


class PartnerLevel(NodeLevel):
    """Copies of each rank's files on other nodes (see the module docstring)."""

    kind = "partner"
    options = ("replicas", "jump")

    def __init__(self, level: Level) -> None:
        super().__init__(level)
        self.replicas = level.replicas if level.replicas is not None else 2
        self.jump = level.jump if level.jump is not None else 1
        if self.replicas < 2:
            raise ConfigError(
                f"level {level.url!r}: replicas={self.replicas}; a partner level needs "
                "replicas >= 2 (the node's own copy plus at least one on another node)"
            )

    def check_topology(self, topology: Topology) -> None:
        """Every copy on another node than its source and than each other (ConfigError)."""
        super().check_topology(topology)
        for rank in range(topology.world_size):
            topology.partners(rank, self.replicas, self.jump)

    def transfers(self, manifest: Manifest) -> list[tuple[int, int, str]]:
        """Every (source rank, partner rank, file) of a drain, in the order all ranks walk."""
        assert self.topology is not None
        return [
            (src, dst, file)
            for src in range(self.topology.world_size)
            for dst in self.topology.partners(src, self.replicas, self.jump)
            for file in rank_files(manifest.files, src)
        ]

    def exchange(
        self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint, link: DrainChannel
    ) -> dict[str, int]:
        """Send this rank's files to its partners; receive the files it holds for others."""
        rank = link.rank
        sent = received = 0
        damaged: list[str] = []
        for src, dst, file in self.transfers(manifest):
            if src == rank:
                if send_file(job.source, file, dst, self.group):
                    sent += manifest.files[file]
                else:
                    damaged.append(f"{file} (unreadable or damaged on this rank's first level)")
            elif dst == rank:
                size = manifest.files[file]
                if recv_file(target.store, file, size, src, self.group):
                    received += size
                else:
                    damaged.append(f"{file} (rank {src} could not read it intact)")
        if damaged:
            raise DrainError(
                f"step {job.step} not copied to {self.url}: files {damaged}; a file that "
                "fails its checksums on the first level is never copied (the step is not on "
                "this level; the next save is copied as usual)"
            )
        return {"bytes_stored": received, "bytes_sent": sent}

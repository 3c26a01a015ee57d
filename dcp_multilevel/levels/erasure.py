"""The erasure level: Reed-Solomon parity across groups of nodes.

``Level("erasure:/nvme/{node}/erasure", data=4, parity=2)``: the nodes, in
order, form groups of ``data`` (the last group may be smaller). A group's
*members* are its nodes' files of the checkpoint, one member per node (its
ranks' files back to back, padded to the group's stripe). ``parity`` parity
blocks (``erasure_code.py``, zfec) go to the ``parity`` nodes that follow the
group on the ring of nodes, never a node of the group, so any ``parity`` lost
nodes cost each group at most ``parity`` blocks: every group can be rebuilt.
Storage: ``(data + parity) / data`` times the checkpoint, plus the padding of
each member to its group's longest (whole 4 MiB chunks).

On each node, below its directory (``node_local.py``)::

    step-<N>/data/...                     hard links to the node's own files
    step-<N>/parity/<group>-<block>.bin   the parity blocks this node holds
    step-<N>/parity/group-<group>.json    the group's description (members,
                                          files and sizes, where its parity is,
                                          one checksum per parity chunk), on
                                          every node of the group

A drain that replaces a node's step of another save (``overwrite=True``)
names its blocks and descriptions ``<group>-<block>.<tag>.bin`` and
``group-<group>.<tag>.json`` (``erasure_blocks.save_tag``): the old ones stay
whole, and the old step restorable, until the node's new manifest commits;
then every parity file of another save goes (:meth:`ErasureLevel.after_commit`).

One drain, group after group, chunk by chunk (every rank walks the same
order, so the blocking sends never deadlock): each member node's lowest rank
streams its member, verified item by item, to the *encoder* (the lowest rank
of the first parity node), which codes one chunk index at a time, keeps the
first parity block and streams the others on. Memory: ``data + parity``
chunks per rank.

A restore rebuilds a lost member on the node that needs it from any ``data``
surviving blocks (``erasure_blocks.py``: the chunk streams and the rebuild);
every parity chunk is checked against its checksum as it is read, every
member item as it streams, and the rebuilt files item by item as they are
written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, DrainError
from ..format import Manifest, checksum_of, rank_files
from .base import DrainJob
from .erasure_blocks import (
    PARITY_DIR,
    description_path,
    member_chunks,
    parity_path,
    save_tag,
    send_block,
)
from .erasure_code import CHUNK, ErasureCode, stripe_length
from .erasure_rebuild import ErasureRebuilder
from .link import DrainLink
from .node_local import NodeLocalLevel
from .options import Level
from .topology import Topology
from .wire import OutStream, receive, recv_file, status

__all__ = ["ErasureLevel", "group_layout"]

logger = logging.getLogger(__name__)


def group_layout(nodes: Sequence[int], data: int, parity: int) -> list[tuple[list[int], list[int]]]:
    """(member nodes, parity nodes) of every group, for the nodes ``nodes`` in ring order.

    Raises:
        ConfigError: fewer than ``data + parity`` nodes (a parity block would
            share a node with a member of its group, and be lost with it).
    """
    count = len(nodes)
    if count < data + parity:
        raise ConfigError(
            f"erasure data={data} parity={parity} needs at least {data + parity} nodes (each "
            f"parity block on another node than its group's members), but the ranks are on "
            f"{count}: {list(nodes)}. Lower data or parity, or use a partner: level."
        )
    out = []
    for start in range(0, count, data):
        members = list(nodes[start : start + data])
        end = start + len(members)
        out.append((members, [nodes[(end + j) % count] for j in range(parity)]))
    return out


class ErasureLevel(NodeLocalLevel):
    """Reed-Solomon parity across groups of nodes (see the module docstring)."""

    kind = "erasure"
    options = ("data", "parity")
    #: A restore rebuilds a lost member from its group's intact blocks.
    rebuilder = ErasureRebuilder()

    def __init__(self, level: Level) -> None:
        super().__init__(level)
        if level.data is None or level.parity is None:
            raise ConfigError(
                f"level {level.url!r} needs data= and parity= (e.g. data=4, parity=2: groups "
                "of 4 nodes that survive any 2 lost nodes)"
            )
        self.data, self.parity = level.data, level.parity
        ErasureCode(self.data, self.parity)  # the same limits (<= 256 blocks)

    def check_topology(self, topology: Topology) -> None:
        """Enough nodes for every group's parity to sit outside it (ConfigError)."""
        super().check_topology(topology)
        group_layout(topology.node_ids, self.data, self.parity)

    def groups(self, manifest: Manifest) -> list[dict[str, Any]]:
        """Every group's description for one checkpoint (checksums added by the drain)."""
        topology = self.topology
        assert topology is not None
        out = []
        for g, (members, parity_nodes) in enumerate(
            group_layout(topology.node_ids, self.data, self.parity)
        ):
            described = []
            for node in members:
                files = [f for r in topology.ranks_on(node) for f in rank_files(manifest.files, r)]
                described.append({"node": node, "files": [[f, manifest.files[f]] for f in files]})
            sizes = [sum(size for _, size in m["files"]) for m in described]
            out.append(
                {
                    "group": str(g),
                    "data": len(members),
                    "parity": self.parity,
                    "chunk": CHUNK,
                    "coder": ErasureCode(len(members), self.parity).coder,
                    "stripe": stripe_length(sizes, CHUNK),
                    "members": described,
                    "parity_nodes": parity_nodes,
                    "save_id": manifest.save_id,
                    **({"tag": save_tag(manifest.save_id)} if self.replacing else {}),
                }
            )
        return out

    def exchange(
        self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint, link: DrainLink
    ) -> dict[str, int]:
        """Stream members to each group's encoder; encode; spread the parity blocks."""
        topology = self.topology
        assert topology is not None
        rank = link.rank
        stored = sent = 0
        for desc in self.groups(manifest):
            g, k, stripe = desc["group"], desc["data"], desc["stripe"]
            senders = [topology.leader(m["node"]) for m in desc["members"]]
            keepers = [topology.leader(n) for n in desc["parity_nodes"]]
            if rank in senders:
                member = desc["members"][senders.index(rank)]
                sent += send_block(
                    member_chunks(job.source, member["files"], stripe, CHUNK),
                    stripe,
                    keepers[0],
                    self.group,
                )
            elif rank == keepers[0]:
                stored += self._encode(desc, senders, keepers, target, link)
            elif rank in keepers:
                b = k + keepers.index(rank)
                path = parity_path(g, b, desc.get("tag"))
                if not recv_file(target.store, path, stripe, keepers[0], self.group, CHUNK):
                    raise DrainError(f"group {g} of step {job.step}: the encoder failed")
                stored += stripe
        return {"bytes_stored": stored, "bytes_sent": sent}

    def _encode(
        self,
        desc: dict[str, Any],
        senders: list[int],
        keepers: list[int],
        target: StoredCheckpoint,
        link: DrainLink,
    ) -> int:
        g, k, stripe = desc["group"], desc["data"], desc["stripe"]
        code = ErasureCode(k, self.parity, CHUNK)
        streams = [receive(stripe, s, self.group, CHUNK) for s in senders]
        outs = [OutStream(stripe, dst, self.group, CHUNK) for dst in keepers[1:]]
        checksums: dict[str, list[str]] = {str(k + j): [] for j in range(self.parity)}
        ok = False
        try:
            with target.store.open_write(parity_path(g, k, desc.get("tag"))) as mine:
                for _ in range(stripe // CHUNK):
                    pieces = [next(s) for s in streams]
                    for j, piece in enumerate(code.encode_chunk(pieces)):
                        checksums[str(k + j)].append(checksum_of(piece))
                        (mine.write if j == 0 else outs[j - 1].write)(piece)
                ok = all([status(s, self.group) for s in senders])
                if not ok:
                    raise DrainError(
                        f"group {g}: a member's first-level files failed their checksums"
                    )
        finally:
            for out in outs:
                out.finish(ok)
            link.put(f"erasure/{g}", {"ok": ok, "checksums": checksums})
        return stripe

    def sidecars(self, job: DrainJob, manifest: Manifest, link: DrainLink) -> dict[str, bytes]:
        """The placement, and the description of every group this node belongs to."""
        out = super().sidecars(job, manifest, link)
        assert self.topology is not None
        node = self.topology.nodes[link.rank]
        for desc in self.groups(manifest):
            if node in desc["parity_nodes"] or node in [m["node"] for m in desc["members"]]:
                (coded,) = link.get([f"erasure/{desc['group']}"])
                if not coded["ok"]:
                    raise DrainError(f"group {desc['group']} of step {job.step} was not encoded")
                desc["checksums"] = coded["checksums"]
                out[description_path(desc["group"], desc.get("tag"))] = json.dumps(desc).encode()
        return out

    def after_commit(self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint) -> None:
        """Remove the parity files of this node's part that the committed save does not
        name (another save's, replaced); never raises."""
        keep = {name.rsplit("/", 1)[-1] for name in self._names_of(self.groups(manifest))}
        for name in target.store.listdir(PARITY_DIR):
            if name not in keep:
                try:
                    target.store.remove_tree(f"{PARITY_DIR}/{name}")
                except OSError as e:  # committed already: leftovers only cost space
                    logger.warning(
                        "could not delete stale %s/%s in %s: %s", PARITY_DIR, name, target.url, e
                    )

    @staticmethod
    def _names_of(groups: list[dict[str, Any]]) -> list[str]:
        """Every parity block's and description's path of ``groups``."""
        out = []
        for desc in groups:
            tag = desc.get("tag")
            out.append(description_path(desc["group"], tag))
            out += [
                parity_path(desc["group"], b, tag)
                for b in range(desc["data"], desc["data"] + desc["parity"])
            ]
        return out

    def holdings(self, step: int) -> dict[str, Any]:
        """The group descriptions and parity blocks this node holds for ``step``
        (``LevelDriver.holdings``)."""
        ckpt = self.checkpoint(step)
        names = set(ckpt.store.listdir(PARITY_DIR))
        save_id = ckpt.manifest().save_id
        groups: dict[str, Any] = {}
        parity: list[list[Any]] = []
        for name in sorted(names):
            if name.startswith("group-") and name.endswith(".json"):
                desc = json.loads(ckpt.store.read_bytes(f"{PARITY_DIR}/{name}"))
                # A replacing drain that stopped before its commit left another save's.
                if desc.get("save_id") == save_id:
                    groups[desc["group"]] = desc
        for g, desc in groups.items():
            for b in range(desc["data"], desc["data"] + desc["parity"]):
                if parity_path(g, b, desc.get("tag")).rsplit("/", 1)[-1] in names:
                    parity.append([g, b])
        return {"groups": groups, "parity": parity}

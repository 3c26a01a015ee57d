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

One drain, group after group, chunk by chunk (every rank walks the same
order, so the blocking sends never deadlock): each member node's lowest rank
streams its member, verified item by item, to the *encoder* (the lowest rank
of the first parity node), which codes one chunk index at a time, keeps the
first parity block and streams the others on. Memory: ``data + parity``
chunks per rank.

A restore rebuilds a lost member on the node that needs it from any ``data``
surviving blocks (:func:`rebuild`); every parity chunk is checked against its
checksum as it is read, every member item as it streams, and the rebuilt
files item by item as they are written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, CorruptCheckpointError, DrainError
from ..format import Manifest, checksum_of
from ..stores import Store, WriteHandle
from .base import DrainJob
from .erasure_code import CHUNK, ErasureCode, stripe_length
from .link import DrainLink
from .node_local import NodeLocalLevel, rank_files
from .options import Level
from .topology import Topology
from .wire import SOURCE_ERRORS, FileVerifier, OutStream, file_blocks, receive, status

__all__ = ["ErasureLevel", "group_layout", "rebuild", "send_block"]

logger = logging.getLogger(__name__)

PARITY_DIR = "parity"


def parity_path(group: str, block: int) -> str:
    """Where a node keeps parity block ``block`` of group ``group``."""
    return f"{PARITY_DIR}/{group}-{block}.bin"


def description_path(group: str) -> str:
    """Where every node of a group keeps the group's description."""
    return f"{PARITY_DIR}/group-{group}.json"


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
                files = [f for r in topology.ranks_on(node) for f in rank_files(manifest, r)]
                described.append({"node": node, "files": [[f, manifest.files[f]] for f in files]})
            sizes = [sum(size for _, size in m["files"]) for m in described]
            out.append({
                "group": str(g), "data": len(members), "parity": self.parity, "chunk": CHUNK,
                "coder": ErasureCode(len(members), self.parity).coder,
                "stripe": stripe_length(sizes, CHUNK), "members": described,
                "parity_nodes": parity_nodes, "save_id": manifest.save_id,
            })  # fmt: skip
        return out

    def _leader(self, node: int) -> int:
        assert self.topology is not None
        return self.topology.ranks_on(node)[0]

    def exchange(
        self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint, link: DrainLink
    ) -> dict[str, int]:
        """Stream members to each group's encoder; encode; spread the parity blocks."""
        rank = link.rank
        stored = sent = 0
        self._checksums: dict[str, dict[str, list[str]]] = {}
        for desc in self.groups(manifest):
            g, k, stripe = desc["group"], desc["data"], desc["stripe"]
            senders = [self._leader(m["node"]) for m in desc["members"]]
            keepers = [self._leader(n) for n in desc["parity_nodes"]]
            if rank in senders:
                member = desc["members"][senders.index(rank)]
                sent += send_block(member_chunks(job.source, member["files"], stripe, CHUNK),
                                   stripe, keepers[0], self.group)  # fmt: skip
            elif rank == keepers[0]:
                stored += self._encode(desc, senders, keepers, target, link)
            elif rank in keepers:
                b = k + keepers.index(rank)
                with ExitStack() as stack:
                    out = stack.enter_context(target.store.open_write(parity_path(g, b)))
                    for view in receive(stripe, keepers[0], self.group, CHUNK):
                        out.write(view)
                    if not status(keepers[0], self.group):
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
            with target.store.open_write(parity_path(g, k)) as mine:
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
                out[description_path(desc["group"])] = json.dumps(desc).encode()
        return out

    def holdings(self, step: int) -> dict[str, Any]:
        """The group descriptions and parity blocks this node holds for ``step``."""
        ckpt = self.checkpoint(step)
        names = set(ckpt.store.listdir(PARITY_DIR))
        groups: dict[str, Any] = {}
        parity: list[list[Any]] = []
        for name in sorted(names):
            if name.startswith("group-") and name.endswith(".json"):
                desc = json.loads(ckpt.store.read_bytes(f"{PARITY_DIR}/{name}"))
                groups[desc["group"]] = desc
        for g, desc in groups.items():
            for b in range(desc["data"], desc["data"] + desc["parity"]):
                if f"{g}-{b}.bin" in names:
                    parity.append([g, b])
        return {"groups": groups, "parity": parity}


# --------------------------------------------------------------------------- streams


def rechunk(views: Iterable[memoryview], chunk: int, length: int) -> Iterator[memoryview]:
    """``views`` back to back, cut in ``chunk``-byte pieces, zero-padded to ``length``."""
    buf = bytearray(chunk)
    fill = emitted = 0
    for piece in views:
        view = memoryview(piece).cast("B")
        while len(view):
            n = min(chunk - fill, len(view))
            buf[fill : fill + n] = view[:n]
            fill += n
            view = view[n:]
            if fill == chunk:
                yield memoryview(buf)
                emitted += chunk
                fill = 0
    while emitted < length:
        buf[fill:] = bytes(chunk - fill)
        yield memoryview(buf)
        emitted += chunk
        fill = 0


def member_chunks(
    ckpt: StoredCheckpoint, files: Sequence[Sequence[Any]], stripe: int, chunk: int
) -> Iterator[memoryview]:
    """A member's chunks: its files (verified as read) back to back, padded to ``stripe``."""
    return rechunk(
        (view for name, _ in files for view in file_blocks(ckpt, name, chunk)), chunk, stripe
    )


def parity_chunks(ckpt: StoredCheckpoint, desc: dict[str, Any], block: int) -> Iterator[bytes]:
    """Parity block ``block`` of group ``desc``, each chunk checked against its checksum."""
    sums = desc["checksums"][str(block)]
    chunk = desc["chunk"]
    buf = memoryview(bytearray(chunk))
    with ckpt.store.open_read(parity_path(desc["group"], block)) as handle:
        if handle.size != desc["stripe"] or len(sums) * chunk != desc["stripe"]:
            raise CorruptCheckpointError(
                f"parity block {block} of group {desc['group']} in {ckpt.url} is "
                f"{handle.size} bytes, the group's stripe is {desc['stripe']}",
                checkpoint=ckpt.url,
            )
        for i, expected in enumerate(sums):
            if handle.read_into(i * chunk, buf) != chunk or checksum_of(buf) != expected:
                raise CorruptCheckpointError(
                    f"parity chunk {i} of block {block} of group {desc['group']} in {ckpt.url} "
                    "does not match its checksum",
                    checkpoint=ckpt.url,
                )
            yield buf


def block_chunks(ckpt: StoredCheckpoint, desc: dict[str, Any], block: int) -> Iterator[Any]:
    """Block ``block`` of group ``desc`` as this node holds it, chunk by chunk, verified."""
    if block < desc["data"]:
        files = desc["members"][block]["files"]
        return member_chunks(ckpt, files, desc["stripe"], desc["chunk"])
    return parity_chunks(ckpt, desc, block)


def send_block(chunks: Iterator[Any], length: int, dst: int, group: Any) -> int:
    """Stream ``chunks`` (``length`` bytes in all) to ``dst``; the bytes sent.

    A source that fails its checks is padded and sent with a bad status.
    """
    out = OutStream(length, dst, group, block=min(CHUNK, max(1, length)))
    try:
        for piece in chunks:
            out.write(piece)
    except SOURCE_ERRORS as e:
        logger.warning("dcp_multilevel: a block sent for erasure coding is damaged: %s", e)
        out.finish(False)
        return length
    out.finish(True)
    return length


# --------------------------------------------------------------------------- rebuild


class _MemberWriter:
    """Writes a member's bytes across its files, checking every item as it goes."""

    def __init__(self, stack: ExitStack, store: Store, manifest: StoredCheckpoint,
                 files: Sequence[Sequence[Any]]) -> None:  # fmt: skip
        self._files = [(name, size) for name, size in files]
        self._stack = stack
        self._store = store
        self._manifest = manifest
        self._index = -1
        self._left = 0
        self._pos = 0
        self._out: WriteHandle | None = None
        self._verifier: FileVerifier | None = None

    def _next_file(self) -> bool:
        if self._verifier is not None:
            self._verifier.finish()
        self._index += 1
        if self._index >= len(self._files):
            self._out = self._verifier = None
            return False
        name, size = self._files[self._index]
        self._out = self._stack.enter_context(self._store.open_write(name))
        self._verifier = FileVerifier(self._manifest, name)
        self._left, self._pos = size, 0
        return True

    def write(self, piece: memoryview | bytes) -> None:
        view = memoryview(piece).cast("B")
        while len(view):
            if self._left == 0 and not self._next_file():
                return  # the padding after the member's last file
            n = min(self._left, len(view))
            assert self._out is not None and self._verifier is not None
            self._verifier.feed(self._pos, view[:n])
            self._out.write(view[:n])
            self._pos += n
            self._left -= n
            view = view[n:]

    def close(self) -> None:
        while self._left == 0 and self._next_file():
            pass  # empty files at the end
        if self._index < len(self._files):
            raise CorruptCheckpointError(
                f"a rebuilt member ended inside {self._files[self._index][0]!r}",
                checkpoint=self._manifest.url,
            )


def rebuild(
    desc: dict[str, Any],
    missing: Sequence[int],
    sources: Sequence[tuple[int, int]],
    local: dict[int, StoredCheckpoint],
    into: Store,
    manifest: StoredCheckpoint,
    group: Any,
) -> list[tuple[int, int]]:
    """Rebuild members ``missing`` of group ``desc`` into ``into``; the sources found bad.

    ``sources``: (block, rank) for ``data`` blocks, in the order every rank
    agreed; blocks of this rank are read from ``local[block]`` (a checkpoint
    of this node's part of the level). ``manifest`` names the checkpoint's
    manifest for checking the rebuilt files. Nothing is kept unless every
    source vouched for its bytes and every rebuilt item matches its checksum.
    """
    me = _dist.rank()
    k, stripe, chunk = desc["data"], desc["stripe"], desc["chunk"]
    code = ErasureCode(k, desc["parity"], chunk)
    if desc.get("coder") != code.coder:
        raise CorruptCheckpointError(
            f"group {desc['group']} was coded with {desc.get('coder')!r}; this release codes "
            f"RS({k}+{desc['parity']}) with {code.coder!r} and cannot rebuild it",
            checkpoint=manifest.url,
        )
    bad: list[tuple[int, int]] = []
    streams: list[Iterator[Any]] = []
    for block, rank in sources:
        if rank == me:
            chunks = block_chunks(local[block], desc, block)
            on_error = lambda b=block: bad.append((b, me))  # noqa: E731
            streams.append(_padded_on_error(chunks, chunk, stripe, on_error))
        else:
            streams.append(receive(stripe, rank, group, chunk))
    blocks = [b for b, _ in sources]

    class _Failed(Exception):
        pass

    try:
        with ExitStack() as stack:
            writers = {
                y: _MemberWriter(stack, into, manifest, desc["members"][y]["files"])
                for y in missing
            }
            wrong: OSError | None = None
            for _ in range(stripe // chunk):
                decoded = code.decode_chunk([next(s) for s in streams], blocks)
                for y, writer in writers.items():
                    if wrong is None:
                        try:
                            writer.write(decoded[y])
                        except OSError as e:  # damage, or this disk: drain the streams first
                            wrong = e
            for block, rank in sources:
                if rank != me and not status(rank, group):
                    bad.append((block, rank))
            if wrong is not None and not isinstance(wrong, CorruptCheckpointError):
                raise wrong  # this node could not write: not the sources' fault
            if not bad and wrong is None:
                try:
                    for writer in writers.values():
                        writer.close()
                except CorruptCheckpointError as e:
                    wrong = e
            if not bad and wrong is not None:
                # Every source vouched for its bytes, yet the result is wrong: none
                # of them can be trusted for this group.
                logger.warning("dcp_multilevel: rebuilt files failed their checks: %s", wrong)
                bad = list(sources)
            if bad:
                raise _Failed
    except _Failed:
        return bad
    return []


def _padded_on_error(chunks: Iterator[Any], chunk: int, length: int, on_error: Any
                     ) -> Iterator[Any]:  # fmt: skip
    """``chunks``, or zeros for the rest of ``length`` once reading them failed."""
    sent = 0
    try:
        for piece in chunks:
            sent += chunk
            yield piece
    except SOURCE_ERRORS as e:
        logger.warning("dcp_multilevel: a local block for a rebuild is damaged: %s", e)
        on_error()
    zeros = bytes(chunk)
    while sent < length:
        sent += chunk
        yield zeros

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

On each node, below its directory (``node_level.py``)::

    step-<N>/data/...                     hard links to the node's own files
    step-<N>/parity/<group>-<block>.bin   the parity blocks this node holds
    step-<N>/parity/group-<group>.json    the group's description (members,
                                          files and sizes, where its parity is,
                                          one checksum per parity chunk), on
                                          every node of the group

A drain that replaces a node's step of another save (``overwrite=True``)
names its blocks and descriptions ``<group>-<block>.<tag>.bin`` and
``group-<group>.<tag>.json`` (:func:`save_tag`): the old ones stay
whole, and the old step restorable, until the node's new manifest commits;
then every parity file of another save goes (:meth:`ErasureLevel.after_commit`).

One drain, group after group, chunk by chunk (every rank walks the same
order, so the blocking sends never deadlock): each member node's lowest rank
streams its member, verified item by item, to the *encoder* (the lowest rank
of the first parity node), which codes one chunk index at a time, keeps the
first parity block and streams the others on. Memory: ``data + parity``
chunks per rank.

A restore rebuilds a lost member on the node that needs it from any ``data``
surviving blocks (:class:`ErasureRebuilder`, :func:`rebuild`);
every parity chunk is checked against its checksum as it is read, every
member item as it streams, and the rebuilt files item by item as they are
written.

**Blocks** on disk and on the wire: paths, chunk streams, rebuild.

A group's *blocks* are its members (one node's files back to back, padded to the
group's stripe) and its parity blocks. They are read as streams of whole chunks,
every byte verified as it goes (a member's items against the manifest, a parity
chunk against its checksum), and sent as ``wire.py`` streams with a status word.

**In a restore** (:class:`ErasureRebuilder`, the :class:`~.base.Rebuilder` protocol): a
group description (written one per group, reported by ``holdings``) names the
group's ``data`` members (their node and files), its ``parity`` blocks and the
nodes that keep them. Any ``data`` intact blocks rebuild every member a node
lacks, in one pass (:func:`rebuild`), on the node that needs them; every rebuilt
item is checked before a file is kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import ConfigError, CorruptCheckpointError, DrainError
from ..format import Manifest, checksum_of, rank_files
from ..stores import Store, WriteHandle
from .base import DrainChannel, DrainJob, RebuildChoice
from .config import Level
from .erasure_code import CHUNK, ErasureCode, stripe_length
from .node_level import NodeLevel
from .topology import Topology
from .wire import (
    SOURCE_ERRORS,
    FileVerifier,
    OutStream,
    WriteBehind,
    file_blocks,
    read_ahead,
    receive,
    recv_file,
    status,
)

__all__ = [
    "PARITY_DIR",
    "ErasureLevel",
    "ErasureRebuilder",
    "block_chunks",
    "description_path",
    "group_layout",
    "member_chunks",
    "parity_path",
    "rebuild",
    "rechunk",
    "save_tag",
    "send_block",
]


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


#: Where a node keeps its parity blocks and group descriptions, below a step.
PARITY_DIR = "parity"


def parity_path(group: str, block: int, tag: str | None = None) -> str:
    """Where a node keeps parity block ``block`` of group ``group`` (``tag``: the
    description's, see :func:`save_tag`)."""
    return f"{PARITY_DIR}/{group}-{block}{_suffix(tag)}.bin"


def description_path(group: str, tag: str | None = None) -> str:
    """Where every node of a group keeps the group's description."""
    return f"{PARITY_DIR}/group-{group}{_suffix(tag)}.json"


def save_tag(save_id: str) -> str:
    """What a drain that replaces another save's step adds to the names of its parity
    blocks and descriptions (``desc["tag"]``): the old ones, of fixed names, stay
    whole beside them until the node's new manifest commits."""
    return hashlib.sha256(save_id.encode()).hexdigest()[:12]


def _suffix(tag: str | None) -> str:
    return f".{tag}" if tag else ""


# --------------------------------------------------------------------------- streams


def rechunk(
    views: Iterable[memoryview], chunk: int, length: int
) -> Generator[memoryview, None, None]:
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
) -> Generator[memoryview, None, None]:
    """A member's chunks: its files (verified as read) back to back, padded to ``stripe``."""
    return rechunk(
        (view for name, _ in files for view in file_blocks(ckpt, name, chunk)), chunk, stripe
    )


def parity_chunks(
    ckpt: StoredCheckpoint, desc: dict[str, Any], block: int
) -> Generator[memoryview, None, None]:
    """Parity block ``block`` of group ``desc``, each chunk checked against its checksum."""
    sums = desc["checksums"][str(block)]
    chunk = desc["chunk"]
    buf = memoryview(bytearray(chunk))
    with ckpt.store.open_read(parity_path(desc["group"], block, desc.get("tag"))) as handle:
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


def block_chunks(
    ckpt: StoredCheckpoint, desc: dict[str, Any], block: int
) -> Generator[Any, None, None]:
    """Block ``block`` of group ``desc`` as this node holds it, chunk by chunk, verified."""
    if block < desc["data"]:
        files = desc["members"][block]["files"]
        return member_chunks(ckpt, files, desc["stripe"], desc["chunk"])
    return parity_chunks(ckpt, desc, block)


def send_block(chunks: Generator[Any, None, None], length: int, dst: int, group: Any) -> int:
    """Stream ``chunks`` (``length`` bytes in all, read ahead on a thread) to ``dst``;
    the bytes sent.

    A source that fails its checks is padded and sent with a bad status.
    """
    out = OutStream(length, dst, group, block=min(CHUNK, max(1, length)))
    try:
        for piece in read_ahead(chunks):
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

    def __init__(
        self,
        stack: ExitStack,
        store: Store,
        manifest: StoredCheckpoint,
        files: Sequence[Sequence[Any]],
    ) -> None:
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
            chunks = read_ahead(block_chunks(local[block], desc, block))
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
            # The writes (and their checks) run behind the receives and the decoding;
            # a rebuilt piece is a new buffer per chunk (decode_chunk), never a
            # received one, so it stays valid while it waits.
            with WriteBehind(lambda job: writers[job[0]].write(job[1])) as behind:
                for _ in range(stripe // chunk):
                    decoded = code.decode_chunk([next(s) for s in streams], blocks)
                    for y in writers:
                        behind.put((y, decoded[y]))
            wrong = behind.error  # damage, or this disk: the streams were drained first
            if wrong is not None and not isinstance(wrong, OSError):
                raise wrong
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


def _padded_on_error(
    chunks: Iterator[Any], chunk: int, length: int, on_error: Any
) -> Iterator[Any]:
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


class ErasureRebuilder:
    """Rebuilds of Reed-Solomon groups (``ErasureLevel.rebuilder``)."""

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
        reason: str | None = None
        for g, desc in sorted(groups.items()):
            members = [{f for f, _ in m["files"]} for m in desc["members"]]
            if not any(file in m for m in members):
                continue
            k, m = desc["data"], desc["parity"]
            # Rebuild the members this node lacks and cannot copy (together: one pass).
            lost = [y for y in range(k) if any(not copyable(f) for f in members[y] & wanted)]
            holders = _block_holders(level, g, desc, members, inventories, block_damaged)
            usable = [(b, holders[b]) for b in range(k + m) if b not in lost and b in holders]
            if len(usable) >= k:
                brings = tuple(sorted(f for y in lost for f in members[y]))
                return RebuildChoice(g, tuple(lost), tuple(usable[:k]), brings)
            gone = [
                desc["members"][b]["node"] if b < k else desc["parity_nodes"][b - k]
                for b in range(k + m)
                if b not in holders
            ]
            reason = (
                f"group {g}: RS({k}+{m}) needs {k} intact blocks, has {len(usable)} (blocks "
                f"of nodes {gone} lost or damaged; tolerates {m})"
            )
        return reason

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
        return rebuild(desc, members, sources, local, store, into, group)

    def send(
        self, desc: dict[str, Any], block: int, source: StoredCheckpoint, dst: int, group: Any
    ) -> None:
        send_block(block_chunks(source, desc, block), desc["stripe"], dst, group)


def _block_holders(
    level: int,
    g: str,
    desc: dict[str, Any],
    members: list[set[str]],
    inventories: Sequence[Any],
    block_damaged: Callable[[str, int, int], bool],
) -> dict[int, int]:
    """block -> the lowest rank that can stream it intact."""
    out: dict[int, int] = {}
    k = desc["data"]
    # Only the group's nodes hold its blocks: a restore at scale asks about a few
    # groups among thousands of nodes.
    nodes = {m["node"] for m in desc["members"]} | set(desc["parity_nodes"])
    for inv in sorted((i for i in inventories if i.node in nodes), key=lambda i: i.rank):
        held = set(inv.files.get(level, ()))
        for y, files in enumerate(members):
            if y not in out and files <= held and not block_damaged(g, y, inv.rank):
                out[y] = inv.rank
        for pg, b in inv.parity.get(level, ()):
            if pg == g and b >= k and b not in out and not block_damaged(g, b, inv.rank):
                out[b] = inv.rank
    return out


class ErasureLevel(NodeLevel):
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
        self, job: DrainJob, manifest: Manifest, target: StoredCheckpoint, link: DrainChannel
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
        link: DrainChannel,
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

    def sidecars(self, job: DrainJob, manifest: Manifest, link: DrainChannel) -> dict[str, bytes]:
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

"""An erasure group's blocks on disk and on the wire: paths, chunk streams, rebuild.

A group's *blocks* (``erasure.py``) are its members (one node's files back to
back, padded to the group's stripe) and its parity blocks. This module
reads them as streams of whole chunks, every byte verified as it goes (a
member's items against the manifest, a parity chunk against its checksum),
sends them (``wire.py`` streams with a status word), and rebuilds lost
members from any ``data`` intact blocks on the node that needs them,
checking every rebuilt item before a file is kept.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from .. import _dist
from ..checkpoint import StoredCheckpoint
from ..errors import CorruptCheckpointError
from ..format import checksum_of
from ..stores import Store, WriteHandle
from .erasure_code import CHUNK, ErasureCode
from .overlap import WriteBehind, read_ahead
from .wire import SOURCE_ERRORS, FileVerifier, OutStream, file_blocks, receive, status

__all__ = [
    "PARITY_DIR",
    "block_chunks",
    "description_path",
    "member_chunks",
    "parity_path",
    "rebuild",
    "rechunk",
    "save_tag",
    "send_block",
]

logger = logging.getLogger(__name__)

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

"""A delta checkpoint's reference: finding it, checking it, streaming its bytes.

A delta checkpoint (format version 2, ``format/manifest.py``) names its
reference: a sibling directory and the ``save_id`` it held when the delta
was written. Each item with delta chunks records the checksum that the
reference's manifest gives the same item. Before a single byte of the
reference is used, both are checked: the sibling must be committed, be
that save, and record that checksum for the item; then the reference
item's bytes are verified like any item's (per chunk as they are decoded,
and against the item checksum at the end). Any failure is a
:class:`~dcp_multilevel.errors.BrokenChainError` naming the chain from the
delta to the checkpoint that failed, so a reader goes on to another copy.

:class:`ItemStream` gives one item's raw bytes in order, a chunk at a time,
reading only what it is asked for plus one chunk: writers XOR a new chunk
with it before coding (``codecs/pipeline.py``), readers after decoding
(``codecs/pipeline.py``). A reference that is itself a delta streams its own
reference the same way, so a chain of any length needs one chunk of memory
per link. The streams of a load or a drain read their references' data files
through one :class:`ReferenceFiles` per thread: one open handle per file,
shared by every delta item that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..codecs import Codec
from ..errors import BrokenChainError, DcpMultilevelError
from ..format import Hasher, ItemLocation, Manifest, frames
from ..stores import ReadHandle
from .items import ItemRef, item_codec, truncated, verify

if TYPE_CHECKING:
    from .stored import StoredCheckpoint

__all__ = ["ItemStream", "ReferenceFiles", "chunk_of", "delta_base", "open_reference"]


#: Bytes read at a time when an uncoded reference item is skipped (it is
#: still read: its checksum covers every byte).
_SKIP_BLOCK = 4 << 20


def chunk_of(
    manifest: Manifest, index: MetadataIndex
) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, sizes) of the tensor chunk ``index`` names in ``manifest`` (None: not a
    tensor chunk there)."""
    md = manifest.metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata) or index.offset is None:
        return None
    offsets = tuple(index.offset)
    sizes = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offsets), None)
    return None if sizes is None else (md.properties.dtype, sizes)


def delta_base(
    reference: Manifest, index: MetadataIndex, dtype: torch.dtype, sizes: tuple[int, ...]
) -> ItemLocation | None:
    """Where ``reference`` stores the chunk ``index`` (of ``dtype`` and ``sizes``) alike:
    the same dtype, place and shape; None when it does not, and the chunk is stored
    whole. One rule for the writer and for drains that code deltas, so a tensor
    reshaped to the same number of bytes is never coded against its old shape."""
    if reference.locations.get(index) is None or chunk_of(reference, index) != (
        dtype,
        tuple(sizes),
    ):
        return None
    return reference.locations[index]


def open_reference(
    delta: StoredCheckpoint,
    index: MetadataIndex,
    loc: ItemLocation,
    chain: tuple[str, ...] = (),
    files: ReferenceFiles | None = None,
) -> ItemStream:
    """The stream of item ``index``'s bytes in the reference of ``delta`` (whose item
    ``loc`` names it), checked: the reference is that save and records that checksum.

    ``chain``: the checkpoints before ``delta`` in a chain being read (for errors).
    ``files``: where to open the reference's data files (held open across items),
    else the stream opens its own.

    Raises:
        BrokenChainError: the reference is missing, another save, lacks the item
            or records another checksum for it, or its data file cannot be opened.
    """
    chain = (*chain, delta.url)
    manifest = delta.manifest()
    link = manifest.reference
    if link is None or loc.reference is None:
        raise _broken(chain, index, "the item is a delta but the checkpoint names no reference")
    try:
        ref = delta.reference()
        assert ref is not None  # manifest.reference is set
        ref_manifest = ref.manifest()
    except (DcpMultilevelError, OSError) as e:
        raise _broken((*chain, f"{link.checkpoint} (sibling)"), index, str(e)) from None
    chain = (*chain, ref.url)
    if ref_manifest.save_id != link.save_id:
        raise _broken(
            chain,
            index,
            f"it holds save {ref_manifest.save_id}, the delta was coded against save "
            f"{link.save_id} (the reference was replaced)",
        )
    ref_loc = ref_manifest.locations.get(index)
    if ref_loc is None:
        raise _broken(chain, index, "it does not store the item")
    if ref_loc.checksum != loc.reference:
        raise _broken(
            chain,
            index,
            f"its item has checksum {ref_loc.checksum}, the delta was coded against "
            f"{loc.reference}",
        )
    return ItemStream.opened(ref, index, ref_loc, chain, files)


class ItemStream:
    """One stored item's raw bytes in order, verified (a ``ReferenceSource``).

    Call order: :meth:`open` (done by :meth:`opened`), then :meth:`take`,
    :meth:`take_into` or :meth:`skip` until ``loc.raw_length`` bytes are covered,
    then :meth:`finish` (checks the checksum and closes); :meth:`close` on
    any error. Not thread-safe: one thread walks it, in order.
    """

    def __init__(
        self,
        ckpt: StoredCheckpoint,
        index: MetadataIndex,
        loc: ItemLocation,
        chain: tuple[str, ...],
        files: ReferenceFiles | None = None,
    ) -> None:
        self.ckpt = ckpt
        self.index = index
        self.loc = loc
        self.chain = chain
        self.used = False
        #: The item's stored / raw size (coded whole; None for a delta or an empty item).
        self.ratio = (
            loc.length / loc.raw_length if loc.raw_length and loc.reference is None else None
        )
        self._ref = ItemRef(ckpt.url, index.fqn, loc)
        self._stack = ExitStack()
        self._handle: ReadHandle | None = None
        self._hasher = Hasher()
        self._pos = loc.offset  # next stored byte to read
        self._left = loc.raw_length  # raw bytes not yet taken or skipped
        self._cur = memoryview(b"")  # decoded bytes of the current chunk not yet handed out
        self._header: frames.FrameHeader | None = None
        self._codec: Codec | None = None
        self._inner: ItemStream | None = None  # this item's own reference, if it is a delta
        self._files = files
        self._chunks = 0  # chunk records read (names a corrupt one)

    @classmethod
    def opened(
        cls,
        ckpt: StoredCheckpoint,
        index: MetadataIndex,
        loc: ItemLocation,
        chain: tuple[str, ...],
        files: ReferenceFiles | None = None,
    ) -> ItemStream:
        """A stream of item ``index`` (at ``loc`` in ``ckpt``), opened; nothing is left
        open when opening fails (``BrokenChainError``). ``files``: as for
        :func:`open_reference`."""
        stream = cls(ckpt, index, loc, chain, files)
        try:
            stream.open()
        except BaseException:
            stream.close()
            raise
        return stream

    # ------------------------------------------------------------------ protocol

    def open(self) -> None:
        """Open the data file; read the frame header of a coded item."""
        with self._failures():
            # Fetched no further than the item's end (or the planned items'): on
            # an object store a handle fetches blocks of up to 32 MiB, and one
            # past the item is read for nothing (a delta's restore from a remote
            # read several times its bytes).
            end = self.loc.offset + self.loc.length
            if self._files is not None:
                self._handle = self._files.open(self.ckpt, self.loc.file, self.index.fqn, end)
            else:
                self._handle = self._stack.enter_context(
                    self.ckpt.open_data(self.loc.file, self.index.fqn, end)
                )
            if self.loc.transforms:
                self._codec = item_codec(self._ref)
                self._header = frames.read_header(self._read, self.loc.raw_length)
                if self.loc.reference is not None:
                    self._inner = self._stack.enter_context(
                        closing(
                            open_reference(
                                self.ckpt, self.index, self.loc, self.chain[:-1], self._files
                            )
                        )
                    )

    def take(self, n: int) -> memoryview:
        """The next ``n`` raw bytes (a buffer the caller may keep)."""
        with self._failures():
            if not self._cur and self._header is None:  # uncoded: straight from the file
                self._spend(n)
                return self._read(n)
            parts = []
            while n:
                if not self._cur:
                    self._cur = self._decode(*self._next_chunk())
                piece, self._cur = self._cur[:n], self._cur[n:]
                parts.append(piece)
                n -= len(piece)
            if len(parts) == 1:
                return parts[0]
            return memoryview(np.concatenate([np.frombuffer(p, np.uint8) for p in parts]))

    def take_into(self, n: int) -> Callable[[memoryview], None]:
        """:meth:`take`, with the decoding left to the caller's thread.

        The stored bytes are read and hashed now, in order; the returned
        function decodes them into the ``n``-byte buffer it is given (a delta
        chunk: its reference's bytes first, then its own XORed onto them), so
        coding threads decode references in parallel and a chain decodes in
        one buffer. A chunk that is not exactly ``n`` bytes (the reference was
        framed with another chunk size) is decoded now.
        """
        with self._failures():
            if self._header is not None and not self._cur and self._left:
                rec, payload = self._next_chunk()
                if rec.raw_len == n:
                    inner = None
                    if rec.method == frames.METHOD_DELTA:
                        inner = self._inner.take_into(n)  # type: ignore[union-attr]
                    return lambda out: self._decode_checked(rec, payload, inner, out)
                self._cur = self._decode(rec, payload)
        return _copier(self.take(n))

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` raw bytes (whole chunks are read, checked, not decoded)."""
        with self._failures():
            while n:
                if self._cur:
                    k = min(n, len(self._cur))
                    self._cur = self._cur[k:]
                    n -= k
                elif self._header is None:
                    k = min(n, _SKIP_BLOCK)
                    self._spend(k)
                    self._read(k)
                    n -= k
                else:
                    rec, payload = self._next_chunk()
                    if rec.raw_len <= n:
                        if rec.method == frames.METHOD_DELTA:
                            self._inner.skip(rec.raw_len)  # type: ignore[union-attr]
                        n -= rec.raw_len
                    else:
                        self._cur = self._decode(rec, payload)

    def finish(self) -> None:
        """Check that every byte was covered and the item's checksum; close."""
        try:
            with self._failures():
                if self._left or self._cur:
                    raise ValueError(f"{self._left + len(self._cur)} bytes were never read")
                if self._header is not None:
                    end = frames.unpack_chunk(self._read(frames.CHUNK.size))
                    if not end.is_terminator or self._pos != self.loc.offset + self.loc.length:
                        raise frames.FrameError("the frames do not end where the item does")
                verify(self._hasher, self._ref)
                if self._inner is not None:
                    self._inner.finish()
        finally:
            self.close()

    def close(self) -> None:
        """Release the data file (and the inner stream's)."""
        self._stack.close()

    # ------------------------------------------------------------------ internals

    def _spend(self, n: int) -> None:
        if n > self._left:
            raise ValueError(f"asked for {n} bytes, {self._left} left in the item")
        self._left -= n

    def _read(self, n: int) -> memoryview:
        if self._pos + n > self.loc.offset + self.loc.length:
            raise frames.FrameError("the frames run past the item's stored bytes")
        buf = memoryview(np.empty(n, np.uint8))
        got = self._handle.read_into(self._pos, buf)  # type: ignore[union-attr]
        if got != n:
            raise truncated(self._ref, self._pos + got)
        self._hasher.update(buf)
        self._pos += n
        return buf

    def _next_chunk(self) -> tuple[frames.ChunkRecord, memoryview]:
        try:
            rec, payload = frames.read_chunk(self._read, self._header, self._left)  # type: ignore[arg-type]
        except frames.FrameError as e:
            raise frames.FrameError(f"chunk {self._chunks}: {e}") from None
        if payload is None:
            raise frames.FrameError("the frames end before the item does")
        self._chunks += 1
        if rec.method == frames.METHOD_DELTA and self._inner is None:
            raise frames.FrameError("a delta chunk in an item stored without a reference")
        self._spend(rec.raw_len)
        return rec, payload

    def _decode(self, rec: frames.ChunkRecord, payload: memoryview) -> memoryview:
        """The chunk's raw bytes, in a new buffer (a raw chunk: its payload)."""
        if rec.method == frames.METHOD_RAW:
            return payload
        inner = None
        if rec.method == frames.METHOD_DELTA:
            inner = _copier(self._inner.take(rec.raw_len))  # type: ignore[union-attr]
        out = memoryview(np.empty(rec.raw_len, np.uint8))
        self._decode_into(rec, payload, inner, out)
        return out

    def _decode_into(
        self,
        rec: frames.ChunkRecord,
        payload: memoryview,
        inner: Callable[[memoryview], None] | None,
        out: memoryview,
    ) -> None:
        """The chunk's raw bytes into ``out`` (``inner`` writes the inner reference's,
        for a delta chunk)."""
        h = self._header
        if rec.method == frames.METHOD_RAW:
            out[:] = payload
        elif inner is None:
            self._codec.decode(payload, out, h.width, h.rotate)  # type: ignore[union-attr]
        else:
            inner(out)
            self._codec.decode_xor(payload, out, h.width, h.rotate)  # type: ignore[union-attr]

    def _decode_checked(
        self,
        rec: frames.ChunkRecord,
        payload: memoryview,
        inner: Callable[[memoryview], None] | None,
        out: memoryview,
    ) -> None:
        """:meth:`_decode_into` on another thread: its failures name the chain too."""
        with self._failures():
            self._decode_into(rec, payload, inner, out)

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """Any failure inside becomes a BrokenChainError naming the chain."""
        try:
            yield
        except BrokenChainError:
            raise
        except (DcpMultilevelError, OSError, ValueError) as e:
            raise _broken(self.chain, self.index, str(e), file=self.loc.file) from e


def _copier(data: memoryview) -> Callable[[memoryview], None]:
    """A ``take_into`` function for bytes already at hand."""

    def fill(out: memoryview) -> None:
        out[:] = data

    return fill


def _broken(
    chain: tuple[str, ...], index: MetadataIndex, why: str, *, file: str | None = None
) -> BrokenChainError:
    name = index.fqn if index.offset is None else f"{index.fqn} (offsets {list(index.offset)})"
    delta, failed = chain[0], chain[-1]
    path = " -> ".join(chain)
    return BrokenChainError(
        f"item {name!r} of delta checkpoint {delta} cannot be rebuilt: its reference chain "
        f"{path} is broken at {failed}: {why}. Load this step from another copy (a level "
        "holding it whole, or with an intact chain), or an older step.",
        checkpoint=delta,
        chain=chain,
        file=file,
        fqn=index.fqn,
    )


class ReferenceFiles:
    """The references' data files, held open across the items that one thread reads.

    On an object store every open handle fetches its own blocks: a handle per
    item cost a request per item and fetched nothing ahead. One thread reading
    a delta's file keeps one of these: :meth:`plan` says which items it will
    read (each reference file is then fetched in large blocks up to the end of
    the last item read from it), :meth:`open` is called by each item's stream
    (``ItemStream``), :meth:`close` at the end. Not thread-safe.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._open: dict[tuple[str, str], ReadHandle] = {}
        self._ends: dict[tuple[str, str], int] = {}

    def plan(
        self, delta: StoredCheckpoint, items: list[tuple[MetadataIndex, ItemLocation]]
    ) -> None:
        """Note where the references of ``delta``'s ``items`` end in their files (down
        the chain). A reference that cannot be read is skipped here: reading the item
        raises the chain's error."""
        items = [(i, loc) for i, loc in items if loc.reference is not None]
        while items:
            try:
                ref = delta.reference()
                locations = ref.manifest().locations if ref is not None else {}
            except (DcpMultilevelError, OSError):
                return
            inner = []
            for index, _ in items:
                ref_loc = locations.get(index)
                if ref_loc is None:
                    continue
                key = (ref.url, ref_loc.file)  # type: ignore[union-attr]
                self._ends[key] = max(self._ends.get(key, 0), ref_loc.offset + ref_loc.length)
                if ref_loc.reference is not None:
                    inner.append((index, ref_loc))
            delta, items = ref, inner  # type: ignore[assignment]

    def open(self, ckpt: StoredCheckpoint, file: str, fqn: str, end: int) -> ReadHandle:
        """``ckpt``'s data file ``file``, opened once (``fqn`` names the item in errors;
        ``end``: where the item ends, how far an unplanned file is fetched at once)."""
        key = (ckpt.url, file)
        handle = self._open.get(key)
        if handle is None:
            handle = self._stack.enter_context(ckpt.open_data(file, fqn, self._ends.get(key, end)))
            self._open[key] = handle
        return handle

    def close(self) -> None:
        """Close every file opened."""
        self._open.clear()
        self._stack.close()

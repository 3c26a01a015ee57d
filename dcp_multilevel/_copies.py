"""One stored copy of a checkpoint, as a reader sees it: a tier, its manifest, its items.

The same checkpoint may be stored several times (node-local disk, a remote
bucket, ...), each copy with its own encoding and file layout and therefore its
own manifest. :class:`CheckpointCopy` reads items from one copy and verifies
them against that copy's manifest; choosing which copy serves which item is
the reader's job (``reader.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import ExitStack, contextmanager
from typing import Any

from .codecs import codec_from_descriptor, decode_frames
from .errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DcpMultilevelError,
    ManifestError,
    RegistryError,
    TruncatedDataError,
)
from .format import MANIFEST_NAME, Hasher, ItemLocation, Manifest, decode_manifest
from .format.tensor_bytes import pieces
from .stores import ReadHandle, Store, store_for

__all__ = ["COALESCE_BYTES", "CheckpointCopy", "CoalescingReader"]

#: Largest block a CoalescingReader fetches at once (its memory per open file).
COALESCE_BYTES = 32 << 20


class CoalescingReader:
    """A :class:`ReadHandle` that serves small reads from larger ranged requests.

    Compressed items are read frame record by frame record; on an object
    store each read would be one ranged GET. This wrapper fetches up to
    :data:`COALESCE_BYTES` (never past ``limit``) and serves the following
    reads from memory, so adjacent items and frames cost one request. Reads
    at least as large as a block go straight to the handle (no copy).
    Not thread-safe: one per reading thread.
    """

    __slots__ = ("_buf", "_handle", "_limit", "_start", "requests")

    def __init__(self, handle: ReadHandle, limit: int | None) -> None:
        self._handle = handle
        self._limit = handle.size if limit is None else min(limit, handle.size)
        self._buf = memoryview(b"")
        self._start = 0
        self.requests = 0

    @property
    def size(self) -> int:
        return self._handle.size

    def read_into(self, offset: int, out: memoryview) -> int:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(out)
        end = offset + n
        if self._start <= offset and end <= self._start + len(self._buf):
            out[:] = self._buf[offset - self._start : end - self._start]
            return n
        block = min(COALESCE_BYTES, max(0, self._limit - offset))
        if n >= block:
            self.requests += 1
            return self._handle.read_into(offset, out)
        buf = memoryview(bytearray(block))
        self.requests += 1
        got = self._handle.read_into(offset, buf)
        self._buf, self._start = buf[:got], offset
        take = min(n, got)
        out[:take] = self._buf[:take]
        return take


class CheckpointCopy:
    """The copy of one checkpoint stored at ``location`` (a path or URL).

    Args:
        location: where the copy is (``/nvme/run1/step-100``, ``s3://b/run1/step-100``).
        storage_options: options for its tier (see :func:`~dcp_multilevel.stores.store_for`).
        manifest_bytes: the copy's ``manifest.json`` as another process read it
            (a node-local tier whose manifest is on rank 0's node); validated
            like one read from storage, which is then not asked for it.

    Call :meth:`manifest` first (one thread); after it has returned, the read
    methods may be called from several threads at once.
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        storage_options: dict[str, Any],
        manifest_bytes: bytes | None = None,
    ) -> None:
        self.location = os.fspath(location)
        self.store: Store = store_for(self.location, **storage_options)
        self._manifest_bytes = manifest_bytes
        self._manifest: Manifest | None = None
        self._error: DcpMultilevelError | OSError | None = None

    @property
    def url(self) -> str:
        """The copy's location as a URL (how messages and metrics name it)."""
        return self.store.url

    def manifest(self) -> Manifest:
        """The copy's validated manifest, read on first use.

        A failure is remembered too: asking again raises the same error without
        touching storage, until :meth:`forget`.

        Raises:
            CheckpointNotFoundError: the copy has no manifest (not committed).
            ManifestError: the manifest is invalid.
            OSError: the storage could not be read (e.g. ``RemoteStoreError``).
        """
        if self._manifest is None:
            if self._error is not None:
                raise self._error
            try:
                self._manifest = self._read_manifest()
            except (DcpMultilevelError, OSError) as e:
                self._error = e
                raise
        return self._manifest

    def forget(self) -> None:
        """Drop the cached manifest (or error): the next load reads it again."""
        self._manifest = None
        self._error = None

    def _read_manifest(self) -> Manifest:
        if self._manifest_bytes is not None:
            return decode_manifest(self._manifest_bytes, checkpoint=self.url)
        try:
            raw = self.store.read_bytes(MANIFEST_NAME)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.url}: {MANIFEST_NAME} is missing "
                "(a save that did not finish leaves none). Check the path, or load an "
                "earlier checkpoint.",
                checkpoint=self.url,
            ) from None
        return decode_manifest(raw, checkpoint=self.url)

    # ------------------------------------------------------------------ data

    @contextmanager
    def open_file(self, file: str, fqn: str, limit: int | None = None) -> Iterator[ReadHandle]:
        """Open data file ``file`` after checking it has the size the manifest records.

        ``fqn`` (an item that needs the file) only names it in the error. On a
        tier where every request is a round trip (``prefers_large_reads``),
        reads are served from blocks of up to :data:`COALESCE_BYTES` fetched
        in one request each, never past byte ``limit`` (the end of the last
        item the caller needs; None: the whole file).

        Raises:
            TruncatedDataError: the file is missing or has the wrong size.
        """
        expected = self.manifest().files[file]
        with ExitStack() as stack:
            try:
                handle = stack.enter_context(self.store.open_read(file))
            except FileNotFoundError:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.url} is missing "
                    f"(needed for {fqn!r}); the checkpoint is damaged",
                    checkpoint=self.url,
                    file=file,
                    fqn=fqn,
                ) from None
            if self.store.prefers_large_reads:
                handle = CoalescingReader(handle, limit)
            if handle.size != expected:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.url} is {handle.size} bytes, "
                    f"the manifest says {expected}; the checkpoint is damaged",
                    checkpoint=self.url,
                    file=file,
                )
            yield handle

    def fill(
        self,
        handle: ReadHandle,
        fqn: str,
        loc: ItemLocation,
        out: memoryview,
        *,
        pool: Executor | None,
        window: int,
    ) -> None:
        """Put the decoded bytes of ``loc`` (``loc.raw_length`` of them) into ``out``.

        ``out`` holds verified bytes only when this returns; on an error it may
        hold anything.

        Raises:
            CorruptCheckpointError: the stored bytes do not match the manifest
                (``ChecksumMismatchError``, ``TruncatedDataError``, a corrupt frame).
            ManifestError: the item needs a codec this installation lacks.
            OSError: the storage could not be read.
        """
        if loc.transforms:
            self._fill_coded(handle, fqn, loc, out, pool, window)
        else:
            self._fill_raw(handle, fqn, loc, out)

    def _fill_raw(self, handle: ReadHandle, fqn: str, loc: ItemLocation, out: memoryview) -> None:
        """Read ``loc`` into ``out`` piece by piece, verifying the checksum."""
        hasher = Hasher()
        pos = loc.offset
        for piece in pieces(out):
            n = handle.read_into(pos, piece)
            if n != len(piece):
                raise TruncatedDataError(
                    f"data file {loc.file!r} of checkpoint {self.url} ended at byte {pos + n} "
                    f"inside item {fqn!r} (bytes {loc.offset}..{loc.offset + loc.length})",
                    checkpoint=self.url,
                    file=loc.file,
                    fqn=fqn,
                )
            hasher.update(piece)
            pos += n
        self._verify(hasher, fqn, loc)

    def _fill_coded(
        self,
        handle: ReadHandle,
        fqn: str,
        loc: ItemLocation,
        out: memoryview,
        pool: Executor | None,
        window: int,
    ) -> None:
        """Stream the framed item through its codec into ``out`` (bounded memory)."""
        file = loc.file
        if len(loc.transforms) != 1:
            raise ManifestError(
                f"item {fqn!r} in {file!r} of checkpoint {self.url} has transforms "
                f"{list(loc.transforms)}; dcp_multilevel applies exactly one codec per item",
                checkpoint=self.url,
            )
        try:
            codec = codec_from_descriptor(loc.transforms[0])
        except RegistryError as e:
            raise ManifestError(
                f"item {fqn!r} in {file!r} of checkpoint {self.url} needs codec "
                f"{loc.transforms[0]!r}: {e}",
                checkpoint=self.url,
            ) from None
        hasher = Hasher()
        pos, end = loc.offset, loc.offset + loc.length

        def read(n: int) -> memoryview:
            nonlocal pos
            if pos + n > end:
                raise chunk_error(-2, f"frames run past the item's {loc.length} stored bytes")
            buf = memoryview(bytearray(n))
            if handle.read_into(pos, buf) != n:
                raise TruncatedDataError(
                    f"data file {file!r} of checkpoint {self.url} ended inside item {fqn!r}",
                    checkpoint=self.url,
                    file=file,
                    fqn=fqn,
                )
            hasher.update(buf)
            pos += n
            return buf

        def chunk_error(index: int, why: str) -> CorruptCheckpointError:
            where = "framing" if index < 0 else f"chunk {index}"
            return CorruptCheckpointError(
                f"compressed item {fqn!r} in {file!r} of checkpoint {self.url} is "
                f"corrupt: {where}: {why}. Load from another copy.",
                checkpoint=self.url,
                file=file,
                fqn=fqn,
            )

        decode_frames(read, out, codec, pool=pool, window=window, on_chunk_error=chunk_error)
        if pos != end:
            raise chunk_error(-2, f"{end - pos} stored bytes follow the last frame")
        self._verify(hasher, fqn, loc)

    def _verify(self, hasher: Hasher, fqn: str, loc: ItemLocation) -> None:
        actual = hasher.hexdigest()
        if actual != loc.checksum:
            raise ChecksumMismatchError(
                f"checksum mismatch for item {fqn!r} in {loc.file!r} of checkpoint "
                f"{self.url} (bytes {loc.offset}..{loc.offset + loc.length}): "
                f"stored {loc.checksum}, read {actual}. The data is corrupt; load from "
                "another copy.",
                checkpoint=self.url,
                file=loc.file,
                fqn=fqn,
            )

    def __repr__(self) -> str:
        return f"CheckpointCopy({self.url!r})"

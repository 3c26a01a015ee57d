"""Copying one rank's data files of a committed checkpoint to another store.

Used by the store level's drain (``levels/store.py``) and ``dcp-multilevel copy``;
reading and verifying items is ``checkpoint/items.py``'s. Two ways, chosen per
source data file:

* **verbatim**: every item of the file is already stored the way the target
  store would store it (same codec descriptor, or uncoded where the target
  leaves it uncoded). The file is copied as is, under a new name, keeping its
  offsets: with a local source through ``target.put_file`` (s3fs: one PUT, or a
  parallel multipart upload, straight from the file; no spool copy), otherwise
  streamed in :data:`BLOCK`-sized blocks. Every item's checksum is verified
  against the source manifest *while* copying (with a local source on this
  thread while another uploads), and the target's size is checked after the
  upload; a file that fails either check is removed from the target, and the
  error names the item. Verifying the source costs one read of the first level's
  file (through the page cache), and it is what keeps a byte flipped on L1 since the save
  from becoming the durable copy; a copy corrupted in transit is caught by
  the size check or, byte-level, by the reader's checksums on load, which
  then fall back to another copy.
* **re-encoded**: items are read whole, verified and decoded (one primitive,
  as a load does), then encoded
  for the target's codec with the codec's thread pool. The items of one source
  file are split into output files of about :data:`PART_BYTES` raw bytes that
  form a two-stage pipeline: one output is encoded (by one thread at a time,
  holding the encode lock, with the codec's pool) while the previous one is
  uploaded (``RemoteStore.open_write`` uploads when its block exits, after the
  lock is released).

With a :class:`DeltaTarget` (a target level that stores deltas, and its
reference checkpoint there), tensor items are coded as deltas against that
reference on the way (``checkpoint/reference.py`` streams its bytes, from a
local copy of the same save when there is one), and a delta item of the
source is copied verbatim when its reference is the target's too (the same
save, the same item bytes). A source delta item is otherwise decoded
against its own reference and stored whole or as the target's delta.

Nothing here commits: the caller writes the target manifest after every rank
copied its share; a failed copy leaves objects that no manifest names.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ..codecs import MIN_CODED_BYTES, Codec, Compression, codec_for, encode_item
from ..errors import TIMEOUT_ENV, TruncatedDataError, WaitTimeoutError, timeout_s
from ..format import Hasher, ItemLocation, Manifest, data_file_path, is_rank_file
from ..stores import ReadHandle, Store
from . import StoredCheckpoint, blocks_of
from .reference import ItemStream, chunk_of, delta_base

__all__ = [
    "BLOCK",
    "PART_BYTES",
    "PART_FIRST",
    "CopyStats",
    "DeltaTarget",
    "Item",
    "Output",
    "buffer",
    "copy_file_verbatim",
    "copy_rank_files",
    "copy_verbatim",
]


logger = logging.getLogger(__name__)

#: Raw bytes of a source file's first output file when re-encoding; each next
#: output holds twice the previous one's, up to :data:`PART_BYTES`. Nothing
#: is uploaded before the first output is encoded: a small first output starts
#: the upload sooner, so a drain of a small (delta-coded) step ends sooner than
#: with outputs of :data:`PART_BYTES` from the start
#: (``benchmarks/bench_delta_io.py`` measures drains).
PART_FIRST = 8 << 20

#: Raw bytes per output file at most (an item bigger than that is one output):
#: outputs this large keep the requests per checkpoint few (an object store
#: limits requests per second per prefix), and one of them is uploaded while
#: the next is encoded.
PART_BYTES = 64 << 20


@dataclass(frozen=True)
class DeltaTarget:
    """The checkpoint on the target level that copied items are coded against.

    ``manifest``: its manifest on the target (what delta items record);
    ``bytes_from``: where its bytes are read, the target's copy or a local
    copy of the same save (``bytes_from.manifest().save_id == manifest.save_id``).
    """

    manifest: Manifest
    bytes_from: StoredCheckpoint

    def item(
        self, source: Manifest, index: MetadataIndex, loc: ItemLocation
    ) -> ItemLocation | None:
        """The reference's item that ``index`` (stored at ``loc`` in the checkpoint of
        manifest ``source``) can be a delta of: the writer's rule (``delta_base``)."""
        chunk = chunk_of(source, index)
        if chunk is None or loc.raw_length < MIN_CODED_BYTES:
            return None
        return delta_base(self.manifest, index, *chunk)

    def keeps(self, index: MetadataIndex, loc: ItemLocation, source_save: str | None) -> bool:
        """Whether the source's delta item ``loc`` is already the delta the target stores:
        coded against this same save's same item."""
        ref = self.manifest.locations.get(index)
        return (
            source_save == self.manifest.save_id
            and ref is not None
            and ref.checksum == loc.reference
        )


@dataclass
class CopyStats:
    """What one rank's copy did (for DrainResult.details)."""

    files_verbatim: int = 0
    files_encoded: int = 0
    bytes_read: int = 0
    bytes_stored: int = 0
    locations: dict[MetadataIndex, ItemLocation] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)


def copy_rank_files(
    manifest: Manifest,
    source: StoredCheckpoint,
    target: Store,
    rank: int,
    token: str,
    compression: Compression | None,
    delta: DeltaTarget | None = None,
) -> CopyStats:
    """Copy the data files ``rank`` wrote from ``source`` to ``target``.

    ``source`` must have ``manifest`` as its manifest. Returns the items' new
    locations and the new files' sizes (names are ``data/<rank>-<n>.<token>.bin``).
    ``delta``: code tensor items as deltas against this reference on the target.

    Raises:
        CorruptCheckpointError: an item does not match its checksum on ``source``.
        OSError: a store could not be read or written.
    """
    codec = codec_for(compression) if compression is not None else None
    wanted = (codec.descriptor,) if codec is not None else ()
    dtypes = {
        fqn: None if isinstance(md, BytesStorageMetadata) else md.properties.dtype
        for fqn, md in manifest.metadata.state_dict_metadata.items()
    }
    by_file: dict[str, list[Item]] = {}
    for index, loc in manifest.locations.items():
        if is_rank_file(loc.file, rank):
            by_file.setdefault(loc.file, []).append((index, loc))

    # (raw bytes, task): see the ordering below.
    tasks: list[tuple[int, Callable[[], Output]]] = []
    stats = CopyStats()
    n = 0
    encode_lock = threading.Lock()
    codec_pool: ThreadPoolExecutor | None = None
    if codec is not None and compression is not None and compression.threads > 1:
        codec_pool = ThreadPoolExecutor(compression.threads, thread_name_prefix="dcp-ml-recode")
    recoder = _Recoder(source, target, dtypes, codec, compression, codec_pool, encode_lock, delta)
    source_ref = manifest.reference.save_id if manifest.reference is not None else None

    def kept(index: MetadataIndex, loc: ItemLocation) -> bool:
        dtype = dtypes[index.fqn]
        if delta is None:
            return _kept(loc, dtype, wanted)
        if loc.reference is not None:  # already a delta: is it the target's?
            return loc.transforms == wanted and delta.keeps(index, loc, source_ref)
        if dtype is not None and delta.item(manifest, index, loc) is not None:
            return False  # could be stored as a delta: code it
        return _kept(loc, dtype, wanted)

    for file, items in sorted(by_file.items()):
        items.sort(key=lambda e: e[1].offset)
        size = manifest.files[file]
        stats.bytes_read += size
        if all(kept(i, loc) for i, loc in items):
            out = data_file_path(rank, n, token)
            n += 1
            stats.files_verbatim += 1
            tasks.append((size, _bind(copy_verbatim, source, file, size, items, target, out)))
            continue
        for part in _parts(items):
            out = data_file_path(rank, n, token)
            n += 1
            stats.files_encoded += 1
            raw = sum(loc.raw_length for _, loc in part)
            tasks.append((raw, _bind(recoder.run, file, part, out)))
    try:
        # Two outputs in flight: one is uploaded while the next is read and encoded.
        with ThreadPoolExecutor(2, thread_name_prefix="dcp-ml-copy") as io_pool:
            # Smallest first: encoding is faster than uploading, so in this two-stage
            # pipeline the time to durable is about the first encode plus every
            # upload (Johnson's rule); a small first output starts the uploads soonest.
            tasks.sort(key=lambda t: t[0])
            futures = [io_pool.submit(task) for _, task in tasks]
            try:
                for f in futures:
                    out, locations, out_size = f.result()
                    stats.locations.update(locations)
                    stats.files[out] = out_size
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        if codec_pool is not None:
            codec_pool.shutdown(wait=True)
    stats.bytes_stored = sum(stats.files.values())
    return stats


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _kept(loc: ItemLocation, dtype: torch.dtype | None, wanted: tuple[str, ...]) -> bool:
    """True when the target store keeps this item exactly as the source does.

    Same codec descriptor (levels may differ: any level decodes alike), or
    stored uncoded where the target's encode_item leaves it uncoded too. A
    delta item is never kept: its reference is not on the target; it is
    decoded against it and stored whole.
    """
    if loc.reference is not None:
        return False
    if loc.transforms == wanted:
        return True
    return not loc.transforms and (dtype is None or loc.raw_length < MIN_CODED_BYTES)


def _parts(items: list[Item]) -> Iterable[list[Item]]:
    """``items`` (in file order) cut into outputs of at least PART_FIRST, 2 * PART_FIRST,
    ... raw bytes, up to PART_BYTES each (whole items: one item may exceed it)."""
    part: list[Item] = []
    raw = 0
    size = min(PART_FIRST, PART_BYTES)
    for item in items:
        part.append(item)
        raw += item[1].raw_length
        if raw >= size:
            yield part
            part, raw = [], 0
            size = min(2 * size, PART_BYTES)
    if part:
        yield part


# --------------------------------------------------------------------------- verbatim


@dataclass
class _Recoder:
    """Re-encodes items of ``source`` for the target's codec into new files."""

    source: StoredCheckpoint
    target: Store
    dtypes: dict[str, torch.dtype | None]
    codec: Codec | None
    compression: Compression | None
    pool: Executor | None
    encode_lock: threading.Lock
    delta: DeltaTarget | None = None

    def run(self, file: str, items: list[Item], out: str) -> Output:
        locations: dict[MetadataIndex, ItemLocation] = {}
        c = self.compression
        window = 2 * c.threads if c is not None else 1
        limit = max(loc.offset + loc.length for _, loc in items)
        with (  # noqa: SIM117 - the lock must be released before the upload
            self.source.open_data(file, items[0][0].fqn, limit) as src,
            self.target.open_write(out) as dst,
        ):
            # One output encodes at a time (the codec pool is shared); the upload,
            # when this block exits, runs outside the lock, beside the next encode.
            with self.encode_lock:
                for index, loc in items:
                    start = dst.tell()
                    hasher = Hasher()
                    with contextlib.ExitStack() as streams:
                        transforms, parts, ref = self._item(src, index, loc, window, streams)
                        for part in parts:
                            hasher.update(part)
                            dst.write(part)
                    locations[index] = ItemLocation(
                        out,
                        start,
                        dst.tell() - start,
                        loc.raw_length,
                        hasher.hexdigest(),
                        transforms,
                        ref() if ref is not None else None,
                    )
                size = dst.tell()
        return out, locations, size

    def _item(
        self,
        src: ReadHandle,
        index: MetadataIndex,
        loc: ItemLocation,
        window: int,
        streams: contextlib.ExitStack,
    ) -> tuple[tuple[str, ...], Iterable[Any], Callable[[], str | None] | None]:
        """(transforms, parts, the target reference's checksum once the parts are
        consumed, for a delta) of one item as the target stores it, from verified bytes."""
        fqn = index.fqn
        wanted = (self.codec.descriptor,) if self.codec is not None else ()
        dtype = self.dtypes[fqn]
        deltable = (
            self.delta is not None
            and dtype is not None
            and self.delta.item(self.source.manifest(), index, loc)
        )
        if not deltable and _kept(loc, dtype, wanted):
            stored = buffer(loc.length)
            self.source.read_stored(src, fqn, loc, [stored])
            return loc.transforms, [stored], None
        raw = buffer(loc.raw_length)
        self.source.read_item(src, index, loc, raw, pool=self.pool, window=window)
        stream = self._reference(index, loc, dtype, streams)
        transforms, parts = encode_item(
            raw,
            dtype,
            self.codec,
            self.compression,
            pool=self.pool,
            window=window,
            reference=stream,
        )
        if stream is None:
            return transforms, parts, None
        checksum = self.delta.manifest.locations[index].checksum  # type: ignore[union-attr]
        return transforms, parts, lambda: checksum if stream.used else None

    def _reference(
        self,
        index: MetadataIndex,
        loc: ItemLocation,
        dtype: torch.dtype | None,
        streams: contextlib.ExitStack,
    ) -> ItemStream | None:
        """The target reference's bytes of ``index`` to code it against, or None."""
        if self.delta is None or dtype is None or self.codec is None:
            return None
        if self.delta.item(self.source.manifest(), index, loc) is None:
            return None
        ref = self.delta.bytes_from
        ref_loc = ref.manifest().locations.get(index)
        if ref_loc is None:
            return None
        stream = ItemStream.opened(ref, index, ref_loc, (self.target.url, ref.url))
        streams.callback(stream.close)
        return stream


#: I/O block of streamed copies and of verification reads.
BLOCK = 16 << 20

#: One item of a data file, and one output file of a copy: its name, where each
#: item is in it, its size.
Item = tuple[MetadataIndex, ItemLocation]
Output = tuple[str, dict[MetadataIndex, ItemLocation], int]


def buffer(size: int) -> memoryview:
    """A buffer of ``size`` bytes that a read fills whole (uninitialized: a
    bytearray zero-fills it first, CPU time spent on bytes the read replaces)."""
    return memoryview(np.empty(size, dtype=np.uint8))


def copy_file_verbatim(
    source: StoredCheckpoint, file: str, target: Store, out: str | None = None
) -> int:
    """Copy the committed data file ``file`` of ``source`` to ``out`` (default: the
    same path) in ``target`` as it is, verifying every item while copying.

    The whole-checkpoint copy of the command-line tool uses this: keeping
    names and offsets lets the copy reuse the source's manifest unchanged.
    Returns the file's size. Nothing is left at ``out`` when the copy fails
    (a local source's upload is removed again; a streamed write is discarded).

    Raises:
        CorruptCheckpointError: an item does not match its checksum on ``source``.
        OSError: a store could not be read or written.
    """
    manifest = source.manifest()
    size = manifest.files[file]
    items = sorted(
        ((index, loc) for index, loc in manifest.locations.items() if loc.file == file),
        key=lambda e: e[1].offset,
    )
    copy_verbatim(source, file, size, items, target, out if out is not None else file)
    return size


def copy_verbatim(
    source: StoredCheckpoint, file: str, size: int, items: list[Item], target: Store, out: str
) -> Output:
    local = source.store.local_path(file)
    if local is not None:
        bound = timeout_s()
        up = ThreadPoolExecutor(1, thread_name_prefix="dcp-ml-upload")
        upload: Future[None] = up.submit(target.put_file, local, out)
        try:
            try:
                _scan(source, file, size, items, sink=None)
            except BaseException:
                with contextlib.suppress(Exception):
                    upload.result(bound)
                _discard(target, out)
                raise
            try:
                upload.result(bound)
            except FutureTimeout:
                raise WaitTimeoutError(
                    f"the upload of {file} to {target.url}/{out} has not finished after "
                    f"{bound:g} s ({TIMEOUT_ENV})"
                ) from None
        finally:
            up.shutdown(wait=upload.done())  # a stuck upload is left behind, not joined
    else:
        with target.open_write(out) as dst:
            _scan(source, file, size, items, sink=dst.write)
    return out, {index: replace(loc, file=out) for index, loc in items}, size


def _discard(target: Store, path: str) -> None:
    try:
        target.remove_tree(path)
    except OSError as e:  # no manifest names it: retention sweeps it later
        logger.warning("could not remove %s/%s after a failed copy: %s", target.url, path, e)


def _scan(
    source: StoredCheckpoint,
    file: str,
    size: int,
    items: list[Item],
    sink: Callable[[memoryview], None] | None,
) -> None:
    """Read ``file`` in blocks, verifying every item; pass all bytes to ``sink`` if given."""
    buf = buffer(max(1, min(BLOCK, size)))
    with source.open_data(file, items[0][0].fqn if items else "(no item)") as handle:
        pos = 0
        for index, loc in items:
            if sink is not None and loc.offset > pos:
                _gap(handle, source, file, pos, loc.offset, buf, sink)
            source.read_stored(handle, index.fqn, loc, blocks_of(buf, loc.length), sink)
            pos = loc.offset + loc.length
        if sink is not None and pos < size:
            _gap(handle, source, file, pos, size, buf, sink)


def _gap(
    handle: ReadHandle,
    source: StoredCheckpoint,
    file: str,
    start: int,
    end: int,
    buf: memoryview,
    sink: Callable[[memoryview], None],
) -> None:
    """Copy bytes no item covers (kept so that offsets stay valid; none are verified)."""
    for view in blocks_of(buf, end - start):
        if handle.read_into(start, view) != len(view):
            raise TruncatedDataError(
                f"data file {file!r} of {source.url} ended inside byte range {start}..{end}",
                checkpoint=source.url,
                file=file,
            )
        sink(view)
        start += len(view)


# --------------------------------------------------------------------------- re-encoded

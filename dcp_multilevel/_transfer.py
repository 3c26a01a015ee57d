"""Copying one rank's data files of a committed checkpoint to another tier.

Used by the drain (``flush.py``). Two ways, chosen per source data file:

* **verbatim**: every item of the file is already stored the way the target
  tier would store it (same codec descriptor, or uncoded where the target
  leaves it uncoded). The file is copied as is, under a new name, keeping its
  offsets: with a local source through ``target.put_file`` (s3fs: one PUT, or a
  parallel multipart upload, straight from the file; no spool copy), otherwise
  streamed in :data:`BLOCK`-sized blocks. Every item's checksum is verified
  against the source manifest *while* copying (with a local source on this
  thread while another uploads), and the target's size is checked after the
  upload. Verifying the source costs one read of data that is usually still in
  the page cache, and it is what keeps a byte flipped on L1 since the save
  from becoming the durable copy; a copy corrupted in transit is caught by
  the size check or, byte-level, by the reader's checksums on load, which
  then fall back to another copy.
* **re-encoded**: items are read whole, verified, decoded if needed and encoded
  for the target's codec with the codec's thread pool. The items of one source
  file are split into output files of about :data:`PART_BYTES` raw bytes that
  form a two-stage pipeline: one output is encoded (by one thread at a time,
  holding the encode lock, with the codec's pool) while the previous one is
  uploaded (``RemoteStore.open_write`` uploads when its block exits, after the
  lock is released).

Nothing here commits: the caller writes the target manifest after every rank
copied its share; a failed copy leaves objects that no manifest names.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from .codecs import (
    MIN_CODED_BYTES,
    Codec,
    codec_for,
    codec_from_descriptor,
    decode_buffer,
    encode_item,
)
from .config import Compression
from .errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedDataError
from .format import Hasher, ItemLocation, Manifest, checksum_of, data_file_path
from .stores import ReadHandle, Store

__all__ = ["BLOCK", "PART_BYTES", "CopyStats", "copy_rank_files"]

logger = logging.getLogger(__name__)

#: I/O block of streamed copies and of verification reads.
BLOCK = 16 << 20

#: Raw bytes per output file when re-encoding: small enough that uploading one
#: overlaps encoding the next, large enough to keep requests efficient.
PART_BYTES = 64 << 20

Item = tuple[MetadataIndex, ItemLocation]


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
    source: Store,
    target: Store,
    rank: int,
    token: str,
    compression: Compression | None,
) -> CopyStats:
    """Copy the data files ``rank`` wrote from ``source`` to ``target``.

    Returns the items' new locations and the new files' sizes (names are
    ``data/<rank>-<n>.<token>.bin``).

    Raises:
        CorruptCheckpointError: an item does not match its checksum on ``source``.
        OSError: a tier could not be read or written.
    """
    codec = codec_for(compression) if compression is not None else None
    wanted = (codec.descriptor,) if codec is not None else ()
    dtypes = {
        fqn: None if isinstance(md, BytesStorageMetadata) else md.properties.dtype
        for fqn, md in manifest.metadata.state_dict_metadata.items()
    }
    by_file: dict[str, list[Item]] = {}
    for index, loc in manifest.locations.items():
        if loc.file.split("/")[1].startswith(f"{rank}-"):
            by_file.setdefault(loc.file, []).append((index, loc))

    # (raw bytes, task): see the ordering below.
    tasks: list[tuple[int, Callable[[], tuple[str, dict[MetadataIndex, ItemLocation], int]]]] = []
    stats = CopyStats()
    n = 0
    encode_lock = threading.Lock()
    codec_pool: ThreadPoolExecutor | None = None
    if codec is not None and compression is not None and compression.threads > 1:
        codec_pool = ThreadPoolExecutor(compression.threads, thread_name_prefix="dcp-ml-recode")
    for file, items in sorted(by_file.items()):
        items.sort(key=lambda e: e[1].offset)
        size = manifest.files[file]
        stats.bytes_read += size
        if all(_kept(loc, dtypes[i.fqn], wanted) for i, loc in items):
            out = data_file_path(rank, n, token)
            n += 1
            stats.files_verbatim += 1
            tasks.append((size, _bind(_copy_verbatim, source, file, size, items, target, out)))
            continue
        for part in _parts(items):
            out = data_file_path(rank, n, token)
            n += 1
            stats.files_encoded += 1
            raw = sum(loc.raw_length for _, loc in part)
            tasks.append((raw, _bind(_recode, source, file, part, target, out, dtypes, codec,
                                     compression, codec_pool, encode_lock)))  # fmt: skip
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
    """True when the target tier stores this item exactly as the source does.

    Same codec descriptor (levels may differ: any level decodes alike), or
    stored uncoded where the target's encode_item leaves it uncoded too.
    """
    if loc.transforms == wanted:
        return True
    return not loc.transforms and (dtype is None or loc.raw_length < MIN_CODED_BYTES)


def _parts(items: list[Item]) -> Iterable[list[Item]]:
    part: list[Item] = []
    raw = 0
    for item in items:
        part.append(item)
        raw += item[1].raw_length
        if raw >= PART_BYTES:
            yield part
            part, raw = [], 0
    if part:
        yield part


# --------------------------------------------------------------------------- verbatim


def _copy_verbatim(
    source: Store, file: str, size: int, items: list[Item], target: Store, out: str
) -> tuple[str, dict[MetadataIndex, ItemLocation], int]:
    local = source.local_path(file)
    if local is not None:
        with ThreadPoolExecutor(1, thread_name_prefix="dcp-ml-upload") as up:
            upload: Future[None] = up.submit(target.put_file, local, out)
            try:
                _scan(source, file, size, items, sink=None)
            except BaseException:
                with contextlib.suppress(Exception):
                    upload.result()
                _discard(target, out)
                raise
            upload.result()
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
    source: Store,
    file: str,
    size: int,
    items: list[Item],
    sink: Callable[[memoryview], None] | None,
) -> None:
    """Read ``file`` in blocks, verifying every item; pass all bytes to ``sink`` if given."""
    with source.open_read(file) as handle:
        if handle.size != size:
            raise TruncatedDataError(
                f"data file {file!r} of {source.url} is {handle.size} bytes, the manifest "
                f"says {size}; not copying a damaged checkpoint",
                checkpoint=source.url,
                file=file,
            )
        buf = memoryview(bytearray(max(1, min(BLOCK, size))))
        pos = 0
        for index, loc in items:
            if sink is not None and loc.offset > pos:
                _span(handle, source, file, pos, loc.offset, buf, sink)
            hasher = Hasher()

            def both(block: memoryview, h: Hasher = hasher) -> None:
                h.update(block)
                if sink is not None:
                    sink(block)

            _span(handle, source, file, loc.offset, loc.offset + loc.length, buf, both)
            if hasher.hexdigest() != loc.checksum:
                raise _mismatch(source, file, index.fqn)
            pos = loc.offset + loc.length
        if sink is not None and pos < size:
            _span(handle, source, file, pos, size, buf, sink)


def _span(
    handle: ReadHandle,
    source: Store,
    file: str,
    start: int,
    end: int,
    buf: memoryview,
    on_block: Callable[[memoryview], None],
) -> None:
    pos = start
    while pos < end:
        view = buf[: min(len(buf), end - pos)]
        if handle.read_into(pos, view) != len(view):
            raise TruncatedDataError(
                f"data file {file!r} of {source.url} ended inside byte range {start}..{end}",
                checkpoint=source.url,
                file=file,
            )
        on_block(view)
        pos += len(view)


def _mismatch(source: Store, file: str, fqn: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"item {fqn!r} in {file!r} of {source.url} does not match its checksum; "
        "not copying corrupt data",
        checkpoint=source.url,
        file=file,
        fqn=fqn,
    )


# --------------------------------------------------------------------------- re-encoded


def _recode(
    source: Store,
    file: str,
    items: list[Item],
    target: Store,
    out: str,
    dtypes: dict[str, torch.dtype | None],
    codec: Codec | None,
    compression: Compression | None,
    pool: Executor | None,
    encode_lock: threading.Lock,
) -> tuple[str, dict[MetadataIndex, ItemLocation], int]:
    locations: dict[MetadataIndex, ItemLocation] = {}
    window = 2 * compression.threads if compression is not None else 1
    with source.open_read(file) as src, target.open_write(out) as dst:  # noqa: SIM117
        # One output encodes at a time (the codec pool is shared); the upload,
        # when the outer block exits, runs outside the lock, beside the next encode.
        with encode_lock:
            for index, loc in items:
                start = dst.tell()
                hasher = Hasher()
                parts, transforms = _transcode(
                    src, source, file, index.fqn, loc, dtypes[index.fqn], codec, compression,
                    pool, window,
                )  # fmt: skip
                for part in parts:
                    hasher.update(part)
                    dst.write(part)
                locations[index] = ItemLocation(
                    out, start, dst.tell() - start, loc.raw_length, hasher.hexdigest(), transforms
                )
            size = dst.tell()
    return out, locations, size


def _transcode(
    src: ReadHandle,
    source: Store,
    file: str,
    fqn: str,
    loc: ItemLocation,
    dtype: torch.dtype | None,
    codec: Codec | None,
    compression: Compression | None,
    pool: Executor | None,
    window: int,
) -> tuple[Iterable[Any], tuple[str, ...]]:
    """Verified stored bytes of one item, re-encoded for the target tier's codec."""
    stored = memoryview(bytearray(loc.length))
    if src.read_into(loc.offset, stored) != loc.length or checksum_of(stored) != loc.checksum:
        raise _mismatch(source, file, fqn)
    wanted = (codec.descriptor,) if codec is not None else ()
    if _kept(loc, dtype, wanted):
        return [stored], loc.transforms
    raw = stored
    if loc.transforms:
        raw = memoryview(bytearray(loc.raw_length))

        def error(index: int, why: str) -> Exception:
            return CorruptCheckpointError(
                f"item {fqn!r} in {file!r} of {source.url}: chunk {index}: {why}",
                checkpoint=source.url, file=file, fqn=fqn,
            )  # fmt: skip

        decode_buffer(stored, raw, codec_from_descriptor(loc.transforms[0]), error, pool, window)
    transforms, parts = encode_item(raw, dtype, codec, compression, pool=pool, window=window)
    return parts, transforms

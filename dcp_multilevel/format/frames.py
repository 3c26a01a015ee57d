"""The framing of a compressed item: a header, independent chunks, a terminator.

::

    header     "DMLF" | version u8 | width u8 | rotate u8 | 0 u8 | chunk_size u32 | raw_total u64
    chunk*     method u8 | 0 u8 x3 | raw_len u32 | stored_len u32 | xxh3_64(payload) u64 | payload
    terminator a chunk record with raw_len = stored_len = 0

All integers little-endian. ``rotate``: bits each value was rotated left
before coding. Version 1 headers hold it as a flag (bit 0: one bit); version 2
headers hold the count (written only when it is more than 1).
``method`` 0 = payload is the raw bytes, 1 = payload
is coded by the item's codec (named in the manifest), 2 = payload is the
codec's coding of the chunk's raw bytes XOR the reference checkpoint's raw
bytes at the same place (a delta chunk: only in items whose manifest entry
names a reference, ``manifest.py``). Every chunk but the last
holds exactly ``chunk_size`` raw bytes, so chunk ``i`` decodes into
``out[i*chunk_size:]`` and chunks decode in parallel. ``raw_total`` is
``UNKNOWN_TOTAL`` when the writer streams without knowing the size (DCP's
stream-extension path); the manifest's ``raw_length`` bounds it then.

Decoding never trusts a size from the file beyond what the caller's bound
allows: see :func:`check_chunk`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

__all__ = [
    "CHUNK",
    "HEADER",
    "MAX_CHUNK_SIZE",
    "METHOD_CODED",
    "METHOD_DELTA",
    "METHOD_RAW",
    "UNKNOWN_TOTAL",
    "VERSION",
    "VERSION_2",
    "ChunkRecord",
    "FrameError",
    "FrameHeader",
    "check_chunk",
    "pack_chunk",
    "pack_header",
    "read_chunk",
    "read_header",
    "unpack_chunk",
    "unpack_header",
]

MAGIC = b"DMLF"
VERSION = 1
VERSION_2 = 2
HEADER = struct.Struct("<4sBBBxIQ")
CHUNK = struct.Struct("<BxxxIIQ")
METHOD_RAW = 0
METHOD_CODED = 1
METHOD_DELTA = 2
UNKNOWN_TOTAL = 2**64 - 1
MAX_CHUNK_SIZE = 64 << 20
FLAG_ROTATE = 1


class FrameError(ValueError):
    """Malformed framing; callers turn it into an error naming checkpoint and item."""


@dataclass(frozen=True)
class FrameHeader:
    """A decoded frame header.

    Attributes:
        width: bytes per value plane (1, 2, 4 or 8).
        rotate: bits each value was rotated left before coding.
        chunk_size: raw bytes of every chunk but the last.
        raw_total: raw bytes of the whole item, or :data:`UNKNOWN_TOTAL`.
    """

    width: int
    rotate: int  # bits
    chunk_size: int
    raw_total: int


@dataclass(frozen=True)
class ChunkRecord:
    """A decoded chunk record, which precedes each chunk's payload (checked by :func:`check_chunk`).

    Attributes:
        method: :data:`METHOD_RAW`, :data:`METHOD_CODED` or :data:`METHOD_DELTA`.
        raw_len: bytes of the chunk once decoded.
        stored_len: bytes of the payload that follows the record.
        checksum: xxh3-64 of the payload (as stored).
    """

    method: int
    raw_len: int
    stored_len: int
    checksum: int

    @property
    def is_terminator(self) -> bool:
        """Whether this record ends the item (no raw and no stored bytes)."""
        return self.raw_len == 0 and self.stored_len == 0


def pack_header(width: int, rotate: int, chunk_size: int, raw_total: int) -> bytes:
    """The header bytes; version 1 when ``rotate`` is 0 or 1, else version 2.

    Raises:
        ValueError: ``rotate`` is not below the ``width``'s bit count.
    """
    if not 0 <= rotate < 8 * width:
        raise ValueError(f"cannot rotate {width}-byte values by {rotate} bits")
    if rotate <= 1:
        return HEADER.pack(MAGIC, VERSION, width, rotate and FLAG_ROTATE, chunk_size, raw_total)
    return HEADER.pack(MAGIC, VERSION_2, width, rotate, chunk_size, raw_total)


def unpack_header(data: bytes | memoryview) -> FrameHeader:
    """Parse and check a header of exactly ``HEADER.size`` bytes.

    Raises:
        FrameError: wrong magic, an unknown version, or a width, rotation or
            chunk size out of range.
    """
    magic, version, width, flags, chunk_size, raw_total = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version not in (VERSION, VERSION_2):
        raise FrameError(f"frame version {version} is not supported (this release reads 1, 2)")
    if width not in (1, 2, 4, 8):
        raise FrameError(f"bad frame width {width}")
    if version == VERSION:
        if flags & ~FLAG_ROTATE:
            raise FrameError(f"bad frame flags {flags:#x}")
        rotate = flags & FLAG_ROTATE
    else:
        rotate = flags
        if not 1 < rotate < 8 * width:
            raise FrameError(f"bad rotation {rotate} for width {width}")
    if not 0 < chunk_size <= MAX_CHUNK_SIZE or chunk_size % width:
        raise FrameError(f"bad chunk size {chunk_size}")
    return FrameHeader(width, rotate, chunk_size, raw_total)


def pack_chunk(method: int, raw_len: int, stored_len: int, checksum: int) -> bytes:
    """The record before a chunk's payload; ``pack_chunk(METHOD_RAW, 0, 0, 0)`` ends an item."""
    return CHUNK.pack(method, raw_len, stored_len, checksum)


def unpack_chunk(data: bytes | memoryview) -> ChunkRecord:
    """Parse a record of exactly ``CHUNK.size`` bytes; validate it with :func:`check_chunk`."""
    return ChunkRecord(*CHUNK.unpack(data))


def check_chunk(rec: ChunkRecord, header: FrameHeader, raw_left: int) -> None:
    """Validate one chunk record against the header and the bytes still expected.

    ``raw_left`` is how many decoded bytes may still come (from the manifest).
    """
    if rec.method not in (METHOD_RAW, METHOD_CODED, METHOD_DELTA):
        raise FrameError(f"unknown method {rec.method}")
    expected = min(header.chunk_size, raw_left)
    if rec.raw_len != expected:
        raise FrameError(
            f"claims {rec.raw_len} raw bytes, expected {expected} "
            f"({raw_left} bytes left, chunk size {header.chunk_size})"
        )
    if rec.raw_len % header.width:
        raise FrameError(f"{rec.raw_len} bytes is not a multiple of {header.width}")
    if rec.method == METHOD_RAW and rec.stored_len != rec.raw_len:
        raise FrameError(f"raw chunk stores {rec.stored_len} != {rec.raw_len}")


def read_header(read: Callable[[int], memoryview], raw_total: int) -> FrameHeader:
    """An item's header, read with ``read(n)`` (the next ``n`` stored bytes) and
    checked against ``raw_total``, the item's raw size from the manifest."""
    header = unpack_header(read(HEADER.size))
    if header.raw_total not in (raw_total, UNKNOWN_TOTAL):
        raise FrameError(f"frame holds {header.raw_total} bytes, expected {raw_total}")
    return header


def read_chunk(
    read: Callable[[int], memoryview], header: FrameHeader, raw_left: int
) -> tuple[ChunkRecord, memoryview | None]:
    """The next chunk's record and payload, read with ``read(n)``; the payload is
    None for the terminator. The record is checked (:func:`check_chunk`, with
    ``raw_left`` raw bytes still expected) before its payload is read, and the
    payload against its checksum. The one reader of the chunk loop: decoding
    (``codecs/pipeline.py``) and a delta's reference stream
    (``checkpoint/reference.py``) both walk frames with it."""
    rec = unpack_chunk(read(CHUNK.size))
    if rec.is_terminator:
        return rec, None
    check_chunk(rec, header, raw_left)
    payload = read(rec.stored_len)
    if xxhash.xxh3_64_intdigest(payload) != rec.checksum:
        raise FrameError("its checksum does not match its bytes")
    return rec, payload

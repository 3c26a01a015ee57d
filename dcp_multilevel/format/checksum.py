"""Checksums of stored bytes: xxh3-64, written as ``"xxh3_64:<16 hex digits>"``.

xxh3 is among the fastest non-cryptographic hashes (vectorized, one pass)
and releases the GIL, so hashing every item on write and verifying it on
read costs little next to the I/O.
"""

from __future__ import annotations

import re

import xxhash

__all__ = ["ALGORITHM", "Hasher", "checksum_of", "is_valid_checksum"]

ALGORITHM = "xxh3_64"
_PATTERN = re.compile(r"^xxh3_64:[0-9a-f]{16}$")


class Hasher:
    """Incremental checksum over several buffers (``update`` then ``hexdigest``)."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data`` to what is hashed (buffers hash as if concatenated)."""
        self._h.update(data)

    def hexdigest(self) -> str:
        """The checksum of everything added so far, in manifest form (``xxh3_64:<hex>``)."""
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def checksum_of(data: bytes | bytearray | memoryview) -> str:
    """Checksum of one buffer, in manifest form."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def is_valid_checksum(value: object) -> bool:
    """True when ``value`` is a checksum string this release knows how to verify."""
    return isinstance(value, str) and bool(_PATTERN.match(value))

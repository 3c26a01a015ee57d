"""Damage for tests: one byte of a file flipped in place."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, at: int, mask: int = 0x01) -> None:
    """XOR byte ``at`` of the file at ``path`` with ``mask``."""
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(data)

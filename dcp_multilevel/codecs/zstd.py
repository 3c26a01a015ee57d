"""Plain zstd on each chunk (``dcp_multilevel.zstd/1``)."""

from __future__ import annotations

from . import _zstd
from .base import MIN_SAVING, Codec

__all__ = ["ZstdCodec"]


class ZstdCodec(Codec):
    """zstd at ``level`` on every chunk; chunks that do not shrink are stored raw."""

    name = "dcp_multilevel.zstd"

    def encode(self, chunk: memoryview, width: int, rotate: int) -> bytes | None:
        """One zstd frame of ``chunk`` (``width``/``rotate`` unused); None under MIN_SAVING."""
        coded = _zstd.compress(chunk, self.level)
        return coded if len(coded) < len(chunk) * (1 - MIN_SAVING) else None

    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: int) -> None:
        """Decompress the frame into exactly ``len(out)`` bytes; ValueError if it does not fit."""
        _zstd.decompress_into(payload, out)

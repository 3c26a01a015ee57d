"""zstd with per-thread contexts and bounded decompression.

zstandard's (de)compressor objects are not thread-safe, but creating one per
call costs more than compressing a small plane; each thread keeps its own.
Both directions release the GIL.
"""

from __future__ import annotations

import threading

import zstandard

__all__ = ["compress", "decompress"]

_local = threading.local()


def compress(data: bytes | memoryview, level: int) -> bytes:
    cctxs = getattr(_local, "cctxs", None)
    if cctxs is None:
        cctxs = _local.cctxs = {}
    cctx = cctxs.get(level)
    if cctx is None:
        cctx = cctxs[level] = zstandard.ZstdCompressor(
            level=level, write_checksum=False, write_content_size=True
        )
    return cctx.compress(data)


def decompress(data: bytes | memoryview, size: int) -> bytes:
    """Decompress one frame that must hold exactly ``size`` bytes.

    The frame's own content size is checked before anything is allocated, so a
    "decompression bomb" costs nothing.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is corrupt: {e}") from None
    if declared not in (size, zstandard.CONTENTSIZE_UNKNOWN):
        raise ValueError(f"zstd frame declares {declared} bytes, expected {size}")
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        out = dctx.decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is corrupt: {e}") from None
    if len(out) != size:
        raise ValueError(f"zstd frame holds {len(out)} bytes, expected {size}")
    return out

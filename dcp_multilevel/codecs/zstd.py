"""zstd in this package: per-thread contexts, bounded decompression, and the plain
zstd codec (``dcp_multilevel.zstd/1``), zstd on each chunk.

zstandard's (de)compressor objects are not thread-safe, but creating one per
call costs more than compressing a small plane; each thread keeps its own.
Both directions release the GIL. The bytegroup codec codes its planes with
the functions here (:func:`compress_plane_into`, :func:`decompress_into`).
"""

from __future__ import annotations

import threading

import zstandard

from .base import MIN_SAVING, Codec

__all__ = ["ZstdCodec", "compress", "compress_plane_into", "decompress_into", "plane_bound"]


class ZstdCodec(Codec):
    """zstd at ``level`` on every chunk; chunks that do not shrink are stored raw."""

    name = "dcp_multilevel.zstd"

    def encode(self, chunk: memoryview, width: int, rotate: int) -> bytes | None:
        """One zstd frame of ``chunk`` (``width``/``rotate`` unused); None under MIN_SAVING."""
        coded = compress(chunk, self.level)
        return coded if len(coded) < len(chunk) * (1 - MIN_SAVING) else None

    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: int) -> None:
        """Decompress the frame into exactly ``len(out)`` bytes; ValueError if it does not fit."""
        decompress_into(payload, out)


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


# Byte planes of floats have almost no repeated strings to find, only a skewed
# byte distribution: a minimal match search (tiny hash/chain tables, long
# minimum match) leaves zstd as little more than its entropy coder, which is
# several times faster than level 1 and compresses exponent planes better
# (benchmarks/bench_chunk_coding.py measures the coder).
_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_checksum=False,
    write_content_size=True,
)


def plane_bound(size: int) -> int:
    """Room that always holds the frame of a ``size``-byte plane (zstd's compress bound + slack)."""
    return size + (size >> 8) + 1024


def compress_plane_into(data: bytes | memoryview, out: memoryview) -> int | None:
    """Compress one byte plane into ``out``; its length, or None if it does not fit.

    Streams through the thread's plane context straight into the caller's
    buffer: ``compress`` returns a new bytes object per call, and allocating
    (and page-faulting) a fresh ~plane-sized buffer per plane takes a large
    share of the coding time. Entropy-coding settings: ``_PLANE_PARAMS``.
    """
    cctx = getattr(_local, "plane_cctx", None)
    if cctx is None:
        cctx = _local.plane_cctx = zstandard.ZstdCompressor(compression_params=_PLANE_PARAMS)
    reader = cctx.stream_reader(data, size=len(data))
    n = reader.readinto(out)
    # A full ``out`` may hold a cut frame (readinto stops when out is full).
    return n if n < len(out) else None


def _checked_decompressor(data: bytes | memoryview, size: int) -> zstandard.ZstdDecompressor:
    """This thread's decompressor, once the frame's declared size is checked to be ``size``."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is corrupt: {e}") from None
    if declared not in (size, zstandard.CONTENTSIZE_UNKNOWN):
        raise ValueError(f"zstd frame declares {declared} bytes, expected {size}")
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def decompress_into(data: bytes | memoryview, out: memoryview) -> None:
    """Decompress one frame that must hold exactly ``len(out)`` bytes, into ``out``.

    The frame's own content size is checked before anything is written, so a
    "decompression bomb" costs nothing; the output goes straight into the
    caller's buffer.
    """
    size = len(out)
    dctx = _checked_decompressor(data, size)
    got = extra = 0
    try:
        reader = dctx.stream_reader(data, read_across_frames=False)
        while got < size:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        if got == size:  # the frame must end here
            extra = reader.readinto(bytearray(1))
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is corrupt: {e}") from None
    if extra:
        raise ValueError(f"zstd frame holds more than {size} bytes, expected {size}")
    if got != size:
        raise ValueError(f"zstd frame ends after {got} of the {size} bytes expected")

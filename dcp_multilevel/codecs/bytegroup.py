"""Float-aware byte grouping (``dcp_multilevel.bytegroup/1``).

A chunk of ``width``-byte values is split into ``width`` planes: plane ``p``
holds byte ``p`` of every value. For floats each value is first rotated left by
one bit, so the top plane holds exactly the exponent (low entropy: weights
cluster in a few binades) and the sign joins the near-random mantissa. Each
plane is compressed with zstd only if that pays, else stored raw; if no plane
pays, the whole chunk is stored raw by the caller (``encode`` returns None).

Payload layout: ``width`` u8, then per plane ``method u8 | length u32``, then
the planes' bytes in order (method 0 raw, 1 zstd).

Planes are coded with zstd tuned as an entropy coder (``_zstd.compress_plane``;
``level`` does not apply). Planes whose first 64 KiB sample does not compress
are stored raw without compressing the rest: mantissa planes are near-random.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from . import _zstd
from .base import MIN_SAVING, Codec

__all__ = ["ByteGroupCodec"]

_PLANE = struct.Struct("<BI")
_SAMPLE = 64 << 10
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of at least ``nbytes`` (no allocation per chunk)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def _rotate(src: np.ndarray, dst: np.ndarray, width: int, left: bool) -> None:
    """Rotate each ``width``-byte value of ``src`` by one bit into ``dst`` (uint8 arrays)."""
    t = _UINT[width]
    bits = 8 * width - 1
    x, y = src.view(t), dst.view(t)
    tmp = _scratch("rot_tmp", src.nbytes).view(t)
    if left:
        np.left_shift(x, 1, out=y)
        np.right_shift(x, bits, out=tmp)
    else:
        np.right_shift(x, 1, out=y)
        np.left_shift(x, bits, out=tmp)
    np.bitwise_or(y, tmp, out=y)


def _interleave(planes: np.ndarray, dest: np.ndarray, width: int) -> None:
    """Rebuild values from byte planes (little-endian: plane p is byte p).

    Shifting and OR-ing whole words runs ~4x faster than a transposing copy,
    whose stride-``width`` byte writes defeat the cache.
    """
    words = dest.view(_UINT[width])
    np.copyto(words, planes[width - 1], casting="unsafe")
    for p in range(width - 2, -1, -1):
        words <<= 8
        words |= planes[p]


class ByteGroupCodec(Codec):
    """Byte planes (exponent-aligned for floats), each zstd-compressed when it pays."""

    name = "dcp_multilevel.bytegroup"

    def encode(self, chunk: memoryview, width: int, rotate: bool) -> bytes | None:
        if width == 1:
            coded = _zstd.compress_plane(chunk)
            return self._pack([(1, coded)]) if self._pays(coded, len(chunk)) else None
        n = len(chunk) // width
        values = np.frombuffer(chunk, dtype=np.uint8)
        if rotate:
            rotated = _scratch("enc_rot", len(chunk))
            _rotate(values, rotated, width, left=True)
            values = rotated
        planes = _scratch("enc_planes", len(chunk)).reshape(width, n)
        np.copyto(planes, values.reshape(n, width).T)
        parts: list[tuple[int, bytes | memoryview]] = []
        for p in range(width):
            plane = memoryview(planes[p])
            if n > 2 * _SAMPLE and not self._pays(_zstd.compress_plane(plane[:_SAMPLE]), _SAMPLE):
                parts.append((0, plane))
                continue
            coded = _zstd.compress_plane(plane)
            parts.append((1, coded) if self._pays(coded, n) else (0, plane))
        if all(method == 0 for method, _ in parts):
            return None
        return self._pack(parts)

    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: bool) -> None:
        nplanes = payload[0]
        if nplanes != width:
            raise ValueError(f"payload has {nplanes} planes, the frame says width {width}")
        n = len(out) // width
        table_end = 1 + width * _PLANE.size
        if len(payload) < table_end:
            raise ValueError("payload ends inside its plane table")
        pos = table_end
        planes = _scratch("dec_planes", len(out)).reshape(width, n)
        for p in range(width):
            method, length = _PLANE.unpack_from(payload, 1 + p * _PLANE.size)
            data = payload[pos : pos + length]
            if len(data) != length:
                raise ValueError(f"plane {p} runs past the end of the payload")
            pos += length
            if method == 0:
                if length != n:
                    raise ValueError(f"raw plane {p} has {length} bytes, expected {n}")
                planes[p] = np.frombuffer(data, dtype=np.uint8)
            elif method == 1:
                planes[p] = np.frombuffer(_zstd.decompress(data, n), dtype=np.uint8)
            else:
                raise ValueError(f"plane {p} has unknown method {method}")
        if pos != len(payload):
            raise ValueError(f"payload has {len(payload) - pos} trailing bytes")
        dest = np.frombuffer(out, dtype=np.uint8)
        if width == 1:
            dest[:] = planes[0]
            return
        if rotate:
            grouped = _scratch("dec_rot", len(out))
            _interleave(planes, grouped, width)
            _rotate(grouped, dest, width, left=False)
        else:
            _interleave(planes, dest, width)

    @staticmethod
    def _pays(coded: bytes, raw_len: int) -> bool:
        return len(coded) < raw_len * (1 - MIN_SAVING)

    @staticmethod
    def _pack(parts: list[tuple[int, bytes | memoryview]]) -> bytes:
        table = bytes([len(parts)]) + b"".join(_PLANE.pack(m, len(d)) for m, d in parts)
        return b"".join([table, *(data for _, data in parts)])

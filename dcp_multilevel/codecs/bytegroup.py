"""Float-aware byte grouping (``dcp_multilevel.bytegroup/3``; reads ``/1`` and ``/2`` too).

A chunk of ``width``-byte values is split into ``width`` planes: plane ``p``
holds byte ``p`` of every value. Floats are first rotated left by ``rotate``
bits (recorded in the frame header). Each plane is compressed with zstd, or
split (below), only if that pays, else stored raw; if no plane pays, the
whole chunk is stored raw by the caller (``encode`` returns None).

Rotation: version 1 rotated by one bit (the top plane is the exponent, the
sign joins the mantissa). Version 2 rotates fp32 and bf16 by three: the top
plane then holds the low six exponent bits and the top two mantissa bits,
and the two top exponent bits, which barely vary in weights and optimizer
states (values well inside (2**-63, 2)), join the sign at the bottom of the
lowest plane. That plane then compresses instead of being stored raw, and the
top mantissa bits, skewed within each binade, are coded together with the
exponent. Measured (plane-wise zstd, 1 MiB chunks) on MiniLM and 1-layer
BERT-large + AdamW: fp32 0.8198 -> 0.8172 and 0.8201 -> 0.8175, bf16 0.6656
-> 0.6617 and 0.6403 -> 0.6350; 2 and 4 bits were worse than 3, and fp16
(5 exponent bits) does best with 1.

Split planes (version 3): with rotate 3, the lowest plane of fp32 and bf16
holds five near-random mantissa bits above the sign and the two top exponent
bits. zstd on the whole plane spends its time Huffman-coding the random
bits. A split stores the plane's high ``8 - k`` bits packed raw and codes only
its low ``k`` bits with zstd: method 2 (k = 2, for a random sign) or method 3
(k = 3, for a sign that never changes, as in Adam's ``exp_avg_sq``). The
split comes out as small as zstd on the whole plane, or smaller, and coding
it costs a fraction of the time. Measured per 1 MiB chunk on MiniLM and
1-layer BERT-large + AdamW: plane 0 at 0.7500 / 0.7084 of its bytes against
zstd's 0.7504 / 0.7086; whole chunks code 1.3-1.9x faster on one thread
(``benchmarks/bench_chunk_coding.py``, docs/benchmarks.md). Where the
mantissa's low bits carry structure (values that came from a narrower
float, e.g. MiniLM's untrained embedding rows), zstd stays the better choice;
the judge picks per chunk. The packing (``_planes.c``: split_plane) cuts the
plane into 4 (k = 2) or 8 (k = 3) segments and packs slot ``j`` of every
segment together, so both directions are contiguous, vectorized loops.

Payload layout: ``width`` u8, then per plane ``method u8 | length u32``, then
the planes' bytes in order. Method 0 is raw and 1 is one zstd frame. Methods
2 and 3 store the packed high bits (``split_sizes``), then one zstd frame of
the packed low bits.

Planes are coded with zstd tuned as an entropy coder (``_zstd._PLANE_PARAMS``;
``level`` does not apply). Which planes are worth it is judged on a sample of
the chunk (a few spread slices) before the chunk is split: planes whose
sample does not compress are stored raw without compressing the rest
(mantissa planes are near-random), and a chunk none of whose planes pays is
rejected outright, so random data costs almost nothing. For floats the
judge is the sample's byte entropy: zstd finds almost no matches in float
planes, so it codes them close to their entropy (the same ratios as
compressing the sample with zstd on MiniLM and 1-layer BERT+AdamW, fp32 and
bf16, for ~40 instead of ~150 us per 1 MiB chunk). The same byte counts
estimate a split (raw high bits plus the low bits' entropy), and the
cheapest method whose estimate is within ``_SPLIT_SLACK`` of the smallest
is chosen. Integer planes can hold repeats (``arange``, padding) that only a
match finder sees, so their sample is compressed with zstd.

Splitting, joining and the entropy sample run in ``_planes.c`` with the GIL
released (one call each per chunk). Where a libzstd is found at import
(:data:`NATIVE_ZSTD`), a float chunk's whole coding, zstd included, is one
call: every GIL hand-off between coding threads waits on waking the other
thread, and on small chunks those waits cost more than the second thread
gained. Builds without a C compiler fall back to numpy (:data:`NATIVE` is
False): same bytes, but ~30 short numpy calls per chunk that each retake the
GIL, so a second coding thread gains little.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import torch

from . import _zstd
from .base import MIN_SAVING, Codec, element_layout

try:
    from . import _planes as _native
except ImportError:  # built without a C compiler (setup.py: optional)
    _native = None

__all__ = ["NATIVE", "NATIVE_ZSTD", "ByteGroupCodec"]

#: Whether the C plane kernels are in use (see the module docstring).
NATIVE = _native is not None
#: Whether they also run zstd (a libzstd was found): a float chunk is then
#: coded in one call, one GIL release.
NATIVE_ZSTD = NATIVE and bool(_native.HAS_ZSTD)
_native_zstd = NATIVE_ZSTD  # tests switch this off to compare the two paths

_PLANE = struct.Struct("<BI")
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Values sampled per chunk to decide which planes to compress: _SLICES slices
#: spread over the chunk (one slice at the start misjudges tensors whose first
#: rows differ, e.g. the rarely trained rows of an embedding).
_SAMPLE_VALUES = 16 << 10
_SLICES = 8
#: A plane is compressed when its sample saves at least this fraction; looser
#: than MIN_SAVING, as a sample only estimates the whole plane.
_SAMPLE_SAVING = MIN_SAVING / 2
#: The cheapest plane method within 1/_SPLIT_SLACK byte per value of the
#: smallest estimate is chosen (``SPLIT_SLACK`` in ``_planes.c`` says why).
_SPLIT_SLACK = 256.0
#: Rotation (bits) of version 2 per float dtype; others use version 1's.
_ROTATE_V2 = {torch.float32: 3, torch.bfloat16: 3, torch.complex64: 3}
_local = threading.local()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer of at least ``nbytes`` (no allocation per chunk)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def _rotate(words: np.ndarray, out: np.ndarray, bits: int, left: bool) -> None:
    """Rotate each unsigned word of ``words`` by ``bits`` into ``out`` (same dtype)."""
    tmp = _scratch("rot_tmp", words.nbytes).view(words.dtype)
    total = 8 * words.itemsize
    first, second = (np.left_shift, np.right_shift) if left else (np.right_shift, np.left_shift)
    first(words, bits, out=out)
    second(words, total - bits, out=tmp)
    np.bitwise_or(out, tmp, out=out)


def _split(words: np.ndarray, planes: np.ndarray) -> None:
    """Byte ``p`` of every word into ``planes[p]`` (little-endian).

    A shift and a truncating copy per plane run ~1.5-3x faster than a
    transposing copy, whose stride-``width`` byte reads defeat the cache.
    """
    # Only for rotations of 8 bits or more (never written by this codec).
    tmp = _scratch("split_tmp", words.nbytes).view(words.dtype)
    np.copyto(planes[0], words, casting="unsafe")
    for p in range(1, len(planes)):
        np.right_shift(words, 8 * p, out=tmp)
        np.copyto(planes[p], tmp, casting="unsafe")


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


def _join_np(planes: list[np.ndarray], words: np.ndarray, rotate: int) -> None:
    """Inverse of :func:`_planes_np` for rotations under 8 bits, straight into ``words``.

    Rotating right by ``rotate`` moves plane ``p >= 1`` to bit ``8p - rotate``
    and splits plane 0 into its top bits (the word's low bits) and its low
    ``rotate`` bits (the word's top bits).
    """
    width = len(planes)
    tmp = _scratch("join_tmp", words.nbytes).view(words.dtype)
    np.left_shift(planes[width - 1], 8 * (width - 1) - rotate, out=words, dtype=words.dtype)
    for p in range(width - 2, 0, -1):
        np.left_shift(planes[p], 8 * p - rotate, out=tmp, dtype=words.dtype)
        np.bitwise_or(words, tmp, out=words)
    low = _scratch("join_low", len(planes[0]))
    np.right_shift(planes[0], rotate, out=low)
    np.bitwise_or(words, low, out=words, casting="unsafe")
    if rotate:
        np.left_shift(planes[0], 8 * width - rotate, out=tmp, dtype=words.dtype)
        np.bitwise_or(words, tmp, out=words)


def _planes_np(values: np.ndarray, width: int, rotate: int, name: str) -> np.ndarray:
    """numpy version of :func:`_planes`.

    For rotations under 8 bits, plane ``p >= 1`` is the word shifted right by
    ``8p - rotate`` and plane 0 ORs the low byte shifted left with the top
    ``rotate`` bits: each written straight into its plane (a truncating
    ufunc output), ~1.5x faster than rotating the words first.
    """
    n = len(values) // width
    words = values.view(_UINT[width])
    planes = _scratch(name, len(values)).reshape(width, n)
    if rotate >= 8:
        rotated = _scratch(name + "_rot", len(values)).view(_UINT[width])
        _rotate(words, rotated, rotate, left=True)
        _split(rotated, planes)
        return planes
    for p in range(1, width):
        np.right_shift(words, 8 * p - rotate, out=planes[p], casting="unsafe")
    np.left_shift(words, rotate, out=planes[0], casting="unsafe")
    if rotate:
        top = _scratch(name + "_top", n)
        np.right_shift(words, 8 * width - rotate, out=top, casting="unsafe")
        np.bitwise_or(planes[0], top, out=planes[0])
    return planes


def _planes(values: np.ndarray, width: int, rotate: int, name: str) -> np.ndarray:
    """The ``(width, n)`` byte planes of ``values`` (uint8, rotated first), per-thread buffer."""
    if _native is None:
        return _planes_np(values, width, rotate, name)
    planes = _scratch(name, len(values)).reshape(width, -1)
    _native.split(values, planes, width, rotate)
    return planes


def _join(planes: list[np.ndarray], dest: np.ndarray, width: int, rotate: int) -> None:
    """Rebuild the values of ``planes`` (inverse of :func:`_planes`) into ``dest`` (uint8)."""
    if _native is not None:
        _native.join(planes, dest, width, rotate)
    elif width == 1:
        dest[:] = planes[0]
    elif rotate >= 8:
        grouped = _scratch("dec_rot", len(dest))
        _interleave(planes, grouped, width)
        t = _UINT[width]
        _rotate(grouped.view(t), dest.view(t), rotate, left=False)
    else:
        _join_np(planes, dest.view(_UINT[width]), rotate)


def _sample_rows(values: np.ndarray, width: int) -> np.ndarray:
    """The values the planes are judged on: the whole chunk if small, else spread slices."""
    n = len(values) // width
    if n < 4 * _SAMPLE_VALUES:
        return values
    rows = values.reshape(n, width)
    step, size = n // _SLICES, _SAMPLE_VALUES // _SLICES
    sample = _scratch("sample", _SAMPLE_VALUES * width).reshape(_SLICES, size, width)
    for i in range(_SLICES):
        sample[i] = rows[i * step : i * step + size]
    return sample.reshape(-1)


def _entropy_bits(counts: list[int], total: int) -> float:
    """Summed in symbol order with math.log2, like ``_planes.c``, so both decide alike."""
    bits = total * math.log2(total)
    for count in counts:
        if count:
            bits -= count * math.log2(count)
    return bits


def _plane_method(counts: list[int], total: int) -> int:
    """The method for a plane whose sampled bytes counted ``counts`` (``judge`` in ``_planes.c``).

    Estimated coded sizes in bytes: the byte entropy for zstd on the whole
    plane, and for a split the raw high bits plus the low bits' entropy. The
    cheapest method (split 2, split 3, zstd) within ``_SPLIT_SLACK`` of the
    smallest estimate wins; 0 when that does not save ``_SAMPLE_SAVING``.
    """
    coded = _entropy_bits(counts, total) / 8
    split2 = total * 6.0 / 8.0 + _entropy_bits([sum(counts[c::4]) for c in range(4)], total) / 8
    split3 = total * 5.0 / 8.0 + _entropy_bits([sum(counts[c::8]) for c in range(8)], total) / 8
    least = coded if coded < split2 else split2
    least = split3 if split3 < least else least
    if least >= total * (1 - _SAMPLE_SAVING):
        return 0
    near = least + total / _SPLIT_SLACK
    return 2 if split2 <= near else 3 if split3 <= near else 1


def _split_judged(
    values: np.ndarray, width: int, rotate: int, name: str
) -> tuple[np.ndarray, list[int]]:
    """``(planes, methods)``: each plane's method (0 raw, 1 zstd, 2/3 split), judged on a sample.

    The planes (per-thread buffer) are filled only when one is worth coding.
    Native: one call for both, so one GIL release per chunk.
    """
    planes = _scratch(name, len(values)).reshape(width, -1)
    if _native is not None:
        plan = _native.split(values, planes, width, rotate, _SAMPLE_VALUES, _SAMPLE_SAVING)
        return planes, [plan >> (4 * p) & 15 for p in range(width)]
    sample = _planes_np(_sample_rows(values, width), width, rotate, "sample_planes")
    methods = [
        _plane_method(np.bincount(plane, minlength=256).tolist(), len(plane)) if len(plane) else 0
        for plane in sample
    ]
    if any(methods):
        planes = _planes_np(values, width, rotate, name)
    return planes, methods


def _segments(n: int, method: int) -> int:
    """Slots per segment of a split plane of ``n`` bytes (``_planes.c``: split_plane)."""
    return -(-n // (4 if method == 2 else 8))


def split_sizes(n: int, method: int) -> tuple[int, int]:
    """``(high, low)`` byte lengths of a split (method 2 or 3) of an ``n``-byte plane."""
    q = _segments(n, method)
    return (3 * q, q) if method == 2 else (5 * q, 4 * q)


def _split_plane(plane: np.ndarray, method: int) -> tuple[np.ndarray, np.ndarray]:
    """``(high, low)`` of a split plane: the high bits raw, the low bits to code."""
    high_len, low_len = split_sizes(len(plane), method)
    high = _scratch("split_high", high_len)
    low = _scratch("split_low", low_len)
    if _native is not None:
        _native.split_plane(plane, high, low, method)
        return high, low
    segs = 4 if method == 2 else 8
    q = _segments(len(plane), method)
    s = np.zeros(segs * q, np.uint8)
    s[: len(plane)] = plane
    s = s.reshape(segs, q)
    h = high.reshape(3 if method == 2 else 5, q)
    lo = low.reshape(1 if method == 2 else 4, q)
    if method == 2:
        for i in range(3):
            h[i] = s[i] >> 2 | (s[3] >> (2 + 2 * i) & 3) << 6
        lo[0] = s[0] & 3 | (s[1] & 3) << 2 | (s[2] & 3) << 4 | (s[3] & 3) << 6
    else:
        t = (s[5] >> 3).astype(np.uint16) | (s[6] >> 3).astype(np.uint16) << 5
        t |= (s[7] >> 3).astype(np.uint16) << 10
        for i in range(5):
            h[i] = s[i] >> 3 | (t >> (3 * i) & 7).astype(np.uint8) << 5
        for r in range(4):
            lo[r] = s[r] & 7 | (s[r + 4] & 7) << 4
    return high, low


def _join_plane(high: np.ndarray, low: np.ndarray, plane: np.ndarray, method: int) -> None:
    """The inverse of :func:`_split_plane`, into ``plane``."""
    if _native is not None:
        _native.join_plane(high, low, plane, method)
        return
    n = len(plane)
    q = _segments(n, method)
    h = high.reshape(3 if method == 2 else 5, q)
    lo = low.reshape(1 if method == 2 else 4, q)
    if method == 2:
        s = np.empty((4, q), np.uint8)
        for i in range(3):
            s[i] = (h[i] & 63) << 2 | lo[0] >> (2 * i) & 3
        s[3] = (h[0] >> 6 | (h[1] >> 6) << 2 | (h[2] >> 6) << 4) << 2 | lo[0] >> 6
    else:
        s = np.empty((8, q), np.uint8)
        t = np.zeros(q, np.uint16)
        for i in range(5):
            s[i] = (h[i] & 31) << 3
            t |= (h[i] >> 5).astype(np.uint16) << (3 * i)
        for i in range(3):
            s[5 + i] = (t >> (5 * i) & 31).astype(np.uint8) << 3
        for r in range(4):
            s[r] |= lo[r] & 7
            s[r + 4] |= lo[r] >> 4 & 7
    plane[:] = s.reshape(-1)[:n]


def _pays(coded_len: int, raw_len: int, saving: float = MIN_SAVING) -> bool:
    return coded_len < raw_len * (1 - saving)


class ByteGroupCodec(Codec):
    """Byte planes (exponent-aligned for floats), each zstd-compressed when it pays."""

    name = "dcp_multilevel.bytegroup"
    version = 3
    read_versions = frozenset({1, 2, 3})

    def layout(self, dtype: torch.dtype) -> tuple[int, int]:
        width, rotate = element_layout(dtype)
        return width, _ROTATE_V2.get(dtype, rotate)

    def payload_bound(self, raw_len: int, width: int) -> int:
        # The table, then every plane but the last at most raw (a coded plane
        # that does not pay is overwritten by the raw one), the last at most
        # its zstd bound while it is being compressed.
        return 1 + width * _PLANE.size + raw_len + _zstd.plane_bound(raw_len // max(width, 1))

    def encode(self, chunk: memoryview, width: int, rotate: int) -> bytes | None:
        out = np.empty(self.payload_bound(len(chunk), width), dtype=np.uint8)
        n = self.encode_into(chunk, width, rotate, memoryview(out))
        return None if n is None else out[:n].tobytes()

    def encode_into(
        self, chunk: memoryview, width: int, rotate: int, out: memoryview
    ) -> int | None:
        """Code ``chunk`` into ``out``: table, then each plane coded or raw, in place.

        Zstd writes each plane's frame straight into ``out`` (no per-plane
        buffer); a plane that does not pay is overwritten by its raw bytes.
        """
        if len(out) < self.payload_bound(len(chunk), width):
            raise ValueError(f"output buffer of {len(out)} bytes is under the payload bound")
        values = np.frombuffer(chunk, dtype=np.uint8)
        if rotate and width > 1 and _native_zstd and _native is not None:  # float: all in C
            # The planes, then room for a split plane's low stream.
            planes = _scratch("enc_planes", len(values) + len(values) // (2 * width) + 8)
            return _native.encode(
                values, out, planes, width, rotate, _SAMPLE_VALUES, _SAMPLE_SAVING, MIN_SAVING
            )
        # Per plane: 0 raw, 1 zstd, 2/3 split (floats only).
        if width == 1:
            planes = values.reshape(1, -1)
            methods = [1]
        elif rotate:  # a float type: judged by entropy (see the module docstring)
            planes, methods = _split_judged(values, width, rotate, "enc_planes")
            if not any(methods):
                return None
        else:
            worth = self._sample(values, width, rotate)
            if worth is not None and not any(worth):
                return None
            methods = [1] * width if worth is None else [int(w) for w in worth]
            planes = _planes(values, width, rotate, "enc_planes")
        n = planes.shape[1]
        out[0] = width
        pos = 1 + width * _PLANE.size
        coded_any = False
        for p in range(width):
            plane = planes[p]
            method, length = methods[p], n
            if method == 1:
                k = _zstd.compress_plane_into(plane, out[pos : pos + _zstd.plane_bound(n)])
                length = n if k is None else k
            elif method:
                high, low = _split_plane(plane, method)
                at = pos + len(high)
                out[pos:at] = high
                k = _zstd.compress_plane_into(low, out[at : at + _zstd.plane_bound(len(low))])
                length = n if k is None else len(high) + k
            if not _pays(length, n):
                method, length = 0, n
            coded_any |= method != 0
            if method == 0:
                out[pos : pos + n] = plane
            _PLANE.pack_into(out, 1 + p * _PLANE.size, method, length)
            pos += length
        return pos if coded_any else None

    @staticmethod
    def _sample(values: np.ndarray, width: int, rotate: int) -> list[bool] | None:
        """Per plane: does a sample of it compress? None when the chunk is too small to sample."""
        if len(values) // width < 4 * _SAMPLE_VALUES:
            return None
        planes = _planes(_sample_rows(values, width), width, rotate, "sample_planes")
        # Only the size matters: a buffer that holds what pays (no bytes object per plane).
        room = memoryview(_scratch("sample_out", _SAMPLE_VALUES))
        room = room[: int(_SAMPLE_VALUES * (1 - _SAMPLE_SAVING))]
        return [_zstd.compress_plane_into(planes[p], room) is not None for p in range(width)]

    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: int) -> None:
        nplanes = payload[0]
        if nplanes != width:
            raise ValueError(f"payload has {nplanes} planes, the frame says width {width}")
        n = len(out) // width
        table_end = 1 + width * _PLANE.size
        if len(payload) < table_end:
            raise ValueError("payload ends inside its plane table")
        pos = table_end
        planes: list[np.ndarray] = []  # views of the payload or of this thread's scratch
        scratch = _scratch("dec_planes", len(out)).reshape(width, n)
        for p in range(width):
            method, length = _PLANE.unpack_from(payload, 1 + p * _PLANE.size)
            data = payload[pos : pos + length]
            if len(data) != length:
                raise ValueError(f"plane {p} runs past the end of the payload")
            pos += length
            if method == 0:
                if length != n:
                    raise ValueError(f"raw plane {p} has {length} bytes, expected {n}")
                planes.append(np.frombuffer(data, dtype=np.uint8))
            elif method == 1:
                _zstd.decompress_into(data, memoryview(scratch[p]))
                planes.append(scratch[p])
            elif method in (2, 3):
                high_len, low_len = split_sizes(n, method)
                if length < high_len:
                    raise ValueError(
                        f"split plane {p} has {length} bytes, under its {high_len} raw"
                    )
                low = _scratch("dec_low", low_len)
                _zstd.decompress_into(data[high_len:], memoryview(low))
                _join_plane(np.frombuffer(data[:high_len], np.uint8), low, scratch[p], method)
                planes.append(scratch[p])
            else:
                raise ValueError(f"plane {p} has unknown method {method}")
        if pos != len(payload):
            raise ValueError(f"payload has {len(payload) - pos} trailing bytes")
        _join(planes, np.frombuffer(out, dtype=np.uint8), width, rotate)

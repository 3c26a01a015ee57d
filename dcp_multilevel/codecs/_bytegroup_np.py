"""The bytegroup codec's plane kernels in numpy: the fallback of ``_planes.c``.

``bytegroup.py`` calls the C kernels when the extension built and these
otherwise (:data:`~dcp_multilevel.codecs.bytegroup.NATIVE`); both write the
same bytes and judge planes alike. Also here: the judge's parameters (sample
size, thresholds), which the C kernels receive as arguments, the layout of
split planes (:func:`split_sizes`), and the per-thread scratch buffers both
paths code into.

Each function mirrors a ``_planes.c`` function (named in its docstring);
that file says why the bit fields are laid out as they are.
"""

from __future__ import annotations

import math

import numpy as np

from ._scratch import scratch
from .base import MIN_SAVING

__all__ = [
    "SAMPLE_SAVING",
    "SAMPLE_VALUES",
    "SPARSE",
    "SPLIT_SLACK",
    "bitmap_len",
    "join_np",
    "join_plane_np",
    "join_sparse_np",
    "planes_np",
    "sample_rows",
    "scratch",
    "sparse_count_np",
    "sparse_plane_np",
    "split_judged_np",
    "split_plane_np",
    "split_sizes",
]

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Values sampled per chunk to decide which planes to compress: _SLICES slices
#: spread over the chunk (one slice at the start misjudges tensors whose first
#: rows differ, e.g. the rarely trained rows of an embedding).
SAMPLE_VALUES = 16 << 10
_SLICES = 8
#: A plane is compressed when its sample saves at least this fraction; looser
#: than MIN_SAVING, as a sample only estimates the whole plane.
SAMPLE_SAVING = MIN_SAVING / 2
#: The cheapest plane method within 1/SPLIT_SLACK byte per value of the
#: smallest estimate is chosen (``SPLIT_SLACK`` in ``_planes.c`` says why).
SPLIT_SLACK = 256.0
#: The plane method of a sparse plane: a bitmap and the non-zero bytes.
SPARSE = 4


def _rotate(words: np.ndarray, out: np.ndarray, bits: int, left: bool) -> None:
    """Rotate each unsigned word of ``words`` by ``bits`` into ``out`` (same dtype)."""
    tmp = scratch("rot_tmp", words.nbytes).view(words.dtype)
    total = 8 * words.itemsize
    first, second = (np.left_shift, np.right_shift) if left else (np.right_shift, np.left_shift)
    first(words, bits, out=out)
    second(words, total - bits, out=tmp)
    np.bitwise_or(out, tmp, out=out)


def _split(words: np.ndarray, planes: np.ndarray) -> None:
    """Byte ``p`` of every word into ``planes[p]`` (little-endian).

    A shift and a truncating copy per plane run faster than a transposing
    copy, whose stride-``width`` byte reads defeat the cache.
    """
    # Only for rotations of 8 bits or more (never written by this codec).
    tmp = scratch("split_tmp", words.nbytes).view(words.dtype)
    np.copyto(planes[0], words, casting="unsafe")
    for p in range(1, len(planes)):
        np.right_shift(words, 8 * p, out=tmp)
        np.copyto(planes[p], tmp, casting="unsafe")


def _interleave(planes: np.ndarray, dest: np.ndarray, width: int) -> None:
    """Rebuild values from byte planes (little-endian: plane p is byte p).

    Shifting and OR-ing whole words runs several times faster than a
    transposing copy, whose stride-``width`` byte writes defeat the cache.
    """
    words = dest.view(_UINT[width])
    np.copyto(words, planes[width - 1], casting="unsafe")
    for p in range(width - 2, -1, -1):
        words <<= 8
        words |= planes[p]


def _join_words(planes: list[np.ndarray], words: np.ndarray, rotate: int) -> None:
    """Inverse of :func:`planes_np` for rotations under 8 bits, straight into ``words``.

    Rotating right by ``rotate`` moves plane ``p >= 1`` to bit ``8p - rotate``
    and splits plane 0 into its top bits (the word's low bits) and its low
    ``rotate`` bits (the word's top bits).
    """
    width = len(planes)
    tmp = scratch("join_tmp", words.nbytes).view(words.dtype)
    np.left_shift(planes[width - 1], 8 * (width - 1) - rotate, out=words, dtype=words.dtype)
    for p in range(width - 2, 0, -1):
        np.left_shift(planes[p], 8 * p - rotate, out=tmp, dtype=words.dtype)
        np.bitwise_or(words, tmp, out=words)
    low = scratch("join_low", len(planes[0]))
    np.right_shift(planes[0], rotate, out=low)
    np.bitwise_or(words, low, out=words, casting="unsafe")
    if rotate:
        np.left_shift(planes[0], 8 * width - rotate, out=tmp, dtype=words.dtype)
        np.bitwise_or(words, tmp, out=words)


def planes_np(values: np.ndarray, width: int, rotate: int, name: str) -> np.ndarray:
    """The ``(width, n)`` byte planes of ``values`` (rotated first), in scratch ``name``.

    ``_planes.c``: split. For rotations under 8 bits, plane ``p >= 1`` is the
    word shifted right by ``8p - rotate`` and plane 0 ORs the low byte
    shifted left with the top ``rotate`` bits: each written straight into its
    plane (a truncating ufunc output), faster than rotating the words first:
    one pass over the words less, and no rotated copy.
    """
    n = len(values) // width
    words = values.view(_UINT[width])
    planes = scratch(name, len(values)).reshape(width, n)
    if rotate >= 8:
        rotated = scratch(name + "_rot", len(values)).view(_UINT[width])
        _rotate(words, rotated, rotate, left=True)
        _split(rotated, planes)
        return planes
    for p in range(1, width):
        np.right_shift(words, 8 * p - rotate, out=planes[p], casting="unsafe")
    np.left_shift(words, rotate, out=planes[0], casting="unsafe")
    if rotate:
        top = scratch(name + "_top", n)
        np.right_shift(words, 8 * width - rotate, out=top, casting="unsafe")
        np.bitwise_or(planes[0], top, out=planes[0])
    return planes


def join_np(
    planes: list[np.ndarray], dest: np.ndarray, width: int, rotate: int, xor: bool = False
) -> None:
    """Rebuild the values of ``planes`` (inverse of :func:`planes_np`) into ``dest`` (uint8);
    ``xor``: XORed into what ``dest`` holds.

    ``_planes.c``: join.
    """
    if xor:
        values = scratch("join_xor", len(dest))
        join_np(planes, values, width, rotate)
        np.bitwise_xor(dest, values, out=dest)
    elif width == 1:
        dest[:] = planes[0]
    elif rotate >= 8:
        grouped = scratch("dec_rot", len(dest))
        _interleave(planes, grouped, width)
        t = _UINT[width]
        _rotate(grouped.view(t), dest.view(t), rotate, left=False)
    else:
        _join_words(planes, dest.view(_UINT[width]), rotate)


def sample_rows(values: np.ndarray, width: int) -> np.ndarray:
    """The values the planes are judged on: the whole chunk if small, else spread slices."""
    n = len(values) // width
    if n < 4 * SAMPLE_VALUES:
        return values
    rows = values.reshape(n, width)
    step, size = n // _SLICES, SAMPLE_VALUES // _SLICES
    sample = scratch("sample", SAMPLE_VALUES * width).reshape(_SLICES, size, width)
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


def _floored_bits(counts: list[int], total: int) -> float:
    """Huffman-coded size in bits, at least one bit a symbol (``_planes.c``: floored_bits)."""
    bits = 0.0
    whole = math.log2(total)
    for count in counts:
        if count:
            length = whole - math.log2(count)
            bits += count * (length if length > 1 else 1)
    return bits


def _group_counts(plane: np.ndarray, slices: int) -> tuple[list[int], int]:
    """``(counts, groups)``: the sparse bitmap bytes of each group of 8 values of
    each of ``slices`` equal slices of a sample plane (``_planes.c``: count_groups)."""
    counts = np.zeros(256, np.int64)
    groups = 0
    for part in np.split(plane, slices):
        bits = np.packbits(part != 0, bitorder="little")  # a short last group: zeros
        counts += np.bincount(bits, minlength=256)
        groups += len(bits)
    return counts.tolist(), groups


def _sparse_pays(plane: np.ndarray, counts: list[int], slices: int) -> bool:
    """Whether a mostly-zero sample plane is smaller sparse than zstd-coded (``_planes.c``:
    sparse_pays)."""
    total = len(plane)
    groups, ngroups = _group_counts(plane, slices)
    sparse = _floored_bits(groups, ngroups) + _floored_bits(counts[1:], total - counts[0])
    return sparse < _floored_bits(counts, total)


def _plane_method(counts: list[int], total: int) -> int:
    """The method for a plane whose sampled bytes counted ``counts`` (``judge`` in ``_planes.c``).

    Estimated coded sizes in bytes: the byte entropy for zstd on the whole
    plane, and for a split the raw high bits plus the low bits' entropy. The
    cheapest method (split 2, split 3, zstd) within ``SPLIT_SLACK`` of the
    smallest estimate wins; 0 when that does not save ``SAMPLE_SAVING``.
    """
    coded = _entropy_bits(counts, total) / 8
    split2 = total * 6.0 / 8.0 + _entropy_bits([sum(counts[c::4]) for c in range(4)], total) / 8
    split3 = total * 5.0 / 8.0 + _entropy_bits([sum(counts[c::8]) for c in range(8)], total) / 8
    least = coded if coded < split2 else split2
    least = split3 if split3 < least else least
    if least >= total * (1 - SAMPLE_SAVING):
        return 0
    near = least + total / SPLIT_SLACK
    return 2 if split2 <= near else 3 if split3 <= near else 1


def split_judged_np(
    values: np.ndarray, width: int, rotate: int, name: str
) -> tuple[np.ndarray, list[int]]:
    """``(planes, methods)``: each plane's method (0 raw, 1 zstd, 2/3 split, 4 sparse), judged
    on a sample.

    ``_planes.c``: split with a sample size. The planes (scratch ``name``)
    are filled only when one is worth coding.
    """
    planes = scratch(name, len(values)).reshape(width, -1)
    rows = sample_rows(values, width)
    slices = 1 if rows is values else _SLICES
    sample = planes_np(rows, width, rotate, "sample_planes")
    methods = []
    for plane in sample:
        counts = np.bincount(plane, minlength=256).tolist()
        method = _plane_method(counts, len(plane)) if len(plane) else 0
        # Over 3/4 zeros, not all (``judge`` in _planes.c says why): perhaps sparse.
        if method == 1 and 3 * len(plane) < 4 * counts[0] < 4 * len(plane):
            method = SPARSE if _sparse_pays(plane, counts, slices) else 1
        methods.append(method)
    if any(methods):
        planes = planes_np(values, width, rotate, name)
    return planes, methods


def _segments(n: int, method: int) -> int:
    """Slots per segment of a split plane of ``n`` bytes (``_planes.c``: split_plane)."""
    return -(-n // (4 if method == 2 else 8))


def split_sizes(n: int, method: int) -> tuple[int, int]:
    """``(high, low)`` byte lengths of a split (method 2 or 3) of an ``n``-byte plane."""
    q = _segments(n, method)
    return (3 * q, q) if method == 2 else (5 * q, 4 * q)


def split_plane_np(plane: np.ndarray, method: int, high: np.ndarray, low: np.ndarray) -> None:
    """Split ``plane`` into its high bits (raw) and low bits (to code): ``_planes.c``: split_plane.

    ``high`` and ``low`` hold :func:`split_sizes` bytes.
    """
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


def join_plane_np(high: np.ndarray, low: np.ndarray, plane: np.ndarray, method: int) -> None:
    """The inverse of :func:`split_plane_np`, into ``plane``: ``_planes.c``: join_plane."""
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


def bitmap_len(n: int) -> int:
    """Bytes of a sparse plane's bitmap for ``n`` bytes (``_planes.c``: bitmap_len)."""
    return (n + 7) // 8


def sparse_plane_np(plane: np.ndarray, bitmap: np.ndarray, values: np.ndarray) -> int:
    """The bitmap of ``plane``'s non-zero bytes into ``bitmap`` and those bytes into
    ``values[:count]``; returns count (``_planes.c``: sparse_plane)."""
    nonzero = plane != 0
    bitmap[:] = np.packbits(nonzero, bitorder="little")
    kept = plane[nonzero]
    values[: len(kept)] = kept
    return len(kept)


def sparse_count_np(bitmap: np.ndarray, n: int) -> int:
    """The non-zero bytes ``bitmap`` marks in a plane of ``n`` (``_planes.c``: sparse_count).

    Raises:
        ValueError: the bitmap has the wrong length or marks bytes past ``n``.
    """
    if len(bitmap) != bitmap_len(n):
        raise ValueError(
            f"a sparse plane of {n} bytes has a {bitmap_len(n)}-byte bitmap, not {len(bitmap)}"
        )
    if n % 8 and bitmap[-1] >> (n % 8):
        raise ValueError(f"sparse plane bitmap marks bytes past the plane's {n}")
    return int(np.unpackbits(bitmap).sum(dtype=np.int64))


def join_sparse_np(bitmap: np.ndarray, values: np.ndarray, plane: np.ndarray) -> None:
    """The inverse of :func:`sparse_plane_np`, into ``plane`` (``_planes.c``: join_sparse).

    Raises:
        ValueError: the bitmap does not mark exactly ``len(values)`` bytes of the plane.
    """
    count = sparse_count_np(bitmap, len(plane))
    if count != len(values):
        raise ValueError(
            f"sparse plane bitmap marks {count} non-zero bytes, its values are {len(values)}"
        )
    nonzero = np.unpackbits(bitmap, count=len(plane), bitorder="little").view(bool)
    plane[:] = 0
    plane[nonzero] = values

"""Float-aware byte grouping (``dcp_multilevel.bytegroup/4``).

A chunk of ``width``-byte values is split into ``width`` planes: plane ``p``
holds byte ``p`` of every value. Floats are first rotated left by ``rotate``
bits (recorded in the frame header). Each plane is compressed with zstd, or
split or stored sparse (below), only if that pays, else stored raw; if no
plane pays, the whole chunk is stored raw by the caller (``encode`` returns
None).

Rotation: fp32 and bf16 (and complex64's parts) rotate by three bits: the top
plane then holds the low six exponent bits and the top two mantissa bits,
and the two top exponent bits, which barely vary in weights and optimizer
states (values well inside (2**-63, 2)), join the sign at the bottom of the
lowest plane. That plane then compresses instead of being stored raw, and the
top mantissa bits, skewed within each binade, are coded together with the
exponent. Against a one-bit rotation (the top plane exactly the exponent, the
sign joining the mantissa), three bits code fp32 and bf16 weights and
optimizer states slightly smaller, and two or four bits code them larger
than three (``benchmarks/bench_chunk_coding.py`` reports the ratios). The
other floats rotate by one bit (fp16, with 5 exponent bits, does best with 1).

Split planes: with rotate 3, the lowest plane of fp32 and bf16 holds five
near-random mantissa bits above the sign and the two top exponent bits. zstd
on the whole plane spends its time Huffman-coding the random bits. A split
stores the plane's high ``8 - k`` bits packed raw and codes only its low
``k`` bits with zstd: method 2 (k = 2, for a random sign) or method 3
(k = 3, for a sign that never changes, as in Adam's ``exp_avg_sq``). The
split comes out as small as zstd on the whole plane, or smaller, and coding
it costs a fraction of the time, so whole chunks code faster on one thread
(``benchmarks/bench_chunk_coding.py`` measures both). Where the
mantissa's low bits carry structure (values that came from a narrower
float, e.g. MiniLM's untrained embedding rows), zstd stays the better choice;
the judge picks per chunk. The packing (``_planes.c``: split_plane) cuts the
plane into 4 (k = 2) or 8 (k = 3) segments and packs slot ``j`` of every
segment together, so both directions are contiguous, vectorized loops.

Sparse planes. The planes of an XOR delta (``MultiLevelWriter(
reference=...)``: a chunk XOR its reference) are mostly zero bytes where the
values did not change, but rarely all zero. zstd codes such a plane as
Huffman literals, and a Huffman code spends at least one bit on every byte:
the zeros alone cost an eighth of the plane whatever their entropy. Method
4 stores a bitmap of the non-zero bytes (one bit per byte) and the non-zero
bytes in order, each as one zstd frame where that is smaller, else raw. zstd
then sees an eighth of the plane for the bitmap and only the bytes that
changed. On the XOR deltas of a real fine-tuning step, the planes the judge
makes sparse come out smaller than zstd codes them, and a plane of mostly
zeros also codes and decodes faster, zstd seeing a fraction of its bytes.
Raw values after a coded bitmap, or a raw bitmap, come out larger where the
plane is sparsest: each stream is coded, kept raw (told by its length) only
where zstd does not shrink it. The judge weighs method 4 against zstd (both
as Huffman codes with the one-bit floor) only on a sample plane over 3/4
zero: under it, joining the plane back takes longer than zstd's decoding
(``_planes.c``: judge). Checkpoints of floats rarely have such a plane, and
where one does, its ratio barely moves.

Payload layout: ``width`` u8, then per plane ``method u8 | length u32``, then
the planes' bytes in order. Method 0 is raw and 1 is one zstd frame. Methods
2 and 3 store the packed high bits (``split_sizes``), then one zstd frame of
the packed low bits. Method 4 stores ``bitmap length u32``, the bitmap
(``ceil(n / 8)`` bytes raw, bit ``i % 8`` of byte ``i // 8`` set where byte
``i`` is not 0, bits past ``n`` clear; or a zstd frame of them), then the
non-zero bytes (as many raw as the bitmap counts, or a zstd frame of them).

Planes are coded with zstd tuned as an entropy coder (``zstd._PLANE_PARAMS``;
``level`` does not apply; the all-in-C coder adds a faster match search,
``_planes.c`` PLANE_FAST). Which planes are worth it is judged on a sample of
the chunk (a few spread slices) before the chunk is split: planes whose
sample does not compress are stored raw without compressing the rest
(mantissa planes are near-random), and a chunk none of whose planes pays is
rejected outright, so random data costs almost nothing. For floats the
judge is the sample's byte entropy: zstd finds almost no matches in float
planes, so it codes them close to their entropy (the same ratios as
compressing the sample with zstd on float weights and optimizer states,
fp32 and bf16, at a fraction of the time). The same byte counts
estimate a split (raw high bits plus the low bits' entropy), and the
cheapest method whose estimate is within ``SPLIT_SLACK`` of the smallest
is chosen. Integer planes can hold repeats (``arange``, padding) that only a
match finder sees, so their sample is compressed with zstd.

Splitting, joining, sparse planes and the entropy sample run in ``_planes.c``
with the GIL released (one call each per chunk or plane). Where a libzstd is found at import
(:data:`NATIVE_ZSTD`), a float chunk's whole coding, zstd included, is one
call: every GIL hand-off between coding threads waits on waking the other
thread, and on small chunks those waits cost more than the second thread
gained. Builds without a C compiler fall back to numpy (the ``*_np`` kernels at the
end of this module; :data:`NATIVE` is False): the same bytes as the C kernels without
libzstd, but ~30 short numpy calls per chunk that each retake the GIL, so a second coding
thread gains little. Each numpy kernel mirrors a ``_planes.c`` function (named in its
docstring; that file says why the bit fields are laid out as they are), and both judge
planes alike. The judge's parameters (sample size, thresholds), which the C kernels
receive as arguments, and the layout of split planes (:func:`split_sizes`) are defined
with the numpy kernels; both paths code into the per-thread scratch buffers of
``_scratch.py``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
import torch

from . import zstd
from ._scratch import scratch
from .base import MIN_SAVING, Codec, element_layout

__all__ = [
    "NATIVE",
    "NATIVE_ZSTD",
    "SAMPLE_SAVING",
    "SAMPLE_VALUES",
    "SPARSE",
    "SPLIT_SLACK",
    "ByteGroupCodec",
    "bitmap_len",
    "join_np",
    "join_plane_np",
    "join_sparse_np",
    "planes_np",
    "sample_rows",
    "sparse_count_np",
    "sparse_plane_np",
    "split_judged_np",
    "split_plane_np",
    "split_sizes",
]

try:
    from . import _planes as _native
except ImportError:  # built without a C compiler (setup.py: optional)
    _native = None


#: Whether the C plane kernels are in use (see the module docstring).
NATIVE = _native is not None
#: Whether they also run zstd (a libzstd was found): a float chunk is then
#: coded in one call, one GIL release.
NATIVE_ZSTD = NATIVE and bool(_native.HAS_ZSTD)
_native_zstd = NATIVE_ZSTD  # tests switch this off to compare the two paths

_PLANE = struct.Struct("<BI")
#: A sparse plane's header: the stored length of its bitmap.
_SPARSE = struct.Struct("<I")
#: Rotation (bits) of the floats whose two top exponent bits join the sign (see
#: the module docstring); other dtypes take :func:`element_layout`'s.
_ROTATE = {torch.float32: 3, torch.bfloat16: 3, torch.complex64: 3}

# Each kernel below runs in ``_planes.c`` when it built, else in numpy
# (the ``*_np`` kernels at the end of this module): both write the same bytes.


def _planes(values: np.ndarray, width: int, rotate: int, name: str) -> np.ndarray:
    """The ``(width, n)`` byte planes of ``values`` (uint8, rotated first), per-thread buffer."""
    if _native is None:
        return planes_np(values, width, rotate, name)
    planes = scratch(name, len(values)).reshape(width, -1)
    _native.split(values, planes, width, rotate)
    return planes


def _join(
    planes: list[np.ndarray], dest: np.ndarray, width: int, rotate: int, xor: bool = False
) -> None:
    """Rebuild the values of ``planes`` (inverse of :func:`_planes`) into ``dest`` (uint8);
    ``xor``: XORed into what ``dest`` holds (one pass, no buffer for the values)."""
    if _native is not None:
        _native.join(planes, dest, width, rotate, xor)
    else:
        join_np(planes, dest, width, rotate, xor)


def _split_judged(
    values: np.ndarray, width: int, rotate: int, name: str
) -> tuple[np.ndarray, list[int]]:
    """``(planes, methods)``: each plane's method (0 raw, 1 zstd, 2/3 split, 4 sparse), on a sample.

    The planes (per-thread buffer) are filled only when one is worth coding.
    Native: one call for both, so one GIL release per chunk.
    """
    if _native is None:
        return split_judged_np(values, width, rotate, name)
    planes = scratch(name, len(values)).reshape(width, -1)
    plan = _native.split(values, planes, width, rotate, SAMPLE_VALUES, SAMPLE_SAVING)
    return planes, [plan >> (4 * p) & 15 for p in range(width)]


def _split_plane(plane: np.ndarray, method: int) -> tuple[np.ndarray, np.ndarray]:
    """``(high, low)`` of a split plane: the high bits raw, the low bits to code."""
    high_len, low_len = split_sizes(len(plane), method)
    high = scratch("split_high", high_len)
    low = scratch("split_low", low_len)
    if _native is not None:
        _native.split_plane(plane, high, low, method)
    else:
        split_plane_np(plane, method, high, low)
    return high, low


def _join_plane(high: np.ndarray, low: np.ndarray, plane: np.ndarray, method: int) -> None:
    """The inverse of :func:`_split_plane`, into ``plane``."""
    if _native is not None:
        _native.join_plane(high, low, plane, method)
    else:
        join_plane_np(high, low, plane, method)


def _sparse_plane(plane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bitmap, values)`` of a sparse plane (per-thread buffers)."""
    bitmap = scratch("sparse_bitmap", bitmap_len(len(plane)))
    values = scratch("sparse_values", len(plane))
    count = (sparse_plane_np if _native is None else _native.sparse_plane)(plane, bitmap, values)
    return bitmap, values[:count]


def _code_sparse(plane: np.ndarray, out: memoryview) -> int | None:
    """A sparse plane into ``out`` (``len(plane)`` bytes): its length, None unless smaller.

    ``_planes.c``: code_sparse, the same bytes: the bitmap's stored length
    (u32), the bitmap, the values; each a zstd frame where that is smaller,
    else raw.
    """
    n = len(plane)
    blen, at = bitmap_len(n), _SPARSE.size
    if at + blen >= n:
        return None
    bitmap, values = _sparse_plane(plane)
    k = zstd.compress_plane_into(bitmap, out[at : at + blen])
    if k is None:
        out[at : at + blen] = bitmap
        k = blen
    _SPARSE.pack_into(out, 0, k)
    at += k
    count = len(values)
    if count == 0:
        return at
    room = min(n - at, count)
    if room <= 0:
        return None
    k = zstd.compress_plane_into(values, out[at : at + room])
    if k is not None:
        return at + k
    if count > n - at:
        return None
    out[at : at + count] = values
    return at + count


def _decode_sparse(data: memoryview, plane: np.ndarray, p: int) -> None:
    """The inverse of :func:`_code_sparse`, into ``plane``.

    Raises:
        ValueError: a length in the plane disagrees with the plane's size or
            the bitmap's count, a bitmap bit lies past the plane, or a frame is
            corrupt.
    """
    n = len(plane)
    blen = bitmap_len(n)
    if len(data) < _SPARSE.size:
        raise ValueError(f"sparse plane {p} has {len(data)} bytes, under its 4-byte header")
    (stored,) = _SPARSE.unpack_from(data)
    at = _SPARSE.size + stored
    if stored > blen or at > len(data):
        raise ValueError(
            f"sparse plane {p} stores a {stored}-byte bitmap: over its {blen} bytes raw "
            f"or past the plane's {len(data)}"
        )
    if stored == blen:
        bitmap = np.frombuffer(data[_SPARSE.size : at], np.uint8)
    else:
        bitmap = scratch("dec_bitmap", blen)
        zstd.decompress_into(data[_SPARSE.size : at], memoryview(bitmap))
    count = (sparse_count_np if _native is None else _native.sparse_count)(bitmap, n)
    rest = data[at:]
    if len(rest) > count:
        raise ValueError(
            f"sparse plane {p} stores {len(rest)} bytes of values for {count} non-zero bytes"
        )
    if len(rest) == count:
        values = np.frombuffer(rest, np.uint8)
    else:
        values = scratch("dec_values", count)
        zstd.decompress_into(rest, memoryview(values))
    (join_sparse_np if _native is None else _native.join_sparse)(bitmap, values, plane)


def _pays(coded_len: int, raw_len: int, saving: float = MIN_SAVING) -> bool:
    return coded_len < raw_len * (1 - saving)


class ByteGroupCodec(Codec):
    """Byte planes (exponent-aligned for floats), each zstd-compressed when it pays."""

    name = "dcp_multilevel.bytegroup"
    version = 4

    def layout(self, dtype: torch.dtype) -> tuple[int, int]:
        """As :meth:`Codec.layout`, but fp32, bf16 and complex64 rotate by 3 bits."""
        width, rotate = element_layout(dtype)
        return width, _ROTATE.get(dtype, rotate)

    def payload_bound(self, raw_len: int, width: int) -> int:
        """Bytes :meth:`encode_into` needs: plane table, raw bytes, one plane's zstd slack."""
        # The table, then every plane but the last at most raw (a coded plane
        # that does not pay is overwritten by the raw one), the last at most
        # its zstd bound while it is being compressed.
        return 1 + width * _PLANE.size + raw_len + zstd.plane_bound(raw_len // max(width, 1))

    def encode(self, chunk: memoryview, width: int, rotate: int) -> bytes | None:
        """The payload of ``chunk`` (None when no plane pays), through :meth:`encode_into`."""
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
        if not len(chunk):  # nothing to gain (and zstd would wait on an empty plane)
            return None
        values = np.frombuffer(chunk, dtype=np.uint8)
        if rotate and width > 1 and _native_zstd and _native is not None:  # float: all in C
            # The planes, then room for a split plane's low stream or a
            # sparse plane's bitmap and values (_planes.c: extra_room).
            n = len(values) // width
            planes = scratch("enc_planes", len(values) + n + n // 8 + 16)
            return _native.encode(
                values, out, planes, width, rotate, SAMPLE_VALUES, SAMPLE_SAVING, MIN_SAVING
            )
        # Per plane: 0 raw, 1 zstd, 2/3 split, 4 sparse (floats only).
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
                k = zstd.compress_plane_into(plane, out[pos : pos + zstd.plane_bound(n)])
                length = n if k is None else k
            elif method == SPARSE:
                k = _code_sparse(plane, out[pos : pos + n])
                length = n if k is None else k
            elif method:
                high, low = _split_plane(plane, method)
                at = pos + len(high)
                out[pos:at] = high
                k = zstd.compress_plane_into(low, out[at : at + zstd.plane_bound(len(low))])
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
        if len(values) // width < 4 * SAMPLE_VALUES:
            return None
        planes = _planes(sample_rows(values, width), width, rotate, "sample_planes")
        # Only the size matters: a buffer that holds what pays (no bytes object per plane).
        room = memoryview(scratch("sample_out", SAMPLE_VALUES))
        room = room[: int(SAMPLE_VALUES * (1 - SAMPLE_SAVING))]
        return [zstd.compress_plane_into(planes[p], room) is not None for p in range(width)]

    def decode(self, payload: memoryview, out: memoryview, width: int, rotate: int) -> None:
        """Decode a payload into ``out``.

        Raises:
            ValueError: the plane table, a plane's length or method, or the
                payload's size does not match ``width`` and ``len(out)``.
        """
        planes = self._decode_planes(payload, len(out), width)
        _join(planes, np.frombuffer(out, dtype=np.uint8), width, rotate)

    def decode_xor(
        self,
        payload: memoryview,
        out: memoryview,
        width: int,
        rotate: int,
        ready: Callable[[], object] | None = None,
    ) -> None:
        """As :meth:`Codec.decode_xor`: the planes are joined straight onto ``out``."""
        planes = self._decode_planes(payload, len(out), width)
        if ready is not None:
            ready()
        _join(planes, np.frombuffer(out, dtype=np.uint8), width, rotate, xor=True)

    @staticmethod
    def _decode_planes(payload: memoryview, raw_len: int, width: int) -> list[np.ndarray]:
        """The ``width`` planes of a payload (views of it or of this thread's scratch)."""
        nplanes = payload[0]
        if nplanes != width:
            raise ValueError(f"payload has {nplanes} planes, the frame says width {width}")
        n = raw_len // width
        table_end = 1 + width * _PLANE.size
        if len(payload) < table_end:
            raise ValueError("payload ends inside its plane table")
        pos = table_end
        planes: list[np.ndarray] = []  # views of the payload or of this thread's scratch
        decoded = scratch("dec_planes", raw_len).reshape(width, n)
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
                zstd.decompress_into(data, memoryview(decoded[p]))
                planes.append(decoded[p])
            elif method in (2, 3):
                high_len, low_len = split_sizes(n, method)
                if length < high_len:
                    raise ValueError(
                        f"split plane {p} has {length} bytes, under its {high_len} raw"
                    )
                low = scratch("dec_low", low_len)
                zstd.decompress_into(data[high_len:], memoryview(low))
                _join_plane(np.frombuffer(data[:high_len], np.uint8), low, decoded[p], method)
                planes.append(decoded[p])
            elif method == SPARSE:
                _decode_sparse(data, decoded[p], p)
                planes.append(decoded[p])
            else:
                raise ValueError(f"plane {p} has unknown method {method}")
        if pos != len(payload):
            raise ValueError(f"payload has {len(payload) - pos} trailing bytes")
        return planes


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

"""The C byte-plane kernels (``codecs/_planes.c``) against their numpy fallback.

The split and join kernels must write the same bytes as numpy; the all-in-C
coder makes the same choices per plane, with zstd settings python-zstandard
cannot set (other, equally valid frames). Either way a checkpoint written by
an install built without a compiler reads anywhere, and the other way round.
"""

from __future__ import annotations

import os
import struct
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import zstandard
from conftest import assert_bit_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel.codecs import bytegroup, zstd
from dcp_multilevel.codecs.bytegroup import ByteGroupCodec

native = bytegroup._native
needs_native = pytest.mark.skipif(native is None, reason="built without the C kernels")


def test_the_c_kernels_are_built_and_found_libzstd():
    # CI builds them (setup.py) on a system with libzstd; an install without
    # a compiler or libzstd falls back silently, so make that visible where
    # it must not happen.
    if os.environ.get("DCP_ML_ALLOW_NO_NATIVE") == "1":
        pytest.skip("DCP_ML_ALLOW_NO_NATIVE=1")
    assert bytegroup.NATIVE, "dcp_multilevel.codecs._planes did not build (no C compiler?)"
    assert bytegroup.NATIVE_ZSTD, "_planes.c found no libzstd.so.1 to dlopen"
    assert native.ZSTD_VERSION >= 10400


@pytest.mark.skipif(not bytegroup.NATIVE_ZSTD, reason="no libzstd found")
def test_c_plane_settings_are_the_python_ones():
    # _planes.c repeats zstd._PLANE_PARAMS with zstd's parameter numbers: a
    # change to one must reach the other, or the two paths code differently.
    names = {
        101: "window_log",
        102: "hash_log",
        103: "chain_log",
        104: "search_log",
        105: "min_match",
        106: "target_length",
        107: "strategy",
        200: "write_content_size",
        201: "write_checksum",
    }
    c_params = {names[key]: value for key, value in native.PLANE_PARAMS}
    assert c_params == {name: getattr(zstd._PLANE_PARAMS, name) for name in names.values()}


@pytest.fixture
def numpy_only(monkeypatch):
    """Run the bytegroup codec on its numpy fallback, as a build without a compiler does."""
    monkeypatch.setattr(bytegroup, "_native", None)
    monkeypatch.setattr(bytegroup, "_native_zstd", False)


def _methods(payload: bytes) -> list[int]:
    """The per-plane methods (0 raw, 1 zstd, 2/3 split, 4 sparse) of a bytegroup payload."""
    return [payload[1 + 5 * p] for p in range(payload[0])]


def _encode(data: np.ndarray, width: int, rotate: int) -> bytes | None:
    codec = ByteGroupCodec()
    out = np.empty(codec.payload_bound(data.nbytes, width), np.uint8)
    n = codec.encode_into(
        memoryview(data.reshape(-1).view(np.uint8)), width, rotate, memoryview(out)
    )
    return None if n is None else out[:n].tobytes()


def _decode(payload: bytes, nbytes: int, width: int, rotate: int) -> bytes:
    out = bytearray(nbytes)
    ByteGroupCodec().decode(memoryview(payload), memoryview(out), width, rotate)
    return bytes(out)


def _values(kind: str, n: int, dtype: torch.dtype, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    if kind == "weights":
        t = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    elif kind == "positive":  # like Adam's exp_avg_sq: the sign never changes
        t = (torch.randn(n, generator=gen) * 0.02).abs().to(dtype)
    elif kind == "bf16-valued":  # low mantissa bits all zero: zstd beats a split
        t = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16).to(dtype)
    elif kind == "xor":  # an XOR delta of nearby weights: planes of mostly zeros
        a = torch.randn(n, generator=gen) * 0.02
        b = a + a.abs() * 1e-6 * torch.randn(n, generator=gen)
        a, b = a.to(dtype), b.to(dtype)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        return (a.view(bits) ^ b.view(bits)).view(torch.uint8).numpy()
    elif kind == "ones":
        t = torch.ones(n, dtype=dtype)
    elif kind == "arange":
        t = torch.arange(n).to(dtype)
    else:  # random bytes
        t = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        return t.numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int16,
    torch.int32,
    torch.int64,
]


@needs_native
@pytest.mark.parametrize("path", ["split-in-C", "all-in-C"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind", ["weights", "positive", "bf16-valued", "xor", "ones", "arange", "random"]
)
@pytest.mark.parametrize("n", [1, 5, 4099, 70_000])  # 70k values: sampled in slices
def test_native_and_numpy_code_the_same_bytes_and_read_each_other(
    path, dtype, kind, n, monkeypatch
):
    if path == "all-in-C" and not bytegroup.NATIVE_ZSTD:
        pytest.skip("no libzstd found")
    monkeypatch.setattr(bytegroup, "_native_zstd", path == "all-in-C")
    width, rotate = ByteGroupCodec().layout(dtype)
    data = _values(kind, n, dtype, seed=n)
    fast = _encode(data, width, rotate)
    monkeypatch.setattr(bytegroup, "_native", None)
    slow = _encode(data, width, rotate)
    what = f"{path} {dtype} {kind} n={n}"
    if path == "split-in-C":
        assert fast == slow, f"{what}: the C kernels coded other bytes than numpy"
    else:  # the C coder's zstd settings (_planes.c PLANE_FAST) write other, valid frames
        assert (fast is None) == (slow is None), what
        if fast is not None:
            assert _methods(fast) == _methods(slow), what
    if kind == "random" and n > 1000:
        assert fast is None  # near-random planes are rejected, not stored coded
    if kind == "xor" and dtype == torch.float32 and n > 1000:
        assert 4 in _methods(fast), f"{what}: no plane of the XOR delta was stored sparse"
    if fast is None:
        return
    assert _decode(fast, data.nbytes, width, rotate) == data.tobytes()  # numpy reads C
    monkeypatch.setattr(bytegroup, "_native", native)
    assert _decode(slow, data.nbytes, width, rotate) == data.tobytes()  # C reads numpy


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    data=st.data(),
    n=st.integers(0, 3000),
)
def test_split_and_join_match_numpy_for_every_rotation(width, data, n):
    rotate = data.draw(st.integers(0, 8 * width - 1)) if width > 1 else 0
    raw = np.frombuffer(data.draw(st.binary(min_size=n * width, max_size=n * width)), np.uint8)
    planes = np.empty((width, n), np.uint8)
    assert native.split(raw, planes, width, rotate) == sum(1 << 4 * p for p in range(width))
    if width > 1:
        want = bytegroup.planes_np(raw, width, rotate, "test_planes")
        assert planes.tobytes() == want.tobytes()
    back = np.empty(n * width, np.uint8)
    native.join(list(planes), back, width, rotate)
    assert back.tobytes() == raw.tobytes()
    # xor: the values XORed onto what the destination holds (a delta decoded
    # onto its reference), in C and numpy alike.
    held = np.frombuffer(data.draw(st.binary(min_size=n * width, max_size=n * width)), np.uint8)
    want = (held ^ raw).tobytes()
    for join in (native.join, bytegroup.join_np):
        onto = held.copy()
        join(list(planes), onto, width, rotate, True)
        assert onto.tobytes() == want


@needs_native
def test_split_judges_planes_like_numpy_and_skips_the_split_when_none_pays(monkeypatch):
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal(300_000) * 0.02).astype(np.float32).view(np.uint8)
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    positive = np.abs(weights.view(np.float32)).view(np.uint8)
    bf16_valued = weights.copy()
    bf16_valued.view(np.uint32)[:] &= 0xFFFF0000
    for values in (weights, positive, bf16_valued, noise):
        planes, methods = bytegroup._split_judged(values, 4, 3, "test_judged")
        monkeypatch.setattr(bytegroup, "_native", None)
        planes_np, methods_np = bytegroup._split_judged(values, 4, 3, "test_judged_np")
        monkeypatch.setattr(bytegroup, "_native", native)
        assert methods == methods_np
        if any(methods):
            assert planes.tobytes() == planes_np.tobytes()
    # Plane 3 (exponent) goes to zstd, the low mantissa bytes stay raw, and
    # plane 0 (five mantissa bits over sign and top exponent bits) is split:
    # its low 2 bits where the sign is random, its low 3 where it never changes.
    assert bytegroup._split_judged(weights, 4, 3, "t")[1] == [2, 0, 0, 1]
    assert bytegroup._split_judged(positive, 4, 3, "t")[1] == [3, 0, 0, 1]
    # Values with zero low mantissa bits: plane 0 is all structure, zstd wins.
    assert bytegroup._split_judged(bf16_valued, 4, 3, "t")[1][0] == 1
    # Noise: nothing pays, and the planes are left as they were.
    dst = np.full(len(noise), 7, np.uint8)
    assert native.split(noise, dst, 4, 3, 16 << 10, 1 / 128) == 0
    assert (dst == 7).all()


@needs_native
def test_kernels_reject_bad_arguments_with_what_is_wrong():
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="width must be 1, 2, 4 or 8, not 3"):
        native.split(buf, buf.copy(), 3, 0)
    with pytest.raises(ValueError, match=r"rotate must be in \[0, 16\), not 16"):
        native.split(buf, buf.copy(), 2, 16)
    with pytest.raises(ValueError, match="63 bytes are not whole 4-byte values"):
        native.split(buf[:63], buf.copy(), 4, 0)
    with pytest.raises(ValueError, match="plane buffer of 32 bytes, need 64"):
        native.split(buf, np.zeros(32, np.uint8), 4, 0)
    with pytest.raises(ValueError, match="sample must be 0 or at least 8 values"):
        native.split(buf, buf.copy(), 4, 0, 3)
    with pytest.raises(ValueError, match="need a sequence of 4 planes"):
        native.join([buf[:16]] * 3, buf.copy(), 4, 0)
    with pytest.raises(ValueError, match="plane 2 has 15 bytes, expected 16"):
        native.join([buf[:16], buf[:16], buf[:15], buf[:16]], buf.copy(), 4, 0)
    with pytest.raises(TypeError):
        native.split(buf, bytes(64), 4, 0)  # read-only output
    with pytest.raises(ValueError, match="split method must be 2 or 3, not 1"):
        native.split_plane(buf, buf.copy(), buf.copy(), 1)
    with pytest.raises(ValueError, match="a split of 64 bytes has 48 high and 16 low bytes"):
        native.join_plane(buf[:48], buf[:15], buf.copy(), 2)
    if native.HAS_ZSTD:
        big = np.zeros(1 << 16, np.uint8)
        with pytest.raises(ValueError, match="too small for 65536 bytes"):
            native.encode(big, np.zeros(1 << 16, np.uint8), big.copy(), 4, 3, 1 << 14, 0.01, 0.01)
        with pytest.raises(ValueError, match=r"not whole values of 2, 4 or 8 bytes \(1\)"):
            native.encode(buf, np.zeros(4096, np.uint8), buf.copy(), 1, 0, 1 << 14, 0.01, 0.01)


@pytest.mark.skipif(not bytegroup.NATIVE_ZSTD, reason="no libzstd found")
def test_one_call_codes_a_float_chunk_that_zstd_reads():
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(1 << 18) * 0.02).astype(np.float32).view(np.uint8)
    codec = ByteGroupCodec()
    out = np.empty(codec.payload_bound(values.nbytes, 4), np.uint8)
    n_values = values.nbytes // 4
    planes = np.empty(values.nbytes + n_values + n_values // 8 + 16, np.uint8)
    n = native.encode(values, out, planes, 4, 3, 1 << 14, 1 / 128, 1 / 64)
    assert n is not None and n < 0.9 * values.nbytes
    assert _methods(out[:n].tobytes()) == [2, 0, 0, 1]  # exponent-bearing planes coded
    assert _decode(out[:n].tobytes(), values.nbytes, 4, 3) == values.tobytes()
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    out = np.empty(codec.payload_bound(noise.nbytes, 4), np.uint8)
    assert (
        native.encode(noise, out, np.empty(2 * noise.nbytes, np.uint8), 4, 3, 1 << 14, 0.01, 0.01)
        is None
    )


@needs_native
@settings(max_examples=80, deadline=None)
@given(method=st.sampled_from([2, 3]), plane=st.binary(max_size=200))
def test_split_planes_match_numpy_and_join_back(method, plane):
    # Sizes 0..200 cover every tail: a segment count that is not a multiple
    # of 4 or 8 leaves some segments one slot short.
    data = np.frombuffer(plane, np.uint8)
    high_len, low_len = bytegroup.split_sizes(len(data), method)
    high, low = np.empty(high_len, np.uint8), np.empty(low_len, np.uint8)
    native.split_plane(data, high, low, method)
    want_high, want_low = (a.copy() for a in _numpy_split(data, method))
    assert high.tobytes() == want_high.tobytes() and low.tobytes() == want_low.tobytes()
    back = np.empty(len(data), np.uint8)
    native.join_plane(high, low, back, method)
    assert back.tobytes() == plane
    back_np = np.empty(len(data), np.uint8)
    with _numpy_kernels():
        bytegroup._join_plane(high, low, back_np, method)
    assert back_np.tobytes() == plane


@contextmanager
def _numpy_kernels():
    """The bytegroup codec on its numpy fallback inside the block (hypothesis
    examples cannot take the function-scoped ``numpy_only`` fixture)."""
    saved = bytegroup._native
    bytegroup._native = None
    try:
        yield
    finally:
        bytegroup._native = saved


def _numpy_split(data: np.ndarray, method: int) -> tuple[np.ndarray, np.ndarray]:
    with _numpy_kernels():
        return bytegroup._split_plane(data, method)


def test_split_keeps_the_low_bits_apart_from_the_raw_high_bits():
    # Plane bytes 0b111111_01 (high 6 bits all set, low 2 bits 01): the raw
    # part is all ones, the low stream repeats 01 four to a byte.
    plane = np.full(8, 0b11111101, np.uint8)
    high, low = _numpy_split(plane, 2)
    assert high.tobytes() == b"\xff" * 6 and low.tobytes() == bytes([0b01010101]) * 2
    plane = np.full(8, 0b00000110, np.uint8)  # low 3 bits 110, high 5 bits 0
    high, low = _numpy_split(plane, 3)
    assert high.tobytes() == b"\0" * 5 and low.tobytes() == bytes([0x66]) * 4
    assert bytegroup.split_sizes(9, 2) == (9, 3) and bytegroup.split_sizes(9, 3) == (10, 8)


def test_codec_round_trips_on_the_numpy_fallback(numpy_only):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = (
            (torch.randn(70_000) * 0.02).to(dtype)
            if dtype.is_floating_point
            else torch.arange(70_000)
        )
        width, rotate = ByteGroupCodec().layout(dtype)
        data = t.view(torch.uint8).numpy()
        coded = _encode(data, width, rotate)
        assert coded is not None and len(coded) < data.nbytes
        back = torch.frombuffer(bytearray(_decode(coded, data.nbytes, width, rotate)), dtype=dtype)
        assert_bit_equal(back, t, str(dtype))


def _payload(planes: list[tuple[int, bytes]]) -> bytes:
    """A bytegroup payload from ``(method, bytes)`` per plane."""
    table = b"".join(struct.pack("<BI", method, len(data)) for method, data in planes)
    return bytes([len(planes)]) + table + b"".join(data for _, data in planes)


def test_hostile_plane_frames_are_clear_errors():
    # Decoding stays on python-zstandard whatever the coding path: a plane's
    # frame is checked before anything is written.
    n = 4096
    plane = bytes(range(256)) * (n // 256)
    frame = zstandard.ZstdCompressor().compress(plane)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * n))
    raw = (0, plane)
    cases = [
        ([raw, (1, bomb)], r"zstd frame declares 262144 bytes, expected 4096"),
        ([raw, (1, b"\x28\xb5\x2f\xfd" + b"junk" * 8)], "zstd frame is corrupt"),
        ([raw, (1, b"not a zstd frame at all")], "zstd frame is corrupt"),
        ([raw, (1, frame[:-6])], "zstd frame ends after"),
        ([raw, (1, zstandard.ZstdCompressor().compress(plane[:-1]))], "4095"),
    ]
    high, low = _numpy_split(np.frombuffer(plane, np.uint8), 2)
    low_frame = zstandard.ZstdCompressor().compress(low.tobytes())
    cases += [
        ([raw, (2, high.tobytes()[:-1])], "split plane 1 has 3071 bytes, under its 3072 raw"),
        ([raw, (2, high.tobytes() + low_frame[:-4])], "zstd frame ends after"),
        # Method 3 keeps 2560 raw bytes of 4096 and a 2048-byte low stream.
        ([raw, (3, bytes(2560) + low_frame)], "zstd frame declares 1024 bytes, expected 2048"),
        ([raw, (5, plane)], "plane 1 has unknown method 5"),
    ]
    for planes, message in cases:
        with pytest.raises(ValueError, match=message):
            ByteGroupCodec().decode(
                memoryview(_payload(planes)), memoryview(bytearray(2 * n)), 2, 0
            )
    # And a well-formed payload decodes, raw, zstd and split planes mixed.
    out = bytearray(2 * n)
    ByteGroupCodec().decode(memoryview(_payload([raw, (1, frame)])), memoryview(out), 2, 0)
    assert out[0::2] == plane and out[1::2] == plane
    split = (2, high.tobytes() + low_frame)
    ByteGroupCodec().decode(memoryview(_payload([split, raw])), memoryview(out), 2, 0)
    assert out[0::2] == plane and out[1::2] == plane


# ------------------------------------------------------------- sparse planes


def _plane_with_zeros(data, n: int, zeros: float) -> np.ndarray:
    """``n`` random bytes, each 0 with probability ``zeros`` (hypothesis draws)."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    plane = rng.integers(1, 256, n, dtype=np.uint8)
    plane[rng.random(n) < zeros] = 0
    return plane


@needs_native
@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(0, 300), zeros=st.sampled_from([0, 0.3, 0.9, 0.99, 1]))
def test_sparse_planes_match_numpy_and_join_back(data, n, zeros):
    # Every tail length (n % 8) and density: the bitmap's last byte is short.
    plane = _plane_with_zeros(data, n, zeros)
    blen = bytegroup.bitmap_len(n)
    bitmap, values = np.empty(blen, np.uint8), np.empty(n, np.uint8)
    count = native.sparse_plane(plane, bitmap, values)
    want_bitmap, want_values = np.empty(blen, np.uint8), np.empty(n, np.uint8)
    assert bytegroup.sparse_plane_np(plane, want_bitmap, want_values) == count
    assert bitmap.tobytes() == want_bitmap.tobytes()
    assert values[:count].tobytes() == want_values[:count].tobytes() == plane[plane != 0].tobytes()
    assert native.sparse_count(bitmap, n) == bytegroup.sparse_count_np(bitmap, n) == count
    back, back_np = np.full(n, 7, np.uint8), np.full(n, 7, np.uint8)
    native.join_sparse(bitmap, values[:count], back)
    bytegroup.join_sparse_np(bitmap, values[:count], back_np)
    assert back.tobytes() == back_np.tobytes() == plane.tobytes()


@pytest.mark.parametrize("kernels", ["C", "numpy"])
def test_sparse_kernels_refuse_a_bitmap_that_disagrees_with_the_values(kernels, monkeypatch):
    if kernels == "C" and native is None:
        pytest.skip("built without the C kernels")
    k = native if kernels == "C" else None
    count = k.sparse_count if k else bytegroup.sparse_count_np
    join = k.join_sparse if k else bytegroup.join_sparse_np
    bitmap = np.array([0b101, 0b1], np.uint8)  # 3 bytes of a 9-byte plane
    plane = np.empty(9, np.uint8)
    with pytest.raises(
        ValueError, match=r"^sparse plane bitmap marks 3 non-zero bytes, its values are 2$"
    ):
        join(bitmap, np.ones(2, np.uint8), plane)
    with pytest.raises(
        ValueError, match=r"^sparse plane bitmap marks 3 non-zero bytes, its values are 4$"
    ):
        join(bitmap, np.ones(4, np.uint8), plane)
    with pytest.raises(ValueError, match=r"^sparse plane bitmap marks bytes past the plane's 9$"):
        count(np.array([0, 0b10], np.uint8), 9)
    with pytest.raises(ValueError, match=r"^a sparse plane of 9 bytes has a 2-byte bitmap, not 1$"):
        count(bitmap[:1], 9)
    join(bitmap, np.array([5, 6, 7], np.uint8), plane)
    assert plane.tolist() == [5, 0, 6, 0, 0, 0, 0, 0, 7]


def _sparse_payload(bitmap_part: bytes, values_part: bytes, stored: int | None = None) -> bytes:
    """A sparse plane: u32 stored bitmap length, the bitmap, the values."""
    head = struct.pack("<I", len(bitmap_part) if stored is None else stored)
    return head + bitmap_part + values_part


@pytest.mark.parametrize("kernels", ["C", "numpy"])
def test_corrupt_sparse_planes_are_clear_errors(kernels, monkeypatch):
    if kernels == "C" and native is None:
        pytest.skip("built without the C kernels")
    if kernels == "numpy":
        monkeypatch.setattr(bytegroup, "_native", None)
    n = 4096  # planes of 4096 bytes: 512-byte bitmaps
    plane = np.zeros(n, np.uint8)
    plane[::16] = np.arange(256) % 3 + 1  # 256 non-zero bytes, compressible
    bitmap = np.packbits(plane != 0, bitorder="little").tobytes()
    values = plane[plane != 0].tobytes()
    zc = zstandard.ZstdCompressor()
    bitmap_frame, values_frame = zc.compress(bitmap), zc.compress(values)
    raw = (0, bytes(n))
    cases = [
        (b"\1\0", "sparse plane 1 has 2 bytes, under its 4-byte header"),
        (_sparse_payload(bitmap, values, stored=513), "stores a 513-byte bitmap: over its 512"),
        (_sparse_payload(bitmap[:100], b""), "zstd frame is corrupt"),
        (_sparse_payload(bitmap_frame[:-3], values), "zstd frame ends after"),
        # The bitmap marks 256 bytes: 255 or 257 raw values, or a frame of 255.
        (_sparse_payload(bitmap, values[:-1]), "zstd frame is corrupt"),
        (_sparse_payload(bitmap, values + b"x"), "stores 257 bytes of values for 256 non-zero"),
        (_sparse_payload(bitmap, zc.compress(values[:-1])), "declares 255 bytes, expected 256"),
        (_sparse_payload(bitmap, values_frame[:-2]), "zstd frame ends after"),
        # A bitmap that marks one byte more, or one fewer, than the values hold.
        (_sparse_payload(zc.compress(bitmap[:-1] + b"\3"), values), "zstd frame is corrupt"),
        (_sparse_payload(bitmap[:-2] + bytes(2), values), "stores 256 bytes of values for 255"),
    ]
    for part, message in cases:
        with pytest.raises(ValueError, match=message):
            ByteGroupCodec().decode(
                memoryview(_payload([raw, (4, part)])), memoryview(bytearray(2 * n)), 2, 0
            )
    # The well-formed ones decode: raw or coded bitmap and values.
    for bitmap_part in (bitmap, bitmap_frame):
        for values_part in (values, values_frame):
            out = bytearray(2 * n)
            payload = _payload([raw, (4, _sparse_payload(bitmap_part, values_part))])
            ByteGroupCodec().decode(memoryview(payload), memoryview(out), 2, 0)
            assert out[1::2] == plane.tobytes() and out[0::2] == bytes(n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("kernels", ["all-in-C", "split-in-C", "numpy"])
def test_the_judge_never_stores_random_floats_sparse(dtype, scale, kernels, monkeypatch):
    if kernels != "numpy" and native is None:
        pytest.skip("built without the C kernels")
    if kernels == "all-in-C" and not bytegroup.NATIVE_ZSTD:
        pytest.skip("no libzstd found")
    monkeypatch.setattr(bytegroup, "_native_zstd", kernels == "all-in-C")
    if kernels == "numpy":
        monkeypatch.setattr(bytegroup, "_native", None)
    width, rotate = ByteGroupCodec().layout(dtype)
    for seed, n in enumerate((5000, 300_000)):  # judged whole, and on slices
        gen = torch.Generator().manual_seed(seed)
        t = (torch.randn(n, generator=gen) * scale).to(dtype)
        payload = _encode(t.view(torch.uint8).numpy(), width, rotate)
        assert payload is None or 4 not in _methods(payload), f"{dtype} x{scale} n={n}"

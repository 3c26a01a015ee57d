"""Codecs: round trips (Hypothesis), corruption, hostile frames, DCP integration."""

from __future__ import annotations

import io
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
import zstandard
from conftest import ALL_DTYPES, assert_bit_equal, random_tensor, rank_errors
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import (
    Compression,
    ConfigError,
    CorruptCheckpointError,
    MultiLevelReader,
    MultiLevelWriter,
)
from dcp_multilevel.codecs import (
    CODECS,
    bytegroup,
    decode_frames,
    encode_frames,
)
from dcp_multilevel.codecs.bytegroup import ByteGroupCodec
from dcp_multilevel.codecs.extension import (
    ByteGroupExtension,
    ZstdExtension,
    extension_registry,
)
from dcp_multilevel.codecs.zstd import ZstdCodec
from dcp_multilevel.format import frames
from dcp_multilevel.format.tensor_bytes import byte_view

CODEC_CLASSES = [ByteGroupCodec, ZstdCodec]


def _encode(t: torch.Tensor, codec, chunk_size: int, pool=None) -> bytes:
    width, rotate = codec.layout(t.dtype)
    parts = encode_frames(
        byte_view(t), codec, width=width, rotate=rotate, chunk_size=chunk_size, pool=pool, window=4
    )
    return b"".join(bytes(p) for p in parts)


class _Error(Exception):
    pass


def _decode(blob: bytes, like: torch.Tensor, codec, pool=None) -> torch.Tensor:
    out = torch.empty_like(like)
    view, pos = memoryview(blob), 0

    def read(n):
        nonlocal pos
        pos += n
        return view[pos - n : pos]

    decode_frames(
        read,
        byte_view(out),
        codec,
        stored_length=len(blob),
        pool=pool,
        window=4,
        on_chunk_error=lambda i, why: _Error(f"chunk {i}: {why}"),
    )
    assert pos == len(blob)
    return out


def _structured(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Weight-like values: small normals (compressible exponents)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
    return base.to(dtype) if dtype.is_floating_point or dtype.is_complex else base.long().to(dtype)


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    n=st.integers(0, 3000),
    chunk_elems=st.integers(1, 700),
    structured=st.booleans(),
    codec_cls=st.sampled_from(CODEC_CLASSES),
    threaded=st.booleans(),
    seed=st.integers(0, 2**16),
    kernels=st.sampled_from(["all-in-C", "split-in-C", "numpy"]),
)
def test_round_trip_any_dtype_size_and_chunk_boundary(
    dtype, n, chunk_elems, structured, codec_cls, threaded, seed, kernels
):
    t = (
        _structured(n, dtype, seed)
        if structured and dtype != torch.bool
        else random_tensor((n,), dtype, seed)
    )
    codec = codec_cls(1)
    chunk_size = chunk_elems * dtype.itemsize
    pool = ThreadPoolExecutor(2) if threaded else None
    saved = bytegroup._native, bytegroup._native_zstd
    # bytegroup's three ways to code (see test_codec_native.py); set here, not
    # with monkeypatch, which hypothesis cannot reset between examples.
    bytegroup._native_zstd = kernels == "all-in-C" and bytegroup.NATIVE_ZSTD
    if kernels == "numpy":
        bytegroup._native = None
    try:
        blob = _encode(t, codec, chunk_size, pool)
        assert_bit_equal(_decode(blob, t, codec, pool), t, str(dtype))
    finally:
        bytegroup._native, bytegroup._native_zstd = saved
        if pool:
            pool.shutdown()


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    n=st.integers(0, 6000),
    zeros=st.sampled_from([0.0, 0.5, 0.8, 0.95, 0.999, 1.0]),
    seed=st.integers(0, 2**16),
    kernels=st.sampled_from(["all-in-C", "split-in-C", "numpy"]),
)
def test_round_trip_of_planes_of_every_zero_fraction(dtype, n, zeros, seed, kernels):
    # Like XOR deltas: each byte 0 with probability `zeros`, so planes take
    # every method, sparse (bytegroup/4) among them, one chunk each.
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    raw[torch.rand(raw.shape, generator=g) < zeros] = 0
    t = raw.view(dtype)
    codec = ByteGroupCodec()
    saved = bytegroup._native, bytegroup._native_zstd
    bytegroup._native_zstd = kernels == "all-in-C" and bytegroup.NATIVE_ZSTD
    if kernels == "numpy":
        bytegroup._native = None
    try:
        blob = _encode(t, codec, 1 << 20)
        assert_bit_equal(_decode(blob, t, codec), t, f"{dtype} zeros={zeros}")
    finally:
        bytegroup._native, bytegroup._native_zstd = saved


def test_random_bytes_cost_almost_nothing_and_structured_floats_shrink():
    noise = random_tensor((1 << 20,), torch.float32, 1)
    blob = _encode(noise, ByteGroupCodec(1), 1 << 20)
    assert len(blob) <= noise.nbytes * 1.001  # stored raw, only framing overhead
    weights = _structured(1 << 20, torch.float32, 2)
    assert len(_encode(weights, ByteGroupCodec(1), 1 << 20)) < 0.9 * weights.nbytes
    bf16 = _structured(1 << 20, torch.bfloat16, 3)
    grouped = len(_encode(bf16, ByteGroupCodec(1), 1 << 20))
    plain = len(_encode(bf16, ZstdCodec(1), 1 << 20))
    assert grouped < 0.92 * plain  # byte grouping beats plain zstd on floats


@pytest.mark.parametrize("codec_cls", CODEC_CLASSES)
def test_one_corrupt_byte_names_the_chunk(codec_cls):
    t = _structured(40_000, torch.float32, 4)
    blob = bytearray(_encode(t, codec_cls(1), 40_000))  # four chunks
    # Find chunk 2's payload and flip a byte in it.
    pos = frames.HEADER.size
    for _ in range(2):
        rec = frames.unpack_chunk(blob[pos : pos + frames.CHUNK.size])
        pos += frames.CHUNK.size + rec.stored_len
    blob[pos + frames.CHUNK.size + 5] ^= 0x40
    with pytest.raises(_Error) as info:
        _decode(bytes(blob), t, codec_cls(1))
    assert str(info.value) == "chunk 2: its checksum does not match its bytes"


def _frame_with(payload: bytes, raw_len: int, method=frames.METHOD_CODED, total=1000) -> bytes:
    return b"".join(
        [
            frames.pack_header(1, False, 1 << 20, total),
            frames.pack_chunk(method, raw_len, len(payload), xxhash.xxh3_64_intdigest(payload)),
            payload,
            frames.pack_chunk(0, 0, 0, 0),
        ]
    )


def test_decompression_bomb_is_refused_before_allocating():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (50 << 20))  # declares 50 MiB
    like = torch.empty(1000, dtype=torch.uint8)
    with pytest.raises(_Error) as info:
        _decode(_frame_with(bomb, 1000), like, ZstdCodec())
    assert str(info.value) == "chunk 0: zstd frame declares 52428800 bytes, expected 1000"


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"XXXX" + bytes(16), "^chunk -1: bad frame magic b'XXXX'"),
        (
            frames.pack_header(1, False, 1 << 20, 5),
            "^chunk -1: frame holds 5 bytes, expected 1000$",
        ),
        (_frame_with(b"abc", 999, method=0), "^chunk 0: claims 999 raw bytes, expected 1000"),
        (_frame_with(b"\x28\xb5\x2f\xfd" + b"junk", 1000), "^chunk 0: zstd frame is corrupt"),
        (_frame_with(b"x" * 1000, 1000, method=7), "^chunk 0: unknown method 7$"),
    ],
)
def test_hostile_frames_are_clear_errors(blob, message):
    with pytest.raises(_Error, match=message):
        _decode(blob, torch.empty(1000, dtype=torch.uint8), ZstdCodec())


def test_truncated_frame_is_an_error():
    t = _structured(10_000, torch.float32, 5)
    blob = _encode(t, ByteGroupCodec(), 1 << 20)
    with pytest.raises(_Error) as info:
        _decode(blob[:-30], t, ByteGroupCodec())
    assert str(info.value) == f"chunk -2: frames run past the item's {len(blob) - 30} stored bytes"


def test_builtin_codecs_come_from_the_entry_point_group():
    assert CODECS.get("dcp_multilevel.bytegroup") is ByteGroupCodec
    assert CODECS.get("dcp_multilevel.zstd") is ZstdCodec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": 99}, "Compression.level must be an integer in -7..22, got 99"),
        ({"chunk_size": 1000}, "Compression.chunk_size must be 1 MiB..64 MiB, got 1000"),
        ({"threads": 0}, "Compression.threads must be an integer >= 1, got 0"),
    ],
)
def test_compression_options_are_validated(kwargs, message):
    with pytest.raises(ConfigError) as info:
        Compression(**kwargs)
    assert str(info.value) == message


def test_unknown_codec_is_refused_when_the_writer_is_built(tmp_path):
    with pytest.raises(LookupError) as info:
        MultiLevelWriter(tmp_path, codec="lz77")
    assert str(info.value).startswith("unknown codec 'lz77' (known: dcp_multilevel.bytegroup, ")


# ----------------------------------------------------------------- through DCP


def _state():
    return {
        "w": _structured(300_000, torch.float32, 6).reshape(600, 500),
        "h": _structured(70_000, torch.bfloat16, 7),
        "ids": torch.arange(5000),
        "empty": torch.empty(0, 3),
        "note": {"step": 3},
    }


def _zeros(state):
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0}
        for k, v in state.items()
    }


@pytest.mark.parametrize("codec", ["bytegroup", "zstd", Compression(threads=1)])
def test_dcp_round_trip_with_compression_is_smaller_and_exact(tmp_path, codec):
    state = _state()
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c", codec=codec))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    stored = sum(i["length"] for i in manifest["items"])
    raw = sum(i["raw_length"] for i in manifest["items"])
    assert stored < 0.9 * raw
    for threads in (1, 2):
        loaded = _zeros(state)
        dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads))
        for k in ("w", "h", "ids", "empty"):
            assert_bit_equal(loaded[k], state[k], k)
        assert loaded["note"] == {"step": 3}


def test_corrupt_compressed_checkpoint_names_item_and_chunk(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c", codec="bytegroup"))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    item = next(i for i in manifest["items"] if i["fqn"] == "w")
    path = tmp_path / "c" / item["file"]
    raw = bytearray(path.read_bytes())
    raw[item["pos"] + frames.HEADER.size + frames.CHUNK.size + 3] ^= 1
    path.write_bytes(raw)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_zeros(state), storage_reader=MultiLevelReader(tmp_path / "c"))
    (err,) = rank_errors(info.value)
    assert isinstance(err, CorruptCheckpointError)
    assert str(err) == (
        f"compressed item 'w' in {item['file']!r} of checkpoint file://{tmp_path}/c is "
        "corrupt: chunk 0: its checksum does not match its bytes. Load from another copy."
    )


@pytest.mark.parametrize("ext", [ByteGroupExtension, ZstdExtension])
def test_codecs_work_as_dcp_stream_extensions_with_stock_filesystem_writer(tmp_path, ext):
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "c", _extensions=[ext()]))
    loaded = _zeros(state)
    reader = FileSystemReader(tmp_path / "c", _extension_registry=extension_registry())
    dcp.load(loaded, storage_reader=reader)
    for k in ("w", "h", "ids"):
        assert_bit_equal(loaded[k], state[k], k)


def test_stream_extension_round_trip_across_chunk_boundaries():
    data = bytes(range(256)) * 40_000  # ~10 MiB: three stream chunks
    sink = io.BytesIO()
    w = ByteGroupExtension().transform_to(sink)
    for start in range(0, len(data), 999_999):
        w.write(data[start : start + 999_999])
    w.close()
    sink.seek(0)
    assert ByteGroupExtension().transform_from(sink).read() == data
    assert struct.unpack_from("<4s", sink.getvalue())[0] == b"DMLF"

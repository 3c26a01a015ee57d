"""bytegroup's rotation and sampling, frame version 2 and the cross-item coding window."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from conftest import assert_bit_equal, random_tensor, rank_errors
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codecs import _decode, _encode, _structured
from torch.distributed.checkpoint.api import CheckpointException

from dcp_multilevel import Compression, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.codecs import (
    CODECS,
    MIN_SPLIT_CHUNK,
    BufferPool,
    EncodeJob,
    balanced_chunk_size,
    codec_from_descriptor,
    compress_tensor,
    decompress_tensor,
    element_layout,
    encode_items,
    zstd,
)
from dcp_multilevel.codecs.bytegroup import ByteGroupCodec
from dcp_multilevel.codecs.extension import ByteGroupExtension
from dcp_multilevel.errors import RegistryError
from dcp_multilevel.format import frames
from dcp_multilevel.format.tensor_bytes import byte_view

# ----------------------------------------------------------------- format


def test_frame_headers_keep_version_1_unless_rotating_more_than_one_bit():
    assert frames.pack_header(4, 1, 1 << 20, 8)[4:7] == bytes([1, 4, 1])
    assert frames.pack_header(2, 0, 1 << 20, 8)[4:7] == bytes([1, 2, 0])
    assert frames.pack_header(2, 3, 1 << 20, 8)[4:7] == bytes([2, 2, 3])
    for width, rotate in [(4, 1), (2, 0), (2, 3), (8, 63)]:
        header = frames.unpack_header(frames.pack_header(width, rotate, 1 << 20, 8))
        assert (header.width, header.rotate) == (width, rotate)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (frames.HEADER.pack(b"DMLF", 2, 2, 16, 1 << 20, 8), "bad rotation 16 for width 2"),
        (frames.HEADER.pack(b"DMLF", 2, 4, 1, 1 << 20, 8), "bad rotation 1 for width 4"),
        (frames.HEADER.pack(b"DMLF", 1, 4, 2, 1 << 20, 8), "bad frame flags 0x2"),
        (
            frames.HEADER.pack(b"DMLF", 3, 4, 0, 1 << 20, 8),
            "frame version 3 is not supported (this release reads 1, 2)",
        ),
    ],
)
def test_hostile_frame_headers_are_refused(header, message):
    with pytest.raises(frames.FrameError) as info:
        frames.unpack_header(header)
    assert str(info.value) == message


def test_bytegroup_reads_version_4():
    assert ByteGroupCodec().descriptor == "dcp_multilevel.bytegroup/4"
    assert isinstance(codec_from_descriptor("dcp_multilevel.bytegroup/4"), ByteGroupCodec)


@pytest.mark.parametrize("version", ["1", "2", "3", "5"])
def test_bytegroup_refuses_every_other_version(version):
    with pytest.raises(RegistryError) as info:
        codec_from_descriptor(f"dcp_multilevel.bytegroup/{version}")
    remedy = (
        "install a dcp_multilevel release that reads it"
        if version == "5"
        else "an older version that this release no longer reads: load it with the release "
        "that wrote it and save it again"
    )
    assert str(info.value) == (
        f"codec 'dcp_multilevel.bytegroup' version '{version}' is not readable by the "
        f"installed codec (version 4); {remedy}"
    )
    with pytest.raises(ValueError) as info:
        ByteGroupExtension.from_descriptor(version)
    assert str(info.value) == (
        f"dcp_multilevel.bytegroup version '{version}' is not supported by this "
        f"dcp_multilevel (it reads version 4); {remedy}"
    )


@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        (torch.float32, (4, 3)),
        (torch.bfloat16, (2, 3)),
        (torch.complex64, (4, 3)),
        (torch.float16, (2, 1)),
        (torch.float64, (8, 1)),
        (torch.float8_e4m3fn, (1, 0)),
        (torch.int32, (4, 0)),
    ],
)
def test_layout_per_dtype(dtype, layout):
    assert ByteGroupCodec().layout(dtype) == layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_bit_rotation_beats_one_bit_on_weight_like_floats(dtype):
    t = _structured(1 << 19, dtype, 11)
    codec = ByteGroupCodec()
    three = _encode(t, codec, 1 << 20)
    one_bit_job = EncodeJob(None, byte_view(t), element_layout(dtype))
    (one,) = _coded([one_bit_job], None, 1, chunk_size=1 << 20)
    assert len(three) < len(one) - 0.002 * t.nbytes  # measured: 0.3 % (fp32), 0.6 % (bf16)
    assert_bit_equal(_decode(one, t, codec), t, "one-bit rotation")
    assert_bit_equal(_decode(three, t, codec), t, "three-bit rotation")


def test_random_chunk_is_rejected_from_its_sample_and_mixed_planes_are_kept():
    noise = random_tensor((1 << 18,), torch.float32, 3)  # 1 MiB: sampled
    assert ByteGroupCodec().encode(byte_view(noise), 4, 3) is None
    # Weights whose mantissa planes are random: the exponent plane still pays.
    weights = _structured(1 << 18, torch.float32, 4)
    payload = ByteGroupCodec().encode(byte_view(weights), 4, 3)
    assert payload is not None and len(payload) < 0.85 * weights.nbytes
    methods = [payload[1 + 5 * p] for p in range(4)]
    assert methods[3] == 1 and 0 in methods  # top plane coded, a mantissa plane raw


# ----------------------------------------------------------------- coding window


def _jobs(seed: int) -> list[EncodeJob]:
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(40):
        n = int(torch.randint(0, 300_000, (1,), generator=g))
        dtype = [torch.float32, torch.bfloat16, torch.int64][i % 3]
        t = _structured(n, dtype, seed + i)
        layout = None if i % 7 == 3 else ByteGroupCodec().layout(dtype)
        jobs.append(EncodeJob(i, byte_view(t), layout, f"item {i}"))
    return jobs


def _coded(jobs, pool, window, chunk_size=1 << 18, buffers=None) -> list[bytes]:
    """Each job's stored bytes; ``jobs`` is handed over as an iterator (pulled lazily)."""
    out = []
    coding = encode_items(
        iter(jobs),
        ByteGroupCodec(),
        chunk_size=chunk_size,
        pool=pool,
        window=window,
        buffers=buffers,
    )
    for job, parts in coding:
        assert job is jobs[len(out)]
        out.append(b"".join(bytes(p) for p in parts))
    return out


@pytest.mark.parametrize("window", [1, 2, 5])
def test_window_across_items_codes_exactly_as_inline(window):
    jobs = _jobs(7)
    inline = _coded(jobs, None, 1)
    with ThreadPoolExecutor(2) as pool:
        assert _coded(jobs, pool, window) == inline
    for job, blob in zip(jobs, inline, strict=True):
        if job.layout is None:
            assert blob == bytes(job.view)


class _Poisoned(ByteGroupCodec):
    """Fails on chunks that start with the float 12345.0 (counts its calls)."""

    name = "test.poisoned"
    calls = 0

    def encode_into(self, chunk, width, rotate, out):
        type(self).calls += 1
        if len(chunk) >= 4 and np.frombuffer(chunk[:4], np.float32)[0] == 12345.0:
            raise ValueError("injected coding failure")
        return super().encode_into(chunk, width, rotate, out)


def test_error_in_the_middle_surfaces_in_order_and_stops_coding():
    items = [_structured(100_000, torch.float32, i) for i in range(30)]
    items[10][0] = 12345.0
    jobs = [EncodeJob(i, byte_view(t), (4, 3), f"item {i}") for i, t in enumerate(items)]
    done = []
    _Poisoned.calls = 0
    with ThreadPoolExecutor(2) as pool:
        coding = encode_items(jobs, _Poisoned(), chunk_size=1 << 18, pool=pool, window=4)
        with pytest.raises(ValueError) as info:
            for job, parts in coding:
                b"".join(parts)
                done.append(job.key)
        coding.close()  # what the writer's closing() does: cancel what is queued
    assert str(info.value) == "injected coding failure"
    assert info.value.__notes__ == ["while coding chunk 0 of item 10"]
    assert done == list(range(10))
    assert _Poisoned.calls <= 2 * 11 + 4 + 2  # 11 items of 2 chunks, then the window at most


def test_save_with_threads_fails_cleanly_on_a_coding_error_and_saves_again(tmp_path, monkeypatch):
    monkeypatch.setitem(CODECS._registered, "test.poisoned", _Poisoned)
    state = {f"t{i:02d}": _structured(50_000, torch.float32, i) for i in range(20)}
    state["t07"][0] = 12345.0
    state["note"] = {"step": 1}
    writer = MultiLevelWriter(tmp_path / "c", codec=Compression("test.poisoned", threads=2))
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=writer)
    (err,) = rank_errors(info.value)
    assert str(err) == "injected coding failure"
    assert len(err.__notes__) == 1
    assert err.__notes__[0].startswith("while coding chunk 0 of item 't07' of data/0-0.")
    assert not (tmp_path / "c" / "manifest.json").exists()
    # No data file, not even the temporary one it was being written to.
    assert [p for p in (tmp_path / "c").rglob("*") if p.is_file()] == []

    state["t07"][0] = 1.0
    writer = MultiLevelWriter(tmp_path / "c", codec=Compression(threads=2))
    dcp.save(state, storage_writer=writer)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert {"dcp_multilevel.bytegroup/4"} == {
        t for item in manifest["items"] for t in item["transforms"]
    }
    loaded = {k: torch.zeros_like(v) for k, v in state.items() if k != "note"}
    loaded["note"] = {"step": 0}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c", thread_count=2))
    for key, value in state.items():
        if key != "note":
            assert_bit_equal(loaded[key], value, key)
    assert loaded["note"] == {"step": 1}


class _Recording(ByteGroupCodec):
    """Notes which threads coded chunks."""

    name = "test.recording"
    threads: set[int] = set()

    def encode_into(self, chunk, width, rotate, out):
        type(self).threads.add(threading.get_ident())
        return super().encode_into(chunk, width, rotate, out)


def test_the_consumer_codes_what_no_pool_thread_has_started():
    jobs = _jobs(3)
    inline = _coded(jobs, None, 1)
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(release.wait, 60)  # the only worker is busy until the coding is done
        try:
            _Recording.threads = set()
            coding = encode_items(iter(jobs), _Recording(), chunk_size=1 << 18, pool=pool, window=4)
            coded = [b"".join(bytes(p) for p in parts) for _, parts in coding]
        finally:
            release.set()
    assert coded == inline
    assert _Recording.threads == {threading.get_ident()}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_save_codes_in_as_many_threads_as_asked_the_writing_one_among_them(
    tmp_path, monkeypatch, threads
):
    monkeypatch.setitem(CODECS._registered, "test.recording", _Recording)
    _Recording.threads = set()
    state = {f"t{i:02d}": _structured(600_000, torch.float32, i) for i in range(8)}
    comp = Compression("test.recording", threads=threads)
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c", codec=comp))
    # This thread called dcp.save and wrote the file (thread_count=1).
    pool_threads = _Recording.threads - {threading.get_ident()}
    assert len(pool_threads) <= threads - 1
    assert _Recording.threads
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=MultiLevelReader(tmp_path / "c"))
    for key, value in state.items():
        assert_bit_equal(loaded[key], value, key)


def _ahead(jobs, window, chunk_size=1 << 18) -> list[int]:
    """How many jobs had been pulled from the source beyond the one being consumed, per part."""
    pulled = []

    def source():
        for job in jobs:
            pulled.append(job)
            yield job

    ahead = []
    with ThreadPoolExecutor(1) as pool:
        coding = encode_items(
            source(), ByteGroupCodec(), chunk_size=chunk_size, pool=pool, window=window
        )
        for n, (_, parts) in enumerate(coding):
            for _ in parts:
                ahead.append(len(pulled) - n - 1)
    return ahead


def _job(i: int, n: int, coded: bool = True) -> EncodeJob:
    t = _structured(n, torch.float32, i)
    return EncodeJob(i, byte_view(t), (4, 3) if coded else None, f"item {i}")


def test_items_are_resolved_ahead_by_bytes_not_by_count():
    # A weight, 12 biases with nothing to code, then the next weight: its
    # chunk is coded beside the first although 12 items stand in between.
    jobs = (
        [_job(0, 60_000)] + [_job(i, 384, coded=False) for i in range(1, 13)] + [_job(13, 60_000)]
    )
    assert _ahead(jobs, window=2)[0] == 13
    # Large items: what is queued behind the one being written stays under
    # the lookahead (2 chunks, 512 KiB) plus the item that crossed it.
    big = [_job(i, 200_000) for i in range(10)]  # 800 KB each, 4 chunks of 256 KiB
    assert max(_ahead(big, window=2)) == 1


@pytest.mark.parametrize(
    ("dtype", "rotate"),
    [(d, r) for d in (torch.bfloat16, torch.float32, torch.float64) for r in (0, 1, 3, 7, 8, 13)]
    + [(torch.bfloat16, 15), (torch.float32, 31), (torch.float64, 63)],
)
def test_every_rotation_a_frame_can_hold_round_trips(dtype, rotate):
    t = _structured(5000, dtype, rotate)
    width = dtype.itemsize
    payload = ByteGroupCodec().encode(byte_view(t), width, rotate)
    assert payload is not None
    out = torch.empty_like(t)
    ByteGroupCodec().decode(memoryview(payload), byte_view(out), width, rotate)
    assert_bit_equal(out, t, f"rotate {rotate}")


@pytest.mark.parametrize("window", [1, 3])
def test_reused_payload_buffers_code_exactly_as_fresh_ones(window):
    jobs = _jobs(7)
    fresh = _coded(jobs, None, 1)
    buffers = BufferPool()
    with ThreadPoolExecutor(2) as pool:
        assert _coded(jobs, pool, window, buffers=buffers) == fresh
    assert _coded(jobs, None, 1, buffers=buffers) == fresh
    assert len(buffers.take(1 << 18)) > 1 << 18  # an idle payload buffer, not a fresh one


def test_buffer_pool_reuses_fitting_buffers_and_bounds_what_it_keeps():
    buffers = BufferPool(keep_bytes=3000)
    a = buffers.take(1000)
    buffers.give(a)
    assert buffers.take(900) is a  # fits (not over twice the size): reused
    buffers.give(a)
    assert buffers.take(400) is not a  # over twice the size asked: not handed out
    assert buffers.take(1000) is a
    buffers.give(np.empty(2500, np.uint8))
    buffers.give(np.empty(2500, np.uint8))  # over keep_bytes: dropped
    assert len(buffers.take(2500)) == 2500 and len(buffers.take(2500)) == 2500


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.uint8])
def test_encode_into_writes_what_encode_returns(dtype):
    t = _structured(300_000, dtype, 5)  # fp32: 1.2 MB, sampled
    codec, chunk = ByteGroupCodec(), byte_view(t)
    width, rotate = codec.layout(dtype)
    out = bytearray(codec.payload_bound(len(chunk), width))
    n = codec.encode_into(chunk, width, rotate, memoryview(out))
    assert n is not None and bytes(out[:n]) == codec.encode(chunk, width, rotate)
    with pytest.raises(ValueError, match="under the payload bound"):
        codec.encode_into(chunk, width, rotate, memoryview(out)[:-1])


def test_plane_compressed_into_a_buffer_decodes_and_too_small_a_buffer_says_so():
    plane = np.frombuffer(byte_view(_structured(100_000, torch.int16, 1)), np.uint8)
    out = bytearray(zstd.plane_bound(len(plane)))
    n = zstd.compress_plane_into(plane, memoryview(out))
    assert n is not None and n < len(plane) // 2
    back = bytearray(len(plane))
    zstd.decompress_into(memoryview(out)[:n], memoryview(back))
    assert back == plane.tobytes()
    assert zstd.compress_plane_into(plane, memoryview(out)[: n - 1]) is None
    assert zstd.compress_plane_into(plane, memoryview(out)[:n]) is None  # full: maybe cut


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(0, 200 << 20),
    chunk_mib=st.integers(1, 64),
    threads=st.integers(1, 8),
)
def test_balanced_chunks_fill_every_thread_within_the_size_limits(nbytes, chunk_mib, threads):
    c = Compression(chunk_size=chunk_mib << 20, threads=threads)
    size = balanced_chunk_size(nbytes, c)
    assert MIN_SPLIT_CHUNK <= size <= c.chunk_size and size % 4096 == 0

    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    count = ceil(nbytes, size)
    if threads > 1 and nbytes > MIN_SPLIT_CHUNK and size != c.chunk_size:
        # A multiple of threads, unless that many chunks would be under the floor
        # (0.6 MB on 2 threads: one chunk, not 512 KiB + 88 KiB).
        whole = ceil(count, threads) * threads
        assert count % threads == 0 or nbytes / whole < MIN_SPLIT_CHUNK, (count, threads)
    # Never more chunks than the next multiple of threads above the unsplit count.
    assert count <= ceil(ceil(nbytes, c.chunk_size), threads) * threads


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "n", [0, 1000, (MIN_SPLIT_CHUNK >> 2) + 1, 150_000, 262_144 + 77, 700_001]
)  # fp32 values: under a split, just over, 0.6 MB, 1 MiB + 308 B, 2.8 MB
def test_compress_tensor_round_trips_with_split_chunks_and_reused_buffers(n, threads):
    c = Compression(threads=threads)
    for dtype in (torch.float32, torch.bfloat16):
        t = _structured(n, dtype, n)
        blob = bytes(compress_tensor(t, c))
        again = compress_tensor(t, c)  # reused buffers: same bytes
        assert blob == bytes(again)
        assert_bit_equal(decompress_tensor(blob, t, threads=threads), t, f"{n} {dtype}")
        if n:
            header = frames.unpack_header(blob[: frames.HEADER.size])
            assert header.chunk_size == balanced_chunk_size(t.nbytes, c)


def test_decompress_into_takes_exactly_the_frame_size_it_is_given():
    data = bytes(range(256)) * 64
    frame = zstandard.ZstdCompressor().compress(data)
    out = bytearray(len(data))
    zstd.decompress_into(frame, memoryview(out))
    assert out == data
    with pytest.raises(ValueError, match="zstd frame declares 16384 bytes, expected 16383"):
        zstd.decompress_into(frame, memoryview(out)[:-1])
    with pytest.raises(ValueError, match="zstd frame ends after 0 of the 16384 bytes expected"):
        zstd.decompress_into(frame[:-5], memoryview(out))

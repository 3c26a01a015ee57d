"""Store conformance: every built-in store passes the shipped suite (``dcp_multilevel.testing``)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_multilevel.errors import ConfigError
from dcp_multilevel.stores import Store, _direct, _writeback, coalescing, store_for
from dcp_multilevel.stores.local import LocalStore
from dcp_multilevel.testing import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return LocalStore(tmp_path / "root")

    def test_url_and_file_scheme(self, tmp_path):
        assert LocalStore(f"file://{tmp_path}").url == f"file://{tmp_path}"
        assert LocalStore(tmp_path).supports_atomic_rename


class TestLocalStoreThroughThePageCache(StoreTests):
    """The same suite with ordinary writes (``direct_io=False``)."""

    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return LocalStore(tmp_path / "root", direct_io=False)


# ------------------------------------------------------------- early writeback


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_can_be_started_on_a_file_but_not_on_a_pipe(tmp_path):
    assert _writeback.available()
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 8192)
        assert _writeback.start_writeback(fd, 0, 8192)
        assert not _writeback.start_writeback(fd, 0, 0)  # nothing to ask for
    finally:
        os.close(fd)
    read, write = os.pipe()
    try:
        assert not _writeback.start_writeback(write, 0, 4096)  # refused, never raised
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("sync", [True, False])
def test_local_files_ask_for_writeback_stride_by_stride_when_they_are_fsynced(
    tmp_path, monkeypatch, sync
):
    asked: list[tuple[int, int]] = []
    real = _writeback.start_writeback

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        asked.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(_writeback, "start_writeback", spy)
    monkeypatch.setattr(_writeback, "WRITEBACK_STRIDE", 1 << 16)
    store = LocalStore(tmp_path, sync=sync, direct_io=False)  # direct writes skip the cache
    block = bytes(range(256)) * 100  # 25,600 B: strides end mid-write
    with store.open_write("data.bin") as f:
        for _ in range(20):
            f.write(block)
    assert store.read_bytes("data.bin") == block * 20
    if not sync or not _writeback.available():
        assert asked == []  # scratch files (no fsync) are left to the kernel
        return
    # Contiguous requests from 0, each at least a stride, none past what was written.
    ends = list(itertools.accumulate(n for _, n in asked))
    assert [offset for offset, _ in asked] == [0, *ends[:-1]]
    assert all(n >= 1 << 16 for _, n in asked)
    assert sum(n for _, n in asked) <= len(block) * 20 < sum(n for _, n in asked) + (1 << 16)


# ------------------------------------------------------------------- direct I/O

needs_direct = pytest.mark.skipif(not _direct.available(), reason="no O_DIRECT here")


def _resident_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all), from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        vec = (ctypes.c_ubyte * pages)()
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec), pages


@needs_direct
def test_local_files_bypass_the_page_cache_only_when_asked(tmp_path):
    if _direct.memory_backed(tmp_path):
        pytest.skip("the temporary directory is in memory (tmpfs): no cache to bypass")
    data = np.random.default_rng(0).integers(0, 256, (8 << 20) + 1234, dtype=np.uint8).tobytes()
    for direct_io in (True, None):
        store = LocalStore(tmp_path / str(direct_io), direct_io=direct_io)
        with store.open_write("data.bin") as f:
            for i in range(0, len(data), 3 << 20):  # pieces that straddle the bounce buffer
                f.write(data[i : i + (3 << 20)])
        path = tmp_path / str(direct_io) / "data.bin"
        resident, pages = _resident_pages(path)
        if direct_io:  # asked for: only the last, partial block went through the cache
            assert resident <= 2, (resident, pages)
        else:
            assert resident > pages // 2, (resident, pages)
        assert path.read_bytes() == data


@needs_direct
@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(
            st.integers(0, 5 * 4096 + 17), st.booleans(), st.integers(0, 4095), st.booleans()
        ),
        max_size=12,
    ),
    pages=st.integers(1, 3),
    direct=st.booleans(),
)
def test_direct_handle_writes_exactly_the_bytes_given(tmp_path_factory, pieces, pages, direct):
    # Each piece: (size, big: DIRECT_MIN more bytes, its address past a page, pad before it).
    path = tmp_path_factory.mktemp("direct") / "f.bin"
    rng = np.random.default_rng(len(pieces))
    source = mmap.mmap(-1, 2 * _direct.DIRECT_MIN + 8 * 4096)
    src = np.frombuffer(source, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    bounce = mmap.mmap(-1, pages * _direct.ALIGN)  # small: most writes cross it
    view = memoryview(bounce)
    h = _direct.DirectWriteHandle(fd, _direct.open_direct(path) if direct else None, bounce=view)
    expected = []
    try:
        for i, (size, big, offset, pad) in enumerate(pieces):
            n = size + (_direct.DIRECT_MIN if big else 0)
            src[offset : offset + n] = rng.integers(0, 256, n, dtype=np.uint8)
            piece = (
                memoryview(source)[offset : offset + n]
                if i % 2
                else bytes(src[offset : offset + n])
            )
            if pad:
                gap = h.pad_for(piece)
                assert gap < _direct.ALIGN and (gap == 0 or direct)
                expected.append(bytes(gap))
            expected.append(bytes(piece))
            h.write(piece)
            if isinstance(piece, memoryview):
                piece.release()
            assert h.tell() == sum(map(len, expected))
        h.finish()
    finally:
        h.close()
        os.close(fd)
        view.release()
        bounce.close()
        del src
        source.close()
    assert path.read_bytes() == b"".join(expected)


@needs_direct
@pytest.mark.parametrize("past_page", [0, 1000])
def test_big_pieces_go_to_the_disk_without_the_bounce_buffer_once_padded(tmp_path, past_page):
    # Staged tensors sit at pages (past_page 0); live ones anywhere: after pad_for,
    # only the bytes before the piece's first page and after its last go through
    # the bounce buffer.
    path = tmp_path / "f.bin"
    head, tail = b"\x01" * 100, b"\x02" * 50
    n = _direct.DIRECT_MIN + 100
    big_raw = mmap.mmap(-1, 2 * _direct.DIRECT_MIN)
    big = memoryview(big_raw)[past_page : past_page + n]
    first_page = -past_page % _direct.ALIGN
    last_page_end = n - (n - first_page) % _direct.ALIGN
    big[:] = b"\xab" * n
    big[first_page:last_page_end] = b"\xcd" * (last_page_end - first_page)
    bounce_raw = mmap.mmap(-1, _direct.ALIGN)
    bounce = memoryview(bounce_raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    h = _direct.DirectWriteHandle(fd, _direct.open_direct(path), bounce=bounce)
    try:
        h.write(head)
        assert h.pad_for(head) == 0  # small: never padded
        gap = h.pad_for(big)
        assert gap == (past_page - len(head)) % _direct.ALIGN
        assert h.tell() % _direct.ALIGN == past_page
        h.write(big)
        # Its whole pages never went through the buffer; its last bytes did.
        assert b"\xcd" not in bytes(bounce)
        assert bytes(bounce[: n - last_page_end]) == b"\xab" * (n - last_page_end)
        h.write(tail)
        h.finish()
        expected = head + bytes(gap) + bytes(big) + tail
    finally:
        h.close()
        os.close(fd)
        big.release()
        bounce.release()
        big_raw.close()
        bounce_raw.close()
    assert path.read_bytes() == expected


@needs_direct
def test_a_refused_direct_write_falls_back_to_ordinary_writes(tmp_path):
    # A bounce buffer one byte past a page boundary: the kernel refuses O_DIRECT
    # writes from it (EINVAL), as some file systems refuse them all.
    raw = mmap.mmap(-1, 3 * _direct.ALIGN)
    bounce = memoryview(raw)[1 : 1 + 2 * _direct.ALIGN]
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 100
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    h = _direct.DirectWriteHandle(fd, _direct.open_direct(path), bounce=bounce)
    try:
        assert h.direct
        h.write(data)
        assert not h.direct  # the first full buffer was refused, and written ordinarily
        h.finish()
    finally:
        h.close()
        os.close(fd)
    bounce.release()
    raw.close()
    assert path.read_bytes() == data


def _mount_type(path) -> str:
    """The file system type of ``path`` from /proc/mounts (the longest mount point above it)."""
    path = os.path.realpath(path)
    best = ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _dev, point, fstype, *_ = line.split()
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fstype)
    return best[1]


@needs_direct
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/mounts is Linux's")
def test_file_systems_in_memory_keep_ordinary_writes_unless_asked(tmp_path):
    assert _direct.memory_backed(tmp_path) == (_mount_type(tmp_path) in ("tmpfs", "ramfs"))
    if _mount_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    assert _direct.memory_backed("/dev/shm")
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        auto = LocalStore(root / "auto")
        with auto.open_write("f.bin") as f:
            assert not isinstance(f, _direct.DirectWriteHandle)
            f.write(b"x" * 10_000)
        assert not auto.direct_io and auto.read_bytes("f.bin") == b"x" * 10_000
        forced = LocalStore(root / "forced", direct_io=True)
        with forced.open_write("f.bin") as f:
            assert isinstance(f, _direct.DirectWriteHandle)
            f.write(b"y" * 10_000)
        assert forced.direct_io and forced.read_bytes("f.bin") == b"y" * 10_000
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_direct_io_is_a_local_storage_option_checked_at_construction(tmp_path):
    assert not LocalStore(tmp_path).direct_io  # the default: read back soon, from the cache
    assert LocalStore(tmp_path, direct_io=True).direct_io == _direct.available()
    assert store_for(str(tmp_path), direct_io=True).direct_io == _direct.available()
    assert not store_for(str(tmp_path), direct_io=False).direct_io
    with pytest.raises(ConfigError, match=r"direct_io .* must be True, False or None, got 'yes'"):
        LocalStore(tmp_path, direct_io="yes")
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        _direct.DirectWriteHandle(0, None, bounce=memoryview(bytearray(100)))


# --------------------------------------------------------------------------- coalescing


class _Recorded:
    """A store's read handle that records each request (offset, size), each taking
    ``delay`` seconds more (a round trip)."""

    def __init__(self, handle, delay: float = 0.0) -> None:
        self._handle = handle
        self.size = handle.size
        self.requests: list[tuple[int, int]] = []
        self.delay = delay
        self._lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview) -> int:
        with self._lock:
            self.requests.append((offset, len(out)))
        time.sleep(self.delay)
        return self._handle.read_into(offset, out)


@pytest.fixture
def blocks_of_4k(monkeypatch):
    monkeypatch.setattr(coalescing, "COALESCE_BYTES", 4096)


def test_sequential_reads_fetch_each_block_once_and_the_next_ahead(tmp_path, blocks_of_4k):
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    with LocalStore(tmp_path).open_read("f") as handle:
        raw = _Recorded(handle, delay=0.01)
        reader = coalescing.CoalescingReader(raw, limit=None)
        out = bytearray()
        for at in range(0, 10_000, 100):
            piece = memoryview(bytearray(100))
            assert reader.read_into(at, piece) == 100
            out += piece
            if at == 0:
                time.sleep(0.05)
                # the second block is being fetched before anything asked for it
                assert raw.requests == [(0, 4096), (4096, 4096)]
        reader.close()
    assert bytes(out) == data
    assert raw.requests == [(0, 4096), (4096, 4096), (8192, 10_000 - 8192)]


@settings(max_examples=80, deadline=None)
@given(
    reads=st.lists(st.tuples(st.integers(0, 12_000), st.integers(0, 9000)), max_size=12),
    limit=st.one_of(st.none(), st.integers(0, 12_000)),
)
def test_any_reads_return_the_files_bytes(tmp_path_factory, reads, limit) -> None:
    """Random offsets and sizes, within the limit, across it and past the file's end:
    exactly the file's bytes, short only at its end; no fetch left running."""
    root = tmp_path_factory.mktemp("coalesce")
    data = os.urandom(10_000)
    (root / "f").write_bytes(data)
    saved = coalescing.COALESCE_BYTES
    coalescing.COALESCE_BYTES = 4096
    try:
        with LocalStore(root).open_read("f") as handle:
            reader = coalescing.CoalescingReader(handle, limit)
            for offset, size in reads:
                out = memoryview(bytearray(size))
                got = reader.read_into(offset, out)
                assert got == len(data[offset : offset + size])
                assert bytes(out[:got]) == data[offset : offset + size]
            reader.close()
            assert reader._ahead is None
    finally:
        coalescing.COALESCE_BYTES = saved

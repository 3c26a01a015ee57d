"""Store conformance suite: every store passes the same tests."""

from __future__ import annotations

import itertools
import os
import sys
import threading

import pytest

from dcp_multilevel.stores import Store, _writeback
from dcp_multilevel.stores.local import LocalStore


class StoreTests:
    """Subclass with a ``tier`` fixture to check a backend against the Store contract."""

    @pytest.fixture
    def tier(self) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_written_file_reads_back(self, tier):
        with tier.open_write("a/b/file.bin") as f:
            f.write(b"hello ")
            f.write(memoryview(b"world"))
            assert f.tell() == 11
        assert tier.read_bytes("a/b/file.bin") == b"hello world"
        with tier.open_read("a/b/file.bin") as r:
            assert r.size == 11
            buf = bytearray(5)
            assert r.read_into(6, memoryview(buf)) == 5
            assert buf == b"world"
            assert r.read_into(9, memoryview(buf)) == 2  # short only at end of file

    def test_file_is_invisible_until_published(self, tier):
        with tier.open_write("x.bin") as f:
            f.write(b"partial")
            assert not tier.exists("x.bin")
        assert tier.exists("x.bin")

    def test_error_while_writing_publishes_nothing_and_leaves_no_garbage(self, tier):
        with pytest.raises(RuntimeError, match="boom"), tier.open_write("d/x.bin") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
        assert not tier.exists("d/x.bin")
        assert tier.listdir("d") == []

    def test_write_atomic_replaces_existing_content(self, tier):
        tier.write_atomic("m.json", b"old")
        tier.write_atomic("m.json", b"new!")
        assert tier.read_bytes("m.json") == b"new!"

    def test_missing_file_raises_file_not_found(self, tier):
        with pytest.raises(FileNotFoundError):
            tier.read_bytes("nope.bin")

    def test_listdir_and_remove_tree(self, tier):
        for name in ["d/b.bin", "d/a.bin", "d/sub/c.bin", "top.bin"]:
            tier.write_atomic(name, b"x")
        assert tier.listdir("d") == ["a.bin", "b.bin", "sub"]
        assert tier.listdir("missing") == []
        tier.remove_tree("d/sub")
        tier.remove_tree("top.bin")
        tier.remove_tree("never-existed")
        assert tier.listdir("d") == ["a.bin", "b.bin"]
        assert not tier.exists("top.bin")

    def test_parallel_writers_on_different_paths(self, tier):
        def write(i: int) -> None:
            with tier.open_write(f"p/{i}.bin") as f:
                for _ in range(50):
                    f.write(bytes([i]) * 1000)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(8):
            assert tier.read_bytes(f"p/{i}.bin") == bytes([i]) * 50_000


class TestLocalStore(StoreTests):
    @pytest.fixture
    def tier(self, tmp_path) -> Store:
        return LocalStore(tmp_path / "root")

    def test_url_and_file_scheme(self, tmp_path):
        assert LocalStore(f"file://{tmp_path}").url == f"file://{tmp_path}"
        assert LocalStore(tmp_path).supports_atomic_rename


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
    tier = LocalStore(tmp_path, sync=sync)
    block = bytes(range(256)) * 100  # 25,600 B: strides end mid-write
    with tier.open_write("data.bin") as f:
        for _ in range(20):
            f.write(block)
    assert tier.read_bytes("data.bin") == block * 20
    if not sync or not _writeback.available():
        assert asked == []  # scratch files (no fsync) are left to the kernel
        return
    # Contiguous requests from 0, each at least a stride, none past what was written.
    ends = list(itertools.accumulate(n for _, n in asked))
    assert [offset for offset, _ in asked] == [0, *ends[:-1]]
    assert all(n >= 1 << 16 for _, n in asked)
    assert sum(n for _, n in asked) <= len(block) * 20 < sum(n for _, n in asked) + (1 << 16)

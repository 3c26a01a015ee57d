"""The store conformance suite: what every :class:`~dcp_multilevel.stores.Store` must do.

A third-party store (a new URL scheme, ``stores/``) runs the very tests the
built-in stores run::

    from dcp_multilevel.testing import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(f"my://{tmp_path}")
"""

from __future__ import annotations

import threading

import pytest

from ..stores import Store

__all__ = ["StoreTests"]


class StoreTests:
    """The :class:`~dcp_multilevel.stores.Store` contract, as tests.

    Subclass it in a test module and give it a ``store`` fixture returning a fresh,
    empty store of the kind under test; pytest collects the inherited tests.
    """

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_written_file_reads_back(self, store):
        with store.open_write("a/b/file.bin") as f:
            f.write(b"hello ")
            f.write(memoryview(b"world"))
            assert f.tell() == 11
        assert store.read_bytes("a/b/file.bin") == b"hello world"
        with store.open_read("a/b/file.bin") as r:
            assert r.size == 11
            buf = bytearray(5)
            assert r.read_into(6, memoryview(buf)) == 5
            assert buf == b"world"
            assert r.read_into(9, memoryview(buf)) == 2  # short only at end of file

    def test_file_is_invisible_until_published(self, store):
        with store.open_write("x.bin") as f:
            f.write(b"partial")
            assert not store.exists("x.bin")
        assert store.exists("x.bin")

    def test_error_while_writing_publishes_nothing_and_leaves_no_garbage(self, store):
        with pytest.raises(RuntimeError, match="boom"), store.open_write("d/x.bin") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
        assert not store.exists("d/x.bin")
        assert store.listdir("d") == []

    def test_write_atomic_replaces_existing_content(self, store):
        store.write_atomic("m.json", b"old")
        store.write_atomic("m.json", b"new!")
        assert store.read_bytes("m.json") == b"new!"

    def test_missing_file_raises_file_not_found(self, store):
        with pytest.raises(FileNotFoundError):
            store.read_bytes("nope.bin")

    def test_listdir_and_remove_tree(self, store):
        for name in ["d/b.bin", "d/a.bin", "d/sub/c.bin", "top.bin"]:
            store.write_atomic(name, b"x")
        assert store.listdir("d") == ["a.bin", "b.bin", "sub"]
        assert store.listdir("missing") == []
        store.remove_tree("d/sub")
        store.remove_tree("top.bin")
        store.remove_tree("never-existed")
        assert store.listdir("d") == ["a.bin", "b.bin"]
        assert not store.exists("top.bin")

    def test_parallel_writers_on_different_paths(self, store):
        def write(i: int) -> None:
            with store.open_write(f"p/{i}.bin") as f:
                for _ in range(50):
                    f.write(bytes([i]) * 1000)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(8):
            assert store.read_bytes(f"p/{i}.bin") == bytes([i]) * 50_000

"""The store conformance suite: what every :class:`~dcp_multilevel.stores.Store` must do.

A third-party store (a new URL scheme, ``stores/``) runs the very tests the
built-in stores run::

    from dcp_multilevel.testing import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def tier(self, tmp_path):
            return MyStore(f"my://{tmp_path}")
"""

from __future__ import annotations

import threading

import pytest

from ..stores import Store

__all__ = ["StoreTests"]


class StoreTests:
    """The :class:`~dcp_multilevel.stores.Store` contract, as tests.

    Subclass it in a test module and give it a ``tier`` fixture returning a fresh,
    empty store of the kind under test; pytest collects the inherited tests.
    """

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

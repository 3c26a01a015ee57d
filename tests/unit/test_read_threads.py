"""A checkpoint written as one file per rank is read by several threads when asked:
``MultiLevelReader(thread_count=k)`` cuts the file's items into runs of adjacent items."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_multilevel import MultiLevelReader, MultiLevelWriter
from dcp_multilevel.testing.levels import bit_equal


class _Recording(DefaultLoadPlanner):
    """Notes the thread that hands each tensor to DCP."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def commit_tensor(self, read_item, tensor) -> None:  # type: ignore[override]
        with self._lock:
            self.threads.add(threading.current_thread().name)
        # Each item takes a while: no run ends before the reader has handed out every
        # run, so the pool cannot serve two runs with one thread.
        time.sleep(0.02)
        super().commit_tensor(read_item, tensor)


def test_one_file_is_read_by_several_threads_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(12)}
    state["b"] = torch.arange(7, dtype=torch.int64)
    dcp.save(state, storage_writer=MultiLevelWriter(tmp_path / "c"))
    assert len(list((tmp_path / "c" / "data").iterdir())) == 1
    for threads, expect_many in ((1, False), (4, True)):
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        planner = _Recording()
        dcp.load(
            back,
            storage_reader=MultiLevelReader(tmp_path / "c", thread_count=threads),
            planner=planner,
        )
        assert bit_equal(back, state)
        readers = {t for t in planner.threads if t.startswith("dcp-ml-read")}
        assert (len(readers) >= 2) == expect_many, planner.threads

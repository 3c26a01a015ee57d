"""Loading a checkpoint written as one file per rank, with 1 or more reader threads.

A save with ``thread_count=1`` (the default) writes one data file per rank;
``MultiLevelReader(thread_count=k)`` then splits that file's items into runs
of adjacent items, one thread each. Stock ``FileSystemReader`` on the stock
checkpoint of the same state beside them. Files in /dev/shm (page cache: the
copy, not the disk, is measured); destinations allocated once and reused;
configurations alternate, medians over ``--repeat``.

    python benchmarks/bench_read_threads.py --gb 1 --threads 1,2 --repeat 6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_multilevel import MultiLevelReader, MultiLevelWriter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # "assuming the intent is to load in a single process"
    threads = [int(t) for t in args.threads.split(",")]
    n = max(1, int(args.gb * (1 << 30) / (64 << 20)))
    state = {f"t{i}": torch.randn(16 << 20) for i in range(n)}  # 64 MiB fp32 each
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="bench-read-threads-", dir="/dev/shm"))
    try:
        dcp.save(state, storage_writer=MultiLevelWriter(root / "ours"))
        dcp.save(state, storage_writer=FileSystemWriter(root / "stock"))
        files = len(list((root / "ours" / "data").iterdir()))
        readers = {f"ours, thread_count={t}": t for t in threads} | {"stock": 0}
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        times: dict[str, list[float]] = {k: [] for k in readers}
        names = list(readers)
        for r in range(args.repeat):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = readers[name]
                reader = (
                    MultiLevelReader(root / "ours", thread_count=t)
                    if t
                    else FileSystemReader(root / "stock")
                )
                t0 = time.perf_counter()
                dcp.load(dest, storage_reader=reader)
                times[name].append(time.perf_counter() - t0)
        assert all(torch.equal(dest[k], state[k]) for k in state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{nbytes / 1e9:.2f} GB in {files} data file(s); torch threads {torch.get_num_threads()}")
    print("| reader | median s | GB/s | spread s |\n|---|---:|---:|---:|")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"| {name} | {med:.3f} | {nbytes / med / 1e9:.2f} | {min(v):.3f}-{max(v):.3f} |")


if __name__ == "__main__":
    main()

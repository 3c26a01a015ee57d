"""What one kind of call on a save's thread costs a training thread, through the GIL.

The complaint measured: a save's own threads slow training by more than the time they take
when they make many small torch calls. A background thread makes ``--calls``
calls of one kind while the main thread runs Python-bound steps (in-place
adds on small CPU tensors, as launching kernels is); *steal* is the steps'
time beyond the same steps alone. Kinds alternate in each of ``--rounds``;
medians are printed with the time the calls take alone.

    python benchmarks/bench_gil_calls.py --calls 6000 --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from _measure import PythonSteps, rotated
from _report import markdown_table, print_header


def _pair(a: int = 1, b: int = 2) -> tuple[int, int]:
    return a, b


def _kinds(fd: int) -> dict[str, Callable[[], object]]:
    t = torch.zeros(64)
    f32 = torch.empty(1 << 16, dtype=torch.uint8).view(torch.float32)
    kib = bytes(1024)
    span = ctypes.c_char * 256
    return {
        "as_strided": lambda: f32.as_strided((16,), (1,), 64),
        "reshape": lambda: t.reshape(-1),
        "view(uint8)": lambda: t.view(torch.uint8),
        "detach": t.detach,
        "numpy()": t.numpy,
        "is_pinned": t.is_pinned,
        "os.write 1 KiB": lambda: os.write(fd, kib),
        "data_ptr": t.data_ptr,
        "is_contiguous": t.is_contiguous,
        "ctypes view": lambda: memoryview(span.from_address(t.data_ptr())).cast("B"),
        "pure Python": _pair,
    }


def _steal(fn: Callable[[], object], calls: int, steps: PythonSteps) -> tuple[float, float]:
    def run() -> None:
        for _ in range(calls):
            fn()

    t0 = time.perf_counter()
    run()
    alone = time.perf_counter() - t0
    th = threading.Thread(target=run)
    th.start()
    extra = steps.until(lambda: not th.is_alive(), 2)
    th.join()
    return alone, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-gil-") as root:
        print_header(__file__, root)
        fd = os.open(os.path.join(root, "sink"), os.O_WRONLY | os.O_CREAT)
        try:
            kinds = _kinds(fd)
            alone: dict[str, list[float]] = {k: [] for k in kinds}
            steal: dict[str, list[float]] = {k: [] for k in kinds}
            steps = PythonSteps()
            for r in range(args.rounds):
                steps.baseline()  # the machine's pace now
                for name in rotated(tuple(kinds), r):
                    a, s = _steal(kinds[name], args.calls, steps)
                    alone[name].append(a)
                    steal[name].append(s)
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
    rows = [
        [
            name,
            f"{1e3 * statistics.median(alone[name]):.1f}",
            f"{1e3 * statistics.median(steal[name]):.1f}",
            f"{1e3 * min(steal[name]):.1f}..{1e3 * max(steal[name]):.1f}",
        ]
        for name in kinds
    ]
    print(f"\n{args.calls} calls on a background thread, {args.rounds} rounds\n")
    print(markdown_table(["call", "alone ms", "steal ms", "range ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

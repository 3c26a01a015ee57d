"""How fast this machine's disk takes a checkpoint-sized write, round after round.

Writes ``--gb`` of random bytes to one file, fsyncs it, deletes it, and
repeats. No torch and nothing of dcp_multilevel: it tells whether a slow L1
commit in ``bench_manager.py`` is the disk's doing. On the development VM the
first round (fresh blocks) ran at 0.24 GB/s and the next ones (blocks freed by
the previous round) at 1.1-1.5 GB/s.

    python benchmarks/disk_probe.py --path /work/probe.bin
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

BLOCK = 16 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", type=Path, required=True, help="file to write (deleted each round)")
    p.add_argument("--gb", type=float, default=0.42, help="bytes per round, GB; 0.42")
    p.add_argument("--rounds", type=int, default=8, help="rounds; 8")
    args = p.parse_args(argv)
    block = os.urandom(BLOCK)
    blocks = max(1, round(args.gb * 1e9 / BLOCK))
    size_gb = blocks * BLOCK / 1e9
    print("| round | write + fsync s | GB/s |\n| --: | --: | --: |")
    for i in range(args.rounds):
        t0 = time.perf_counter()
        with open(args.path, "wb") as f:
            for _ in range(blocks):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        args.path.unlink()
        print(f"| {i + 1} | {dt:.2f} | {size_gb / dt:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

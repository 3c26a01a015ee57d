"""What a save costs the CPU: ``O_DIRECT`` writes against the page cache, and stock.

A synchronous ``dcp.save`` of a GPT-2-small-sized state (1.49 GB of fp32
tensors) to the local disk, fsynced, by three writers in alternating rounds:

* ``ours`` -- :class:`~dcp_multilevel.MultiLevelWriter` on its defaults
  (whole blocks written with ``O_DIRECT``, see ``stores/_direct.py``);
* ``ours, direct_io=False`` -- the same through the page cache;
* ``stock`` -- ``FileSystemWriter``.

For each: wall time, and the CPU the save used -- this process's user and
system time (all threads), and the whole machine's busy time over the save
(the kernel's writeback threads included). CPU time is what an async save
takes from training that runs beside it on the same cores. Before each save
the disk is synced and the previous checkpoint removed.

    python benchmarks/bench_direct_io.py --gb 1.5 --repeat 5
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from _cli import add_json, add_root, args_record, parser, quiet_dcp_warnings
from _measure import GB, median, rounds, spread
from dcp_multilevel import MultiLevelWriter

WRITERS = ("ours", "ours, direct_io=False", "stock")


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _process_cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _writer(name: str, path: str):
    if name == "stock":
        return FileSystemWriter(path)
    if name == "ours":
        return MultiLevelWriter(path)
    return MultiLevelWriter(path, storage_options={"direct_io": False})


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gb", type=float, default=1.5, help="state size (fp32 tensors of 64 MiB)")
    ap.add_argument("--repeat", type=int, default=5)
    add_root(ap, "checkpoints go here (a directory on the disk to measure)")
    add_json(ap)
    args = ap.parse_args()
    quiet_dcp_warnings()
    n = max(1, round(args.gb * GB / (64 << 20)))
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(16 << 20, generator=gen) for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = args.root / "direct_io"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    samples: dict[str, list[dict[str, float]]] = {w: [] for w in WRITERS}
    for rep, name in rounds(WRITERS, args.repeat):
        path = str(root / f"{rep}-{name.split(',')[0]}")
        os.sync()
        time.sleep(0.5)
        u0, s0 = _process_cpu()
        m0, t0 = _machine_busy_s(), time.perf_counter()
        dcp.save(state, storage_writer=_writer(name, path))
        wall = time.perf_counter() - t0
        m1 = _machine_busy_s()
        u1, s1 = _process_cpu()
        samples[name].append({"wall": wall, "user": u1 - u0, "sys": s1 - s0, "machine": m1 - m0})
        shutil.rmtree(path)
    print(f"{nbytes / GB:.2f} GB in {n} tensors, {args.repeat} rounds, medians (spread)")
    print("| writer | wall s | GB/s | user CPU s | system CPU s | machine busy s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows in samples.items():
        col = {k: [r[k] for r in rows] for k in rows[0]}
        print(
            f"| {name} | {median(col['wall']):.2f} ({spread(col['wall'])}) "
            f"| {nbytes / GB / median(col['wall']):.2f} "
            f"| {median(col['user']):.2f} | {median(col['sys']):.2f} "
            f"| {median(col['machine']):.2f} ({spread(col['machine'])}) |"
        )
    if args.json:
        record = {"args": args_record(args), "bytes": nbytes, "samples": samples}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

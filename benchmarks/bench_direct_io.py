"""What a save costs the CPU: ``O_DIRECT`` writes against the page cache, and stock.

A GPT-2-small-sized state (1.48 GB of fp32 tensors) saved to the local disk,
fsynced, in alternating rounds, by:

* ``ours`` -- a synchronous ``dcp.save`` with
  :class:`~dcp_multilevel.MultiLevelWriter` on its defaults (whole blocks
  written with ``O_DIRECT``, see ``stores/_direct.py``);
* ``ours, direct_io=False`` -- the same through the page cache;
* ``stock`` -- ``FileSystemWriter``;
* ``async: ...`` -- the same three with ``dcp.async_save``, until the save is
  durable, writers reused across rounds (the staging pool warm): ours stages
  into its pool and writes big tensors to disk straight from it; stock with
  its best staging on CPU (``DefaultStager`` with async staging);
* ``async: ours, no copy`` -- ``StagingConfig(overlap=True, budget_bytes=0)``:
  nothing is staged, the tensors are written from the live state behind the
  fence (``staging_completion``), as a synchronous save writes them.

For each: wall time, and the CPU the save used -- this process's user and
system time (all threads), and the whole machine's busy time over the save
(the kernel's writeback threads included). CPU time is what an async save
takes from training that runs beside it on the same cores. Before each save
the disk is synced and the previous checkpoint removed.

    python benchmarks/bench_direct_io.py --gb 1.5 --repeat 5
    python benchmarks/bench_direct_io.py --state gpt2   # GPT-2 small + AdamW: ~600 tensors
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from _cli import add_json, add_root, args_record, parser, quiet_dcp_warnings
from _measure import GB, machine_busy_s, median, rounds, spread
from dcp_multilevel import MultiLevelWriter, StagingConfig
from dcp_multilevel.staging.buffers import iter_tensors

WRITERS = (
    "ours",
    "ours, direct_io=False",
    "stock",
    "async: ours",
    "async: ours, direct_io=False",
    "async: ours, no copy",
    "async: stock best",
)


def _state(args) -> tuple[dict, int]:
    """The state to save, and its number of tensors."""
    if args.state == "gpt2":
        from _gpu_bench import Trainer  # gpu_check's model, after one training step

        state = Trainer("gpt2", torch.device("cpu")).state()
        return state, sum(1 for _ in iter_tensors(state))
    n = max(1, round(args.gb * GB / (64 << 20)))
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(16 << 20, generator=gen) for i in range(n)}, n


def _process_cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _writer(name: str, path: str):
    if "stock" in name:
        return FileSystemWriter(path)
    if name.endswith("direct_io=False"):
        return MultiLevelWriter(path, storage_options={"direct_io": False})
    if name.endswith("no copy"):
        return MultiLevelWriter(path, staging=StagingConfig(overlap=True, budget_bytes=0))
    return MultiLevelWriter(path)


class _Saver:
    """One row's way of saving; async writers and the stager live across rounds."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.is_async = name.startswith("async")
        self.writer = _writer(name, str(root / "unused")) if self.is_async else None
        opts = StagingOptions(False, False, True, False)  # stock's best on CPU
        self.stager = DefaultStager(opts) if name == "async: stock best" else None
        #: no copy: seconds from async_save's return until its fence was done
        self.fence_s: float | None = None

    def save(self, state: dict, path: str) -> None:
        """Save ``state`` to ``path``; return once it is durable."""
        if not self.is_async:
            dcp.save(state, storage_writer=_writer(self.name, path))
        elif self.stager is not None:
            w = FileSystemWriter(path)
            dcp.async_save(
                state, storage_writer=w, async_stager=self.stager
            ).upload_completion.result()
        elif self.name.endswith("no copy"):
            r = dcp.async_save(state, storage_writer=self.writer, checkpoint_id=path)
            t0 = time.perf_counter()
            r.staging_completion.result()
            self.fence_s = time.perf_counter() - t0
            r.upload_completion.result()
        else:
            dcp.async_save(state, storage_writer=self.writer, checkpoint_id=path).result()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.writer is not None:
            self.writer.close()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gb", type=float, default=1.5, help="state size (fp32 tensors of 64 MiB)")
    ap.add_argument(
        "--state",
        choices=("tensors", "gpt2"),
        default="tensors",
        help="tensors: --gb of 64 MiB tensors; gpt2: gpu_check's GPT-2 small model and "
        "AdamW state after one step (1.49 GB in ~600 tensors)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    add_root(ap, "checkpoints go here (a directory on the disk to measure)")
    add_json(ap)
    args = ap.parse_args()
    quiet_dcp_warnings()
    state, n = _state(args)
    nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(state))
    root = args.root / "direct_io"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    samples: dict[str, list[dict[str, float]]] = {w: [] for w in WRITERS}
    savers = {w: _Saver(w, root) for w in WRITERS}
    for w in WRITERS:  # untimed: pools, threads and the stager's first allocation
        savers[w].save(state, str(root / "warm-up"))
        shutil.rmtree(root / "warm-up")
    for rep, name in rounds(WRITERS, args.repeat):
        path = str(root / f"{rep}-{WRITERS.index(name)}")
        os.sync()
        time.sleep(0.5)
        u0, s0 = _process_cpu()
        m0, t0 = machine_busy_s(), time.perf_counter()
        savers[name].save(state, path)
        wall = time.perf_counter() - t0
        m1 = machine_busy_s()
        u1, s1 = _process_cpu()
        machine = float("nan") if m0 is None or m1 is None else m1 - m0
        samples[name].append({"wall": wall, "user": u1 - u0, "sys": s1 - s0, "machine": machine})
        if savers[name].fence_s is not None:
            samples[name][-1]["fence"] = savers[name].fence_s
        shutil.rmtree(path)
    for saver in savers.values():
        saver.close()
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
    fences = [r["fence"] for r in samples["async: ours, no copy"]]
    print(
        f"async: ours, no copy: the fence (staging_completion) was done {median(fences):.2f} s "
        f"({spread(fences)}) after async_save returned: the live tensors were written"
    )
    if args.json:
        record = {"args": args_record(args), "bytes": nbytes, "samples": samples}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

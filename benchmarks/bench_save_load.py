"""Save/load throughput of dcp_multilevel against stock DCP, torch.save and the raw disk.

One process, no process group. Builds a BERT-large shaped fp32 state dict
(``BertForPreTraining``, ~1.47 GB, 399 tensors, random values with a fixed seed),
measures the raw disk in the same run (writing the state's own bytes: this VM's
disk is faster for compressible data than for random bytes, which are measured
too for reference), then for each configuration:

* save into a fresh directory (timed: the ``dcp.save`` call, fsync included),
* load from the page cache right after the save (warm),
* load after ``os.sync()`` + ``posix_fadvise(DONTNEED)`` on every file (cold),
  starting ``--settle`` seconds after the save ended (the raw read likewise
  after the raw write: this VM's host caches recent writes, so a read's speed
  depends on the age of the data),

each load into a preallocated zero state dict and checked tensor by tensor
against the source. Measurements run round-robin (raw disk, then every
configuration, ``--repeat`` times, the order rotated every round) and the
medians are reported with every sample.

Quick check::

    python benchmarks/bench_save_load.py --size-scale 0.05 --repeat 1
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed.checkpoint as dcp

# Measure this checkout's dcp_multilevel whatever is installed, and find _common.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BertConfig,
    assert_state_equal,
    bert_pretraining_shapes,
    build_state_dict,
    cpu_snapshot,
    evict_tree,
    gbps,
    machine_info,
    markdown_table,
    median,
    other_cpu_fraction,
    random_bytes,
    raw_read_seconds,
    raw_write_seconds,
    remove_tree,
    resident_fraction,
    state_bytes,
    state_nbytes,
    timed,
    tree_nbytes,
    wait_for_idle,
    zeros_like_state,
)

REPO = Path(__file__).resolve().parents[1]
#: Default wait between a write and the cold read of its data, per GB written.
SETTLE_S_PER_GB = 3.4
State = dict[str, torch.Tensor]
T = TypeVar("T")
# A save step gets (state, path) and returns the zero-argument call to time; a load
# step gets (destination, path) and returns a call that returns the loaded state.
SaveStep = Callable[[State, Path], Callable[[], object]]
LoadStep = Callable[[State, Path], Callable[[], State]]


@dataclass(frozen=True)
class Config:
    name: str
    threads: int | None
    save: SaveStep
    load: LoadStep
    note: str = ""


@dataclass(frozen=True)
class Raw:
    """A raw-disk reference: ``data`` written as one file, then read back."""

    name: str
    data: memoryview
    note: str


@dataclass
class Samples:
    """Per-repeat measurements of one configuration (or of the raw disk)."""

    save_s: list[float] = field(default_factory=list)
    warm_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)
    disk_bytes: list[int] = field(default_factory=list)
    files: list[int] = field(default_factory=list)
    # Page-cache residency of the checkpoint right before each cold load (should be 0).
    resident: list[float] = field(default_factory=list)
    # Seconds from the end of the write to the start of each cold read.
    cold_age: list[float] = field(default_factory=list)
    # Highest share of the CPU that other processes used during any timed phase.
    other_cpu: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- configurations


def _stock(threads: int) -> Config:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def save(state: State, path: Path) -> Callable[[], object]:
        writer = FileSystemWriter(path, thread_count=threads, sync_files=True)
        return lambda: dcp.save(state, storage_writer=writer)

    def load(dest: State, path: Path) -> Callable[[], State]:
        reader = FileSystemReader(path)

        def run() -> State:
            dcp.load(dest, storage_reader=reader)
            return dest

        return run

    return Config(f"stock-t{threads}", threads, save, load, "FileSystemWriter/Reader")


def _ours(threads: int) -> Config:
    from dcp_multilevel import MultiLevelReader, MultiLevelWriter

    def save(state: State, path: Path) -> Callable[[], object]:
        writer = MultiLevelWriter(path, overwrite=False, thread_count=threads, sync_files=True)
        return lambda: dcp.save(state, storage_writer=writer)

    def load(dest: State, path: Path) -> Callable[[], State]:
        reader = MultiLevelReader(path, thread_count=threads)

        def run() -> State:
            dcp.load(dest, storage_reader=reader)
            return dest

        return run

    return Config(f"ours-t{threads}", threads, save, load, "MultiLevelWriter/Reader")


def _torch_save() -> Config:
    def save(state: State, path: Path) -> Callable[[], object]:
        def run() -> None:
            path.mkdir(parents=True)
            with open(path / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())  # the DCP writers fsync too (sync_files=True)

        return run

    def load(_dest: State, path: Path) -> Callable[[], State]:
        return lambda: torch.load(path / "state.pt", weights_only=True, mmap=False)

    return Config(
        "torch.save",
        None,
        save,
        load,
        "torch.save + fsync / torch.load(weights_only=True, mmap=False) into new tensors",
    )


CONFIG_FACTORIES: dict[str, Callable[[], Config]] = {
    "stock-t1": lambda: _stock(1),
    "stock-t2": lambda: _stock(2),
    "torch.save": _torch_save,
    "ours-t1": lambda: _ours(1),
    "ours-t2": lambda: _ours(2),
}


# --------------------------------------------------------------------------- measuring


class Runner:
    """Runs timed phases, each after waiting (up to ``wait_idle`` s) for an idle CPU.

    Every cold read starts ``settle`` seconds after the end of the write of the
    data it reads, raw disk and configurations alike. On this VM, reads of data
    written a second ago run ~4x faster than reads of data written 10 s ago (the
    host still caches it), so cold reads are only comparable at equal age.
    """

    def __init__(self, wait_idle: float, settle: float) -> None:
        self.wait_idle = wait_idle
        self.settle = settle
        self.busy_waits = 0  # phases that started although the machine stayed busy

    def phase(
        self, fn: Callable[[], T], *, not_before: float | None = None
    ) -> tuple[float, T, float]:
        """(seconds, result, share of the CPU other processes used meanwhile).

        ``not_before``: a ``time.perf_counter()`` value before which the phase
        does not start.
        """
        if self.wait_idle > 0 and wait_for_idle(timeout=self.wait_idle) is None:
            self.busy_waits += 1
        if not_before is not None:
            time.sleep(max(0.0, not_before - time.perf_counter()))
        before = cpu_snapshot()
        seconds, result = timed(fn)
        return seconds, result, other_cpu_fraction(before, cpu_snapshot())

    def measure(self, cfg: Config, state: State, dest: State, path: Path, out: Samples) -> None:
        """One save + warm load + cold load of ``cfg`` at ``path``, appended to ``out``."""
        remove_tree(path)
        gc.collect()
        seconds, _, other = self.phase(cfg.save(state, path))
        written = time.perf_counter()
        out.save_s.append(seconds)
        nbytes, nfiles = tree_nbytes(path)
        out.disk_bytes.append(nbytes)
        out.files.append(nfiles)
        others = [other]
        for cold in (False, True):
            for t in dest.values():
                t.zero_()
            not_before = None
            if cold:
                evict_tree(path)
                out.resident.append(resident_fraction(path))
                not_before = written + self.settle
            seconds, loaded, other = self.phase(cfg.load(dest, path), not_before=not_before)
            if cold:
                # The timed call started `seconds` before now.
                out.cold_age.append(time.perf_counter() - seconds - written)
            (out.cold_s if cold else out.warm_s).append(seconds)
            others.append(other)
            # Outside the timing: a broken load must not pass as a fast one.
            assert_state_equal(state, loaded)
            del loaded
        out.other_cpu.append(max(others))
        remove_tree(path)

    def measure_raw(self, raw: Raw, path: Path, out: Samples) -> None:
        """Raw fsync'd write and page-cache-evicted read of one file holding ``raw.data``."""
        # The raw helpers time themselves (eviction stays outside their timing).
        _, seconds, w_other = self.phase(lambda: raw_write_seconds(path, raw.data))
        written = time.perf_counter()
        out.save_s.append(seconds)
        evict_tree(path)
        out.resident.append(resident_fraction(path))
        _, seconds, r_other = self.phase(
            lambda: raw_read_seconds(path), not_before=written + self.settle
        )
        out.cold_age.append(time.perf_counter() - seconds - written)
        out.cold_s.append(seconds)
        out.disk_bytes.append(path.stat().st_size)
        out.files.append(1)
        out.other_cpu.append(max(w_other, r_other))
        remove_tree(path)


# --------------------------------------------------------------------------- reporting

RAW = "raw disk"
RAW_RANDOM = "raw disk, random bytes"
RAW_NOTE = (
    "the state's bytes as one preallocated buffer, written to one file in 64 MiB "
    "os.write()s + fsync; read back with 64 MiB readinto() after eviction"
)
RAW_RANDOM_NOTE = (
    "the same with incompressible random bytes (reference only: this disk is "
    "data-dependent, so the goals use the row above)"
)


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _pct(value: float, ref: float) -> str:
    return f"{_fmt(100 * value / ref, 1)}%"


def _list(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def _med(xs: list[float]) -> float:
    return median(xs) if xs else float("nan")


def report(notes: dict[str, str], results: dict[str, Samples], nbytes: int, busy_waits: int) -> str:
    """The markdown table, the samples behind it and the goals."""
    headers = ["config", "save s", "save GB/s", "on disk GB", "files"]
    headers += ["warm load s", "warm GB/s", "cold load s", "cold GB/s", "other CPU %"]
    rows = []
    for name, s in results.items():
        save, warm, cold = _med(s.save_s), _med(s.warm_s), _med(s.cold_s)
        rows.append(
            [
                name,
                _fmt(save, 3),
                _fmt(gbps(nbytes, save)),
                _fmt(_med(s.disk_bytes) / 1e9, 3),
                int(_med(s.files)),
                _fmt(warm, 3) if s.warm_s else "-",
                _fmt(gbps(nbytes, warm)) if s.warm_s else "-",
                _fmt(cold, 3),
                _fmt(gbps(nbytes, cold)),
                _fmt(100 * max(s.other_cpu), 0),
            ]
        )
    out = [markdown_table(headers, rows), ""]
    out.append(
        "Medians of the repeats. GB/s = logical state bytes / seconds (1 GB = 1e9 B). "
        "Saves include fsync; loads are timed around the load call only. "
        "'other CPU %': highest share of the machine's CPU other processes used (user time) "
        "during any timed phase (0 on an idle machine)."
    )
    disturbed = [n for n, s in results.items() if _med(s.other_cpu) > 0.1]
    if busy_waits or disturbed:
        out.append(
            f"WARNING: other processes used > 10% of the CPU during the timed phases of "
            f"{', '.join(disturbed) or '-'}; {busy_waits} phases started on a busy machine "
            "after --wait-idle ran out. These numbers are disturbed."
        )
    for name, s in results.items():
        resident = max(s.resident, default=float("nan"))
        samples = f"save={_list(s.save_s)}"
        samples += f" warm={_list(s.warm_s)}" if s.warm_s else ""
        out.append(
            f"- {name}: {notes[name]}; seconds {samples} cold={_list(s.cold_s)}; "
            f"cold reads started {_fmt(_med(s.cold_age), 1)} s after the write (median); "
            f"page-cache residency before cold reads <= {_fmt(100 * resident, 1)}%"
        )
    out += ["", "Goals:", *goals(results, nbytes)]
    return "\n".join(out)


def goals(results: dict[str, Samples], nbytes: int) -> list[str]:
    """PASS/MISS per goal and thread count, from the medians."""

    def bw(name: str, attr: str) -> float:
        s = results.get(name)
        return gbps(nbytes, _med(getattr(s, attr))) if s else float("nan")

    def goal(label: str, value: float, target: float, detail: str) -> str:
        if math.isnan(value) or math.isnan(target):
            return f"- n/a  {label}: not measured in this run"
        return f"- {'PASS' if value >= target else 'MISS'} {label}: {detail}"

    raw_w, raw_r = bw(RAW, "save_s"), bw(RAW, "cold_s")
    lines = []
    for t in (1, 2):
        ours, stock = bw(f"ours-t{t}", "save_s"), bw(f"stock-t{t}", "save_s")
        lines.append(
            goal(
                f"ours save >= stock (thread_count={t})",
                ours,
                stock,
                f"{_fmt(ours)} vs {_fmt(stock)} GB/s = {_fmt(ours / stock, 3)}x",
            )
        )
    for t in (1, 2):
        ours = bw(f"ours-t{t}", "save_s")
        lines.append(
            goal(
                f"ours save >= 80% of raw fsync'd disk bandwidth (thread_count={t})",
                ours,
                0.8 * raw_w,
                f"{_fmt(ours)} vs raw {_fmt(raw_w)} GB/s = {_pct(ours, raw_w)}",
            )
        )
    for t in (1, 2):
        ours, stock = bw(f"ours-t{t}", "warm_s"), bw(f"stock-t{t}", "warm_s")
        lines.append(
            goal(
                f"ours warm load >= 1.3x stock (thread_count={t})",
                ours,
                1.3 * stock,
                f"{_fmt(ours)} vs {_fmt(stock)} GB/s = {_fmt(ours / stock, 3)}x",
            )
        )
    for t in (1, 2):
        ours = bw(f"ours-t{t}", "cold_s")
        lines.append(
            goal(
                f"ours cold load >= 80% of raw read bandwidth (thread_count={t})",
                ours,
                0.8 * raw_r,
                f"{_fmt(ours)} vs raw {_fmt(raw_r)} GB/s = {_pct(ours, raw_r)}",
            )
        )
    return lines


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--size-scale",
        type=float,
        default=1.0,
        help="scale the number of encoder layers (24 at 1.0, at least 1); default 1.0",
    )
    p.add_argument("--repeat", type=int, default=3, help="measurements per config (median)")
    p.add_argument(
        "--root",
        type=Path,
        default=REPO / "bench_out",
        help="scratch directory for checkpoints (default: bench_out/ in the repo)",
    )
    p.add_argument(
        "--only",
        default=",".join(CONFIG_FACTORIES),
        help=f"comma-separated subset of: {', '.join(CONFIG_FACTORIES)}",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="before each timed phase wait up to this many seconds for other processes to\n"
        "use < 10%% of the CPU; default 0 (do not wait; contention is reported anyway)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds from the end of a write to the start of the cold read of that data,\n"
        f"the same for every entry; default {SETTLE_S_PER_GB} s per GB of state (~5 s at\n"
        "full size): this VM's host caches recent writes and reads them back faster",
    )
    args = p.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in args.only if c not in CONFIG_FACTORIES]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {list(CONFIG_FACTORIES)}")
    if args.repeat < 1 or args.size_scale <= 0:
        p.error("--repeat must be >= 1 and --size-scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    # dcp.save/load without a process group warns once per call; nothing to act on here.
    warnings.filterwarnings("ignore", message=".*process group.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")

    configs = []
    for name in args.only:
        try:
            configs.append(CONFIG_FACTORIES[name]())
        except ImportError as e:
            print(f"cannot run {name}: {e}", file=sys.stderr)
            return 2

    layers = max(1, round(24 * args.size_scale))
    shapes = bert_pretraining_shapes(BertConfig(num_hidden_layers=layers))
    build_s, state = timed(lambda: build_state_dict(shapes, seed=args.seed))
    dest = zeros_like_state(state)
    nbytes = state_nbytes(state)
    settle = SETTLE_S_PER_GB * nbytes / 1e9 if args.settle is None else args.settle

    root: Path = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    info = machine_info(root)
    cmd = "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]])
    print(f"# bench_save_load: `{cmd}`")
    for k, v in info.items():
        print(f"- {k}: {v}")
    print(
        f"- state: BertForPreTraining shapes, {layers} layers, {len(state)} fp32 tensors, "
        f"{nbytes / 1e9:.3f} GB (built in {build_s:.1f} s), seed {args.seed}"
    )
    print(f"- scratch root: {root}; repeats: {args.repeat}; configs: {', '.join(args.only)}")
    print(f"- cold reads start {settle:.1f} s after the end of the write (--settle)")
    print(flush=True)

    raws = [
        Raw(RAW, state_bytes(state), RAW_NOTE),
        Raw(RAW_RANDOM, random_bytes(nbytes, seed=args.seed), RAW_RANDOM_NOTE),
    ]
    runner = Runner(args.wait_idle, settle)
    entries: list[Raw | Config] = [*raws, *configs]
    results = {e.name: Samples() for e in entries}
    notes = {e.name: e.note for e in entries}
    # The order rotates every round so that no entry always runs right after the
    # same neighbour (the virtual disk here has bursty, history-dependent bandwidth).
    for rep in range(args.repeat):
        shift = rep % len(entries)
        for entry in entries[shift:] + entries[:shift]:
            s = results[entry.name]
            if isinstance(entry, Raw):
                runner.measure_raw(entry, root / "raw.bin", s)
                warm = ""
            else:
                runner.measure(entry, state, dest, root / f"{entry.name}-{rep}", s)
                warm = f"warm {s.warm_s[-1]:.3f} s, "
            print(
                f"[{rep + 1}/{args.repeat}] {entry.name}: save {s.save_s[-1]:.3f} s, {warm}"
                f"cold {s.cold_s[-1]:.3f} s, {s.disk_bytes[-1] / 1e9:.3f} GB in "
                f"{s.files[-1]} files, other CPU {100 * s.other_cpu[-1]:.0f}%",
                flush=True,
            )
    print()
    print(report(notes, results, nbytes, runner.busy_waits))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Save/load throughput of dcp_multilevel against stock DCP, torch.save and the raw disk.

One process, no process group. Builds a BERT-large shaped fp32 state dict
(``BertForPreTraining``, ~1.47 GB, 399 tensors, random values with a fixed seed),
measures the raw disk in the same run (writing the state's own bytes: this VM's
disk is faster for compressible data than for random bytes, which are measured
too for reference), then for each configuration:

* save into a fresh directory (timed: the ``dcp.save`` call, fsync included),
* load right after the save (warm: the page cache as the save left it, what a
  restart on the same node reads),
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
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_results, add_root, add_seed, add_wait_idle, names, parser, quiet_dcp_warnings
from _data import assert_state_equal, bert_config, bert_state, state_nbytes, zeros_like_state
from _disk import (
    evict_tree,
    random_bytes,
    raw_read_seconds,
    raw_write_seconds,
    remove_tree,
    resident_fraction,
    state_bytes,
    tree_nbytes,
)
from _measure import PhaseTimer, gbps, median, rounds, timed
from _report import Results, figure, fmt, goal_line, markdown_table, measured, print_header, samples
from dcp_multilevel import MultiLevelReader, MultiLevelWriter

#: Default wait between a write and the cold read of its data, per GB written.
SETTLE_S_PER_GB = 3.4
State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- what is compared


@dataclass(frozen=True)
class Config:
    """A storage writer/reader pair, through ``dcp.save`` and ``dcp.load``."""

    name: str
    note: str
    writer: Callable[[Path], object] | None = None
    reader: Callable[[Path], object] | None = None
    planner: Callable[[], object] | None = None  # None: DCP's default

    def save(self, state: State, path: Path) -> Callable[[], object]:
        """The call to time (the writer and planner are built outside it)."""
        writer = self.writer(path)
        planner = self.planner() if self.planner else None
        return lambda: dcp.save(state, storage_writer=writer, planner=planner)

    def load(self, dest: State, path: Path) -> Callable[[], State]:
        """The call to time; it returns the loaded state."""
        reader = self.reader(path)

        def run() -> State:
            dcp.load(dest, storage_reader=reader)
            return dest

        return run


class TorchSave(Config):
    """``torch.save`` of the whole state to one file + fsync; ``torch.load`` into new tensors."""

    def save(self, state: State, path: Path) -> Callable[[], object]:
        def run() -> None:
            path.mkdir(parents=True)
            with open(path / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())  # the DCP writers fsync too (sync_files=True)

        return run

    def load(self, dest: State, path: Path) -> Callable[[], State]:
        return lambda: torch.load(path / "state.pt", weights_only=True, mmap=False)


def _stock(t: int) -> Config:
    def writer(p: Path) -> object:
        return FileSystemWriter(p, thread_count=t, sync_files=True)

    # Stock's best for repeated saves: DCP's plan caching (a planner per save; the
    # cache is DCP's, per planner class).
    return Config(
        f"stock-t{t}",
        "FileSystemWriter/Reader, DefaultSavePlanner(enable_plan_caching=True)",
        writer,
        FileSystemReader,
        lambda: DefaultSavePlanner(enable_plan_caching=True),
    )


def _ours(t: int) -> Config:
    def writer(p: Path) -> object:
        return MultiLevelWriter(p, overwrite=False, thread_count=t, sync_files=True)

    return Config(
        f"ours-t{t}",
        "MultiLevelWriter/Reader",
        writer,
        lambda p: MultiLevelReader(p, thread_count=t),
    )


TORCH_SAVE_NOTE = "torch.save + fsync / torch.load(weights_only=True, mmap=False) into new tensors"
CONFIGS = {
    c.name: c
    for c in (_stock(1), _stock(2), TorchSave("torch.save", TORCH_SAVE_NOTE), _ours(1), _ours(2))
}


@dataclass(frozen=True)
class Raw:
    """A raw-disk reference: ``data`` written as one file, then read back."""

    name: str
    data: memoryview
    note: str


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


# --------------------------------------------------------------------------- measuring


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


def measure(
    timer: PhaseTimer,
    settle: float,
    cfg: Config,
    state: State,
    dest: State,
    path: Path,
    out: Samples,
) -> None:
    """One save + warm load (right after it) + cold load of ``cfg`` at ``path``,
    appended to ``out``.

    The cold read starts ``settle`` seconds after the end of the write, raw disk
    and configurations alike. On this VM, reads of data written a second ago run
    ~4x faster than reads of data written 10 s ago (the host still caches it), so
    cold reads are only comparable at equal age.
    """
    remove_tree(path)
    save = timer(cfg.save(state, path))
    written = time.perf_counter()
    out.save_s.append(save.seconds)
    nbytes, nfiles = tree_nbytes(path)
    out.disk_bytes.append(nbytes)
    out.files.append(nfiles)
    others = [save.other_cpu]
    for cold in (False, True):
        for t in dest.values():
            t.zero_()
        not_before = None
        if cold:
            evict_tree(path)
            out.resident.append(resident_fraction(path))
            not_before = written + settle
        load = timer(cfg.load(dest, path), not_before=not_before)
        if cold:  # the timed call started `seconds` before now
            out.cold_age.append(time.perf_counter() - load.seconds - written)
        (out.cold_s if cold else out.warm_s).append(load.seconds)
        others.append(load.other_cpu)
        # Outside the timing: a broken load must not pass as a fast one.
        assert_state_equal(state, load.result)
        del load
    out.other_cpu.append(max(others))
    remove_tree(path)


def measure_raw(timer: PhaseTimer, settle: float, raw: Raw, path: Path, out: Samples) -> None:
    """Raw fsync'd write and page-cache-evicted read of one file holding ``raw.data``."""
    # The raw measurements time themselves (eviction stays outside their timing).
    write = timer(lambda: raw_write_seconds(path, raw.data))
    written = time.perf_counter()
    out.save_s.append(write.result)
    evict_tree(path)
    out.resident.append(resident_fraction(path))
    read = timer(lambda: raw_read_seconds(path), not_before=written + settle)
    out.cold_age.append(time.perf_counter() - read.result - written)
    out.cold_s.append(read.result)
    out.disk_bytes.append(path.stat().st_size)
    out.files.append(1)
    out.other_cpu.append(max(write.other_cpu, read.other_cpu))
    remove_tree(path)


# --------------------------------------------------------------------------- reporting


def report(
    notes: dict[str, str], results: dict[str, Samples], nbytes: int, timer: PhaseTimer
) -> str:
    """The markdown table, the samples behind it and the goals."""
    headers = (
        "config | save s | save GB/s | on disk GB | files | warm load s | warm GB/s | "
        "cold load s | cold GB/s | other CPU %"
    )
    rows = []
    for name, s in results.items():
        save, warm, cold = median(s.save_s), median(s.warm_s), median(s.cold_s)
        warm_cells = [fmt(warm, 3), fmt(gbps(nbytes, warm))] if s.warm_s else ["-", "-"]
        rows.append(
            [
                name,
                fmt(save, 3),
                fmt(gbps(nbytes, save)),
                fmt(median(s.disk_bytes) / 1e9, 3),
                int(median(s.files)),
                *warm_cells,
                fmt(cold, 3),
                fmt(gbps(nbytes, cold)),
                fmt(100 * max(s.other_cpu), 0),
            ]
        )
    out = [markdown_table(headers, rows), ""]
    out.append(
        "Medians of the repeats. GB/s = logical state bytes / seconds (1 GB = 1e9 B). "
        "Saves include fsync; loads are timed around the load call only. "
        "'other CPU %': highest share of the machine's CPU other processes used (user time) "
        "during any timed phase (0 on an idle machine)."
    )
    warning = timer.warning(n for n, s in results.items() if median(s.other_cpu) > 0.1)
    out += [warning] if warning else []
    for name, s in results.items():
        resident = max(s.resident, default=float("nan"))
        warm = f" warm={samples(s.warm_s)}" if s.warm_s else ""
        out.append(
            f"- {name}: {notes[name]}; seconds save={samples(s.save_s)}{warm} "
            f"cold={samples(s.cold_s)}; cold reads started {fmt(median(s.cold_age), 1)} s "
            "after the write (median); page-cache residency before cold reads <= "
            f"{fmt(100 * resident, 1)}%"
        )
    out += ["", "Goals:", *goals(results, nbytes)]
    return "\n".join(out)


#: (label, figure compared, reference: stock at the same thread count or the raw disk, factor)
GOALS = (
    ("ours save >= stock", "save_s", "stock", 1.0),
    ("ours save >= 80% of raw fsync'd disk bandwidth", "save_s", RAW, 0.8),
    ("ours warm load >= 1.3x stock", "warm_s", "stock", 1.3),
    ("ours cold load >= 80% of raw read bandwidth", "cold_s", RAW, 0.8),
)


def goals(results: dict[str, Samples], nbytes: int) -> list[str]:
    """PASS/MISS per goal and thread count, from the medians."""

    def bw(name: str, attr: str) -> float:
        s = results.get(name)
        return gbps(nbytes, median(getattr(s, attr))) if s else float("nan")

    lines = []
    for label, attr, ref, factor in GOALS:
        for t in (1, 2):
            ours = bw(f"ours-t{t}", attr)
            if ref == RAW:
                base = bw(RAW, attr)
                detail = f"{fmt(ours)} vs raw {fmt(base)} GB/s = {fmt(100 * ours / base, 1)}%"
            else:
                base = bw(f"{ref}-t{t}", attr)
                detail = f"{fmt(ours)} vs {fmt(base)} GB/s = {fmt(ours / base, 3)}x"
            label_t = f"{label} (thread_count={t})"
            if measured(ours, factor * base):
                lines.append(goal_line(ours >= factor * base, label_t, detail))
            else:
                lines.append(goal_line(None, label_t, "not measured in this run"))
    return lines


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--size-scale",
        type=float,
        default=1.0,
        help="scale the number of encoder layers (24 at 1.0, at least 1); default 1.0",
    )
    p.add_argument("--repeat", type=int, default=3, help="measurements per config (median)")
    add_root(p, "scratch directory for checkpoints (default: bench_out/ in the repo)")
    p.add_argument(
        "--only", default=",".join(CONFIGS), help=f"comma-separated subset of: {', '.join(CONFIGS)}"
    )
    add_seed(p)
    add_results(p, "save_load")
    add_wait_idle(p)
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help=(
            "seconds from the end of a write to the start of the cold read of that data,\n"
            f"the same for every entry; default {SETTLE_S_PER_GB} s per GB of state (~5 s at\n"
            "full size): this VM's host caches recent writes and reads them back faster"
        ),
    )
    args = p.parse_args(argv)
    args.only = names(p, args.only, list(CONFIGS), "config")
    if args.repeat < 1 or args.size_scale <= 0:
        p.error("--repeat must be >= 1 and --size-scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    quiet_dcp_warnings()

    run = Results(__file__)
    cfg = bert_config(args.size_scale)
    build_s, state = timed(lambda: bert_state(cfg, seed=args.seed))
    dest = zeros_like_state(state)
    nbytes = state_nbytes(state)
    settle = SETTLE_S_PER_GB * nbytes / 1e9 if args.settle is None else args.settle
    root: Path = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    print_header(__file__, root)
    print(
        f"- state: BertForPreTraining shapes, {cfg.num_hidden_layers} layers, {len(state)} fp32 "
        f"tensors, {nbytes / 1e9:.3f} GB (built in {build_s:.1f} s), seed {args.seed}"
    )
    print(f"- scratch root: {root}; repeats: {args.repeat}; configs: {', '.join(args.only)}")
    print(f"- cold reads start {settle:.1f} s after the end of the write (--settle)")
    print(flush=True)

    entries: list[Raw | Config] = [
        Raw(RAW, state_bytes(state), RAW_NOTE),
        Raw(RAW_RANDOM, random_bytes(nbytes, seed=args.seed), RAW_RANDOM_NOTE),
        *(CONFIGS[name] for name in args.only),
    ]
    timer = PhaseTimer(args.wait_idle)
    results = {e.name: Samples() for e in entries}
    # The virtual disk here has bursty, history-dependent bandwidth: rotate the order.
    for rep, entry in rounds(entries, args.repeat):
        s = results[entry.name]
        if isinstance(entry, Raw):
            measure_raw(timer, settle, entry, root / "raw.bin", s)
            warm = ""
        else:
            measure(timer, settle, entry, state, dest, root / f"{entry.name}-{rep}", s)
            warm = f"warm {s.warm_s[-1]:.3f} s, "
        print(
            f"[{rep + 1}/{args.repeat}] {entry.name}: save {s.save_s[-1]:.3f} s, {warm}"
            f"cold {s.cold_s[-1]:.3f} s, {s.disk_bytes[-1] / 1e9:.3f} GB in "
            f"{s.files[-1]} files, other CPU {100 * s.other_cpu[-1]:.0f}%",
            flush=True,
        )
    print()
    print(report({e.name: e.note for e in entries}, results, nbytes, timer))
    figures = {}
    for name, s in results.items():
        for kind, secs in (("save", s.save_s), ("warm", s.warm_s), ("cold", s.cold_s)):
            if secs:
                figures[f"{name}.{kind}_gbps"] = figure((gbps(nbytes, x) for x in secs), "GB/s")
        figures[f"{name}.disk_bytes"] = figure(s.disk_bytes, "B")
    run.write(
        args.results,
        figures=figures,
        alternated=[e.name for e in entries],
        rounds=args.repeat,
        data={
            "state_bytes": nbytes,
            "tensors": len(state),
            "layers": cfg.num_hidden_layers,
            "notes": {e.name: e.note for e in entries},
            "samples": {name: asdict(s) for name, s in results.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

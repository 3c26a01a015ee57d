"""Training-loop time blocked per checkpoint: a direct remote save vs CheckpointManager.

One process, no process group, one run. For each remote and codec, the same
BERT-large shaped fp32 state (``BertForPreTraining``; ``--scale`` keeps that
fraction of the 24 encoder layers, 3 by default: ~0.41 GB (the embeddings and
the untied MLM decoder alone are 0.26 GB), random values with a fixed seed; sized
so the moto server, at a few tens of MB/s, fits the default run into ~8 minutes)
is checkpointed ``--saves`` times in a training-like loop. Every
iteration:

1. a training step: a tiny in-place update of every tensor (so each checkpoint
   differs) and ``--step-seconds`` of small single-threaded tensor ops
   (``--step-kind sleep``: sleeping instead);
2. **direct**, stock DCP's way to put a checkpoint on object storage:
   ``dcp.save(state, storage_writer=FsspecWriter(<remote>/direct/step-N,
   thread_count=2, **storage_options), planner=DefaultSavePlanner(enable_plan_caching=True))``
   (with ``_extensions=[ZStandard()]`` in the compressed cells; ``--direct ours``:
   ``MultiLevelWriter(<remote>/direct/step-N, codec=...)`` instead): the loop is
   blocked until the checkpoint is committed on the remote, so blocked time = time
   to durable (untimed afterwards: the remote copy is deleted to bound the
   server's memory);
3. **manager**: ``CheckpointManager([Level(local, every=1, keep=2), Level(<remote>/managed,
   every=1, keep=1, codec=...)]).save(state, step=N)``; blocked = the ``save``
   call (the L1 commit plus the manager's own retention work), after which the
   loop trains on for ``--step-seconds`` while the drain copies the checkpoint to
   the remote in the background; then ``mgr.wait()``. Time to durable on the
   remote = the L1 commit (``SaveMetrics.blocked_seconds``) + the drain's
   ``DrainResult.lag_seconds`` (L1 commit -> remote manifest written). Waiting
   for the drain before the next iteration keeps every save's drain measurable
   (with the default policy "latest", a save arriving while the previous drain
   runs waits, and a newer one would replace it; ``bench_drain_policy.py``
   measures that case); that wait is in the ``--json`` output.

Remotes (``_remotes.py``): ``s3``, a moto server on loopback in a child process,
reached with s3fs; ``throttled``, ``throttled:///<dir>``, a local directory (in
/dev/shm by default, so the simulated remote does not load the disk L1 uses)
behind a simulated link of ``--remote-mbps`` MB/s (default 200) per direction.

The manager's remote level uses the MultiLevelWriter defaults (one data file
per rank, spooled locally, then uploaded); L1 is uncompressed. A profile is
``python -m cProfile``'s to take.

Correctness: after a cell's loop the L1 level is deleted (node replaced), and a
fresh manager's ``load_latest`` must return the last step from the remote,
bit-exact. Done for every throttled cell and the first s3 cell (``--verify-all``:
every cell; moto copies the whole object for every ranged GET, which makes
loading a compressed checkpoint from it take minutes).

Goals: manager blocked time at least 5x smaller than a direct remote
save; the checkpoint durable on the remote within 1.2x the direct save's time.

Quick check::

    python benchmarks/bench_manager.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_results, add_seed, add_wait_idle, names, parser, quiet_dcp_warnings
from _data import assert_state_equal, bert_config, bert_state, state_nbytes, zeros_like_state
from _disk import scratch_dir
from _measure import cpu_snapshot, median, other_cpu_fraction, wait_for_idle
from _remotes import moto_s3
from _report import Results, figure, fmt, machine_info, markdown_table, verdict
from dcp_multilevel import CheckpointManager, Level, MultiLevelWriter
from dcp_multilevel.stores import store_for

State = dict[str, torch.Tensor]
REMOTES = ("s3", "throttled")
CODECS = ("none", "bytegroup")
DIRECT = ("stock", "ours")
BLOCKED_GOAL = 5.0  # direct save / manager blocked >= this
DURABLE_GOAL = 1.2  # manager time to durable / direct save <= this


# --------------------------------------------------------------------------- the loop


@dataclass
class Cell:
    remote: str
    codec: str
    state_bytes: int
    direct_s: list[float] = field(default_factory=list)
    direct_bytes: list[int] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)  # the mgr.save call
    l1_commit_s: list[float] = field(default_factory=list)  # SaveMetrics.blocked_seconds
    l1_bytes: list[int] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)  # L1 commit + drain lag
    drain_s: list[float] = field(default_factory=list)  # DrainResult.seconds
    drain_bytes: list[int] = field(default_factory=list)
    drain_wait_s: list[float] = field(default_factory=list)  # mgr.wait() after the step
    skipped: int = 0
    other_cpu: float = float("nan")
    verify: str = ""
    load_s: float = float("nan")  # load_latest from the remote after losing L1
    load_l1_s: float = float("nan")  # load_latest from L1 (a restarted process, L1 intact)

    def med(self, name: str) -> float:
        return median(getattr(self, name))

    @property
    def blocked_ratio(self) -> float:
        return self.med("direct_s") / self.med("blocked_s")

    @property
    def durable_ratio(self) -> float:
        return self.med("durable_s") / self.med("direct_s")


def _fsspec_options(options: dict[str, Any]) -> dict[str, Any]:
    """The fsspec file system's own options (without our levels' ``spool_dir``)."""
    return {k: v for k, v in options.items() if k != "spool_dir"}


def direct_writer(
    kind: str, url: str, codec: str | None, options: dict[str, Any]
) -> tuple[object, object | None]:
    """The writer and planner of a save straight to the remote: stock DCP's
    ``FsspecWriter`` in its best configuration (two writer threads, plan caching, its
    ZStandard extension where the cell compresses), or our ``MultiLevelWriter``."""
    if kind == "ours":
        return MultiLevelWriter(url, codec=codec, storage_options=options), None
    ext = [ZStandard()] if codec else None
    writer = FsspecWriter(url, thread_count=2, _extensions=ext, **_fsspec_options(options))
    return writer, DefaultSavePlanner(enable_plan_caching=True)


def training_step(state: State, seconds: float, kind: str, *, update: bool) -> None:
    """A stand-in for a training step: optionally nudge every tensor, then work or sleep."""
    if update:
        with torch.no_grad():
            for t in state.values():
                t.view(-1)[:256].add_(1e-3)
    end = time.perf_counter() + seconds
    if kind == "sleep":
        time.sleep(seconds)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the Python side of a GPU step keeps about one core busy
    try:
        a = torch.randn(192, 192)
        while time.perf_counter() < end:
            a = torch.tanh(a @ a * 0.01)
    finally:
        torch.set_num_threads(threads)


def run_cell(
    remote: str,
    codec: str,
    state: State,
    args: argparse.Namespace,
    root: Path,
    remote_root: str,
    options: dict[str, Any],
    verify: bool,
) -> Cell:
    """``args.saves`` iterations of: train, save straight to the remote, train, save
    through the manager (and wait for its drain)."""
    codec_arg = None if codec == "none" else codec
    tag = f"{remote}-{codec}-{uuid.uuid4().hex[:6]}"
    l1 = root / f"l1-{tag}"
    direct_root = f"{remote_root}/{tag}/direct"
    managed = Level(
        f"{remote_root}/{tag}/managed", every=1, keep=1, codec=codec_arg, storage_options=options
    )
    levels = [Level(str(l1), every=1, keep=2), managed]
    mgr = CheckpointManager(levels)
    cell = Cell(remote, codec, state_nbytes(state))
    before = cpu_snapshot()
    for step in range(1, args.saves + 1):
        if args.wait_idle > 0 and wait_for_idle(timeout=args.wait_idle) is None:
            print(f"  (machine still busy after {args.wait_idle} s; measuring anyway)")
        training_step(state, args.step_seconds, args.step_kind, update=True)

        # (a) straight to the remote
        url = f"{direct_root}/step-{step}"
        writer, planner = direct_writer(args.direct, url, codec_arg, options)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, planner=planner)
        direct = time.perf_counter() - t0
        cell.direct_s.append(direct)
        # Untimed: what it stored, then bound the server's memory.
        fs, path = fsspec.core.url_to_fs(url, **_fsspec_options(options))
        cell.direct_bytes.append(fs.du(path))
        fs.rm(path, recursive=True)

        # (b) through the manager
        t0 = time.perf_counter()
        metrics = mgr.save(state, step=step)
        cell.blocked_s.append(time.perf_counter() - t0)
        cell.l1_commit_s.append(metrics.blocked_seconds)
        cell.l1_bytes.append(metrics.bytes_written)
        training_step(state, args.step_seconds, args.step_kind, update=False)
        t1 = time.perf_counter()
        mgr.wait()
        cell.drain_wait_s.append(time.perf_counter() - t1)
        (result,) = [r for r in mgr.drain_results if r.step == step]
        if result.skipped or not result.committed:
            cell.skipped += 1
            continue
        cell.durable_s.append(metrics.blocked_seconds + result.lag_seconds)
        cell.drain_s.append(result.seconds)
        cell.drain_bytes.append(result.bytes_stored)
        print(
            f"  {remote:9s} {codec:9s} step {step}: direct {direct:6.2f} s | manager blocked "
            f"{cell.blocked_s[-1]:6.3f} s (L1 commit {metrics.blocked_seconds:.3f} s), durable "
            f"{cell.durable_s[-1]:6.2f} s, drain {result.seconds:6.2f} s",
            flush=True,
        )
    cell.other_cpu = other_cpu_fraction(before, cpu_snapshot())
    mgr.close()
    if verify:
        cell.load_l1_s = restart_and_load(state, levels, args.saves)
        cell.verify, cell.load_s = lose_l1_and_load(state, levels, args.saves)
    else:
        cell.verify = "not verified (--verify-all)"
    with contextlib.suppress(OSError):
        store_for(f"{remote_root}/{tag}", **options).remove_tree("")
    shutil.rmtree(l1, ignore_errors=True)
    return cell


def timed_load(state: State, levels: list[Level]) -> tuple[int | None, float, dict, State]:
    """A new manager's ``load_latest`` into zeroed tensors: (step, seconds, the reader's
    sources, the loaded state)."""
    fresh = CheckpointManager(levels)
    dest = zeros_like_state(state)
    t0 = time.perf_counter()
    got = fresh.load_latest(dest)
    load_s = time.perf_counter() - t0
    sources = fresh.last_load_sources
    fresh.close()
    return got, load_s, sources, dest


def restart_and_load(state: State, levels: list[Level], step: int) -> float:
    """A restarted process on the same node (L1 intact) resumes: the seconds
    ``load_latest`` took (the restore after a process crash; checked bit for bit)."""
    got, load_s, sources, dest = timed_load(state, levels)
    if got != step or any(s.startswith(levels[1].url) for s in sources):
        raise AssertionError(
            f"load_latest returned step {got} from {sources}, expected {step} from L1"
        )
    assert_state_equal(state, dest)
    return load_s


def lose_l1_and_load(state: State, levels: list[Level], step: int) -> tuple[str, float]:
    """Lose the node (delete L1), resume from the remote, compare bit for bit.
    Returns the verdict and the seconds ``load_latest`` took."""
    shutil.rmtree(levels[0].url)
    got, load_s, sources, dest = timed_load(state, levels)
    try:
        if got != step:
            raise AssertionError(f"load_latest returned step {got}, expected {step}")
        if len(sources) != 1 or not next(iter(sources)).startswith(levels[1].url):
            raise AssertionError(f"loaded from {sources}, expected the remote only")
        assert_state_equal(state, dest)
    except AssertionError as e:
        return f"FAILED: {e}", load_s
    return "bit-exact from remote", load_s


# --------------------------------------------------------------------------- report


def report(cells: list[Cell], args: argparse.Namespace, info: dict[str, str], extra: str) -> str:
    out = ["## CheckpointManager vs a direct remote save", ""]
    out += [f"- {k}: {v}" for k, v in info.items()]
    out += [extra, ""]
    headers = (
        f"remote | codec | state GB | direct save s ({args.direct}; = blocked = durable) | "
        "manager blocked s (save call) | of which L1 commit s | blocked ratio (goal >= 5x) | "
        "manager durable s | durable / direct (goal <= 1.2x) | drain s | "
        "remote GB direct / drained | other CPU %"
    )
    rows = [
        [
            c.remote,
            c.codec,
            fmt(c.state_bytes / 1e9),
            fmt(c.med("direct_s")),
            fmt(c.med("blocked_s"), 3),
            fmt(c.med("l1_commit_s"), 3),
            f"{c.blocked_ratio:.1f}x",
            fmt(c.med("durable_s")),
            f"{c.durable_ratio:.2f}x",
            fmt(c.med("drain_s")),
            f"{median(c.direct_bytes) / 1e9:.3f} / {median(c.drain_bytes) / 1e9:.3f}",
            f"{100 * c.other_cpu:.0f}",
        ]
        for c in cells
    ]
    out += [
        f"Medians of {args.saves} saves each; {args.step_kind} step of {args.step_seconds} s "
        "between saves.",
        "",
        markdown_table(headers, rows),
        "",
        "### Goals",
        "",
    ]
    headers = (
        "remote / codec | blocked >= 5x smaller | durable <= 1.2x direct | "
        "load after losing L1 | drains skipped"
    )
    rows = [
        [
            f"{c.remote} / {c.codec}",
            f"{verdict(c.blocked_ratio >= BLOCKED_GOAL)} ({c.blocked_ratio:.1f}x)",
            f"{verdict(c.durable_ratio <= DURABLE_GOAL)} ({c.durable_ratio:.2f}x)",
            c.verify
            + (
                f" (load {c.load_s:.2f} s; from L1 before: {c.load_l1_s:.2f} s)"
                if c.load_s == c.load_s
                else ""
            ),
            str(c.skipped),
        ]
        for c in cells
    ]
    out += [markdown_table(headers, rows), ""]

    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--scale",
        type=float,
        default=0.125,
        help="fraction of the 24 BERT layers; 0.125 (3, ~0.41 GB)",
    )
    p.add_argument("--saves", type=int, default=5, help="saves per cell (median); 5")
    p.add_argument(
        "--step-seconds", type=float, default=1.0, help="training step between saves, seconds; 1.0"
    )
    p.add_argument(
        "--step-kind",
        choices=("compute", "sleep"),
        default="compute",
        help="step: small single-threaded tensor ops (default) or sleep",
    )
    p.add_argument("--remotes", default=",".join(REMOTES), help=f"subset of: {', '.join(REMOTES)}")
    p.add_argument("--codec", default=",".join(CODECS), help=f"subset of: {', '.join(CODECS)}")
    p.add_argument(
        "--direct",
        choices=DIRECT,
        default="stock",
        help="the save straight to the remote: stock FsspecWriter (its best: "
        "thread_count=2, plan caching, ZStandard when compressed) or ours "
        "MultiLevelWriter; stock",
    )
    p.add_argument(
        "--remote-mbps",
        type=float,
        default=200.0,
        help="bandwidth of the throttled remote, MB/s; 200",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="scratch directory for L1 and the remote store's spool files (default: "
        "a new temporary directory, removed afterwards)",
    )
    p.add_argument(
        "--remote-dir",
        type=Path,
        default=None,
        help="where the throttled remote stores its objects (default: a new "
        "directory in /dev/shm if there is one, so the simulated remote does not "
        "load the local disk that L1 and the spool use; else under --root)",
    )
    p.add_argument(
        "--spool-dir",
        type=Path,
        default=None,
        help="where remote levels spool files before upload (default: under "
        "--root, the disk L1 uses)",
    )
    p.add_argument(
        "--verify-all",
        action="store_true",
        help="check the load after losing L1 in every cell (default: every "
        "throttled cell, only the first s3 cell: moto copies the whole object "
        "per ranged GET, so a compressed checkpoint loads for minutes)",
    )
    add_wait_idle(
        p,
        "before each iteration, wait up to this many seconds for other "
        "processes to go quiet; 0 (don't)",
    )
    add_seed(p)
    add_results(p, "manager")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: tiny BERT, 2 saves, 0.2 s steps"
    )
    args = p.parse_args(argv)
    args.remotes = names(p, args.remotes, REMOTES, "remote", required=True)
    args.codec = names(p, args.codec, CODECS, "codec", required=True)
    if args.quick:
        args.saves, args.step_seconds = 2, 0.2
    if args.saves < 1 or args.scale <= 0 or args.step_seconds < 0 or args.remote_mbps <= 0:
        p.error("--saves must be >= 1, --scale and --remote-mbps > 0, --step-seconds >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    run = Results(__file__)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    cfg = bert_config(args.scale, tiny=args.quick)
    state = bert_state(cfg, seed=args.seed)
    size = state_nbytes(state)
    print(f"state: {len(state)} tensors, {size / 1e9:.3f} GB ({cfg.num_hidden_layers} layers)")

    shm = Path("/dev/shm")
    # The simulated remote in memory, so that it does not load the disk L1 uses.
    shm_ok = args.remote_dir is None and shm.is_dir() and os.access(shm, os.W_OK)
    cells: list[Cell] = []
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(scratch_dir(args.root, "bench-manager-"))
        info = machine_info(root)
        remote_dir = args.remote_dir or root / "remote"
        if shm_ok:
            remote_dir = stack.enter_context(scratch_dir(None, "bench-manager-remote-", parent=shm))
        spool = args.spool_dir if args.spool_dir is not None else root / "spool"
        for remote in args.remotes:
            if remote == "s3":
                base, opts = stack.enter_context(moto_s3())
            else:
                base, opts = f"throttled://{remote_dir.resolve()}", {"mbps": args.remote_mbps}
            opts = {**opts, "spool_dir": str(spool)}
            for i, codec in enumerate(args.codec):
                verify = args.verify_all or args.quick or remote != "s3" or i == 0
                cells.append(run_cell(remote, codec, state, args, root, base, opts, verify))

    load_after = os.getloadavg()
    extra = (
        f"- state: BertForPreTraining shapes, {cfg.num_hidden_layers} of 24 encoder layers, "
        f"fp32, {len(state)} tensors, {size / 1e9:.3f} GB"
        + (" (tiny config, --quick)" if args.quick else f" (--scale {args.scale})")
        + f"\n- throttled remote: {args.remote_mbps:g} MB/s per direction, objects in "
        + f"{remote_dir}; L1 and spool files in {root}"
        + "\n- load average (1/5/15 min) before: "
        + " / ".join(f"{x:.2f}" for x in load_before)
        + ", after: "
        + " / ".join(f"{x:.2f}" for x in load_after)
        + f"; total runtime {time.perf_counter() - t_start:.0f} s"
    )
    print()
    print(report(cells, args, info, extra))
    figures = {}
    for c in cells:
        tag = f"{c.remote}-{c.codec}"
        for key in ("direct_s", "blocked_s", "l1_commit_s", "durable_s", "drain_s"):
            figures[f"{tag}.{key}"] = figure(getattr(c, key), "s")
        figures[f"{tag}.state_bytes"] = figure([c.state_bytes], "B")
    run.write(
        args.results,
        figures=figures,
        rounds=args.saves,
        alternated=[f"direct ({args.direct})", "manager"],
        data={"direct": args.direct, "cells": [asdict(c) for c in cells]},
    )
    ok = not any(c.verify.startswith("FAILED") for c in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

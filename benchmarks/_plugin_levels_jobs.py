"""``bench_plugin_levels.py``'s configurations and what every rank runs: the saves
timed in a training-like loop, and the memory of 100 saves. See that script's docstring."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import quiet_dcp_warnings
from _disk import remove_tree
from _measure import rounds

#: The configurations alternated in every round, in this order before rotation.
CONFIGS = ("first-level", "three-levels", "manager", "stock")
#: What each configuration is, for the tables.
LABELS = {
    "first-level": "`dcp.save`, `MultiLevelWriter(levels=[first])`",
    "three-levels": "`dcp.save`, `MultiLevelWriter(levels=[first, partner, remote])`",
    "manager": "`CheckpointManager([first, partner, remote]).save`",
    "stock": "`dcp.save`, stock `FileSystemWriter` (plan caching)",
}
#: Retention on every level: the newest two complete checkpoints.
KEEP = 2


def make_state(rank: int, mb: float, seed: int) -> dict[str, torch.Tensor]:
    """This rank's state: 8 fp32 tensors of ``mb`` MB in all (random normal values, a
    fixed seed per rank), under keys of its own (``rank<r>.layer<i>.weight``): each
    rank saves only its own bytes, as sharded training does."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = 8
    per = max(1, int(mb * 1e6) // 4 // n)
    return {f"rank{rank}.layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def nudge(state: dict[str, torch.Tensor]) -> None:
    """A tiny in-place update of every tensor, so every checkpoint differs."""
    with torch.no_grad():
        for t in state.values():
            t[:256].add_(1e-3)


def training_step(state: dict[str, torch.Tensor], seconds: float, kind: str) -> None:
    """A stand-in for a training step: nudge the state, then sleep or compute."""
    nudge(state)
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    x = torch.randn(128, 128)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x * 0.01)


def levels_for(base: Path, config: str, remote_codec: str | None) -> list:
    """The levels of ``config`` below ``base``: the node's first level, alone or with
    partner copies on the other node and a folder standing in for the remote."""
    from dcp_multilevel import Level

    first = Level(f"{base}/n{{node}}/l1", keep=KEEP)
    if config == "first-level":
        return [first]
    return [
        first,
        Level(f"partner:{base}/n{{node}}/partner", keep=KEEP),
        Level(f"{base}/remote", keep=KEEP, codec=remote_codec),
    ]


def level_name(url: str) -> str:
    if url.startswith("partner:"):
        return "partner"
    return "remote" if url.endswith("/remote") else url


def runtime_of(levels: list) -> Any:
    """The process's runtime for ``levels`` (made by the first writer or manager)."""
    from dcp_multilevel.levels.runtime import runtimes

    found = [runtime for runtime in runtimes() if runtime.given == levels]
    return found[-1] if found else None


def disk_read_bytes() -> int | None:
    """What this process read from storage so far (``/proc/self/io`` ``read_bytes``: the
    disk, never the page cache; every thread, the drains' included). None where the
    kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def busy_levels(levels: list) -> list[str]:
    """The higher levels a drain still runs or waits on (``Runtime.costs``)."""
    runtime = runtime_of(levels)
    if runtime is None:
        return []
    _, busy = runtime.costs()
    return sorted(level_name(runtime.given[i].url) for i in busy)


# --------------------------------------------------------------------------- blocked time


def run_config(rank: int, config: str, rep: int, state: dict, args: dict) -> dict[str, Any]:
    """One configuration, one round, on this rank: ``saves`` iterations of a training
    step then a timed save; after the last save, the timed wait for its drains."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    import dcp_multilevel
    from dcp_multilevel import CheckpointManager, MultiLevelWriter

    base = Path(args["root"]) / f"r{rep}-{config}"
    levels = levels_for(base, config, args["remote_codec"]) if config != "stock" else []
    mgr = CheckpointManager(levels) if config == "manager" else None
    planner = DefaultSavePlanner(enable_plan_caching=True) if config == "stock" else None
    drains: list[dict[str, Any]] = []
    stop = None
    blocked: list[float] = []
    busy: list[list[str]] = []  # per save: the levels a drain of an earlier save was still on
    read_before = disk_read_bytes()
    for step in range(1, args["saves"] + 1):
        training_step(state, args["step_seconds"], args["step_kind"])
        busy.append(busy_levels(levels) if levels else [])
        dist.barrier()
        t0 = time.perf_counter()
        if config == "stock":
            writer = FileSystemWriter(str(base / f"step-{step}"), thread_count=1, sync_files=True)
            dcp.save(state, storage_writer=writer, planner=planner)
        elif mgr is not None:
            mgr.save(state, step=step)
        else:  # a new writer for every save, as training stacks build them
            dcp.save(state, storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
        blocked.append(time.perf_counter() - t0)
        if config == "stock" and rank == 0 and step > KEEP:  # keep 2, untimed
            remove_tree(base / f"step-{step - KEEP}")
        if stop is None and config in ("three-levels", "manager"):
            runtime = runtime_of(levels)  # made by the first save
            stop = runtime.listen(
                lambda r: drains.append(
                    {
                        "step": r.step,
                        "level": level_name(r.level),
                        "seconds": r.seconds,
                        "lag_s": r.lag_seconds,
                        "committed": r.committed,
                        "superseded": r.superseded,
                        "skipped": r.skipped,
                        "error": r.error,
                        "unix": time.time(),
                    }
                )
            )
    dist.barrier()
    t0 = time.perf_counter()
    if mgr is not None:
        mgr.wait()
    elif config != "stock":
        dcp_multilevel.wait()
    wait_s = time.perf_counter() - t0
    read_after = disk_read_bytes()
    if mgr is not None:
        mgr.close()
    if stop is not None:
        stop()
    dist.barrier()
    if rank == 0:  # every rank is done with these levels: the next config starts clean
        remove_tree(base)
    dist.barrier()
    return {
        "config": config,
        "round": rep,
        "rank": rank,
        "blocked": blocked,
        "busy": busy,
        "wait_s": wait_s,
        "drains": drains,
        # Storage reads of this rank over the round (saves and drains; the state's own
        # bytes, each drain reads from the first level, for comparison).
        "disk_read": None
        if read_before is None or read_after is None
        else read_after - read_before,
        "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
    }


def blocked_main(rank: int, world: int, args: dict) -> list[dict[str, Any]]:
    """Every configuration, ``repeat`` rounds, on this rank (run by ``run_ranks``)."""
    os.environ["DCP_ML_NODE"] = str(rank)  # one rank per simulated node
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    state = make_state(rank, args["mb"], args["seed"])
    out = []
    for rep, config in rounds(args["configs"], args["repeat"]):
        out.append(run_config(rank, config, rep, state, args))
        if rank == 0:
            b = out[-1]["blocked"]
            print(
                f"  round {rep + 1} {config}: blocked {', '.join(f'{x:.3f}' for x in b)} s; "
                f"wait {out[-1]['wait_s']:.3f} s",
                flush=True,
            )
    return out


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _size(fn: Any) -> int | None:
    try:
        return int(fn())
    except Exception:  # noqa: BLE001 - a book renamed: reported as not measured
        return None


def book_sizes(runtime: Any) -> dict[str, int | None]:
    """The entries of the runtime's books (None where one is not found): what it knows
    each level holds, the decisions and delta histories it keeps per step, the saves
    not yet followed up, the drains waiting, the outcomes it keeps; and the keys in
    the process group's c10d store (the runtime writes some per save)."""
    import torch.distributed as dist

    from dcp_multilevel.levels.runtime import runtimes

    h, chains, lanes = runtime.books, runtime.deltas, runtime.dispatcher.lanes
    return {
        "runtimes": _size(lambda: len(runtimes())),
        "holdings.known": _size(lambda: sum(map(len, h._known.values()))),
        "holdings.dropped": _size(lambda: sum(map(len, h._dropped.values()))),
        "holdings.decided": _size(lambda: len(h._decided)),
        "chains": _size(
            lambda: (
                sum(map(len, chains._history.values()))
                + sum(map(len, chains._gone.values()))
                + sum(map(len, chains._read.values()))
            )
        ),
        "commits.pending": _size(lambda: len(runtime.follower.pending())),
        "drains.waiting": _size(
            lambda: sum(
                len(lane.waiting) + (lane.running is not None) for lane in lanes._lanes.values()
            )
        ),
        "drains.results": _size(lambda: len(lanes.results)),
        "drains.unreported": _size(lambda: len(lanes._unreported)),
        "c10d store keys": _size(lambda: dist.distributed_c10d._get_default_store().num_keys()),
    }


def memory_main(rank: int, world: int, args: dict) -> list[dict[str, Any]]:
    """``mem_saves`` saves of a small state through the plugin with three levels; after
    the saves in ``points``: wait for the drains, collect, and sample the memory."""
    import torch.distributed.checkpoint as dcp

    import dcp_multilevel
    from dcp_multilevel import MultiLevelWriter

    os.environ["DCP_ML_NODE"] = str(rank)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    state = make_state(rank, args["mem_mb"], args["seed"])
    levels = levels_for(Path(args["root"]) / "memory", "three-levels", args["remote_codec"])
    points = set(args["points"])
    samples = []
    tracemalloc.start()
    t0 = time.perf_counter()
    for step in range(1, args["mem_saves"] + 1):
        nudge(state)
        dcp.save(state, storage_writer=MultiLevelWriter(f"step-{step}", levels=levels))
        if step in points:
            dcp_multilevel.wait()
            gc.collect()
            samples.append(
                {
                    "save": step,
                    "traced": tracemalloc.get_traced_memory()[0],
                    "rss": rss_bytes(),
                    "books": book_sizes(runtime_of(levels)),
                    "seconds": time.perf_counter() - t0,
                }
            )
            if rank == 0:
                s = samples[-1]
                print(
                    f"  memory: after save {step}: traced {s['traced'] / 1e6:.2f} MB, "
                    f"RSS {s['rss'] / 1e6:.1f} MB",
                    flush=True,
                )
    tracemalloc.stop()
    return samples

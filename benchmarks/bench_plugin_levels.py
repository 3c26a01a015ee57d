"""Levels through the plugin alone: what plain ``dcp.save`` with three levels blocks,
what ``dcp_multilevel.wait()`` costs after it, and the memory of 100 saves.

Two real ranks (processes, gloo; ``dcp_multilevel.testing.run_ranks``) on two
simulated nodes (``DCP_ML_NODE`` = the rank; each node's levels are its own
directories, ``{node}`` in the level paths), all on this machine's disk under
``--out``. Each rank holds a state of its own (``--mb`` MB of fp32, 256 by
default: 8 tensors of random normal values, a fixed seed per rank, keys of its
own, as sharded training holds them). Levels (``keep=2`` and ``every=1`` on
each):

* first level: ``Level(<root>/n{node}/l1)``, each node's own directory;
* partner copies: ``Level("partner:<root>/n{node}/partner")``: each rank's files
  copied to the other node over gloo on loopback;
* "remote": ``Level(<root>/remote, codec="bytegroup")`` (``--remote-codec``): a
  local directory standing in for object storage, so that what is measured is the
  drain's own cost (coding, writing, committing), not a network's or S3's.

**1. Blocked time.** A training-like loop, ``--saves`` iterations of: a training
step (``--step-seconds`` of sleep by default: the two ranks share two cores, so a
sleeping step leaves the CPU to the drains; ``--step-kind compute``: small
single-threaded tensor ops), long enough for the previous save's drains to
finish in the background (the table counts the saves that started while one
still ran: 0 when the step is long enough), then a timed save, ranks started
together (a barrier); blocked = that call, slowest rank. Four configurations,
each with fresh directories (removed after it, untimed), alternated in every
round (``--repeat`` rounds, order rotated):

* ``first-level``: ``dcp.save(state, storage_writer=MultiLevelWriter(f"step-{n}",
  levels=[first]))``, a new writer every save (as training stacks build them),
  its construction (collective) included in the time;
* ``three-levels``: the same with ``levels=[first, partner, remote]``: the save
  returns once the first level committed; the runtime drains it to the other
  two in the background;
* ``manager``: ``CheckpointManager([first, partner, remote]).save(state, step=n)``
  (one manager per round), the same drains through the manager;
* ``stock``, for reference: stock DCP's ``FileSystemWriter(<root>/step-<n>,
  thread_count=1, sync_files=True)`` (one copy, on the same disk) with one
  ``DefaultSavePlanner(enable_plan_caching=True)`` per round: its best
  configuration. Ours writes with ``thread_count=1`` too (the writer's default);
  the plugin's saves use DCP's default planner (stacks pass none), the manager
  its reused ``BalancedSavePlanner``. The stock loop deletes the step before the
  last two after each save, untimed (ours: retention, timed).

The first save of each configuration and round is not counted (it binds the
runtime of fresh levels: process groups, first use of the directories; DCP's plan
cache); its median is shown apart. Goal: ``three-levels`` blocks at most 1.1x
``first-level`` (ratio of the medians over every counted save of every round).

**2. wait().** Right after the last save of a round (its drains just started),
the time ``dcp_multilevel.wait()`` takes (``three-levels``; every runtime of the
process: the earlier rounds' are idle) against ``CheckpointManager.wait()``
after the same saves through the manager (``manager``): slowest rank, one sample
per round. Goal: the plugin's no more than the manager's (median ratio; within
5 %, this machine's noise).

**3. Memory.** Then, in two new ranks, ``--mem-saves`` (100) saves of a small
state (``--mem-mb``, 2 MB per rank) through the plugin with the same three levels,
a new writer each, back to back (the ``latest`` drain policy supersedes drains
that a newer save overtook). After saves 10, 50 and 100 (half of
``--mem-saves``, and the last): ``dcp_multilevel.wait()``, ``gc.collect()``, and
each rank's Python-level memory (``tracemalloc``, started before the first
save), its RSS, and the entries of the runtime's books (what it knows each level
holds, per-step decisions, delta histories, saves not followed up, drains
waiting, the drain outcomes it keeps: the newest 64) and the keys of the
process group's c10d store (the runtime writes a few per save there: the store
lives in the process that serves it, torchrun's agent or rank 0). Goal: memory
flat: the books the same size after save 50 and 100, and Python-level memory
growing by less than 1 KiB per save between them (one ticket, drain outcome or
manifest kept per save would be several KiB each).

Results: ``benchmarks/results/plugin_levels.json`` (``--results``; ``make tables``
renders it into ``docs/benchmarks.md``). The full run, on a quiet machine
(about 10 minutes on 2 cores)::

    python benchmarks/bench_plugin_levels.py

Quick check (about a minute; numbers from it are not figures)::

    python benchmarks/bench_plugin_levels.py --quick --results ''
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_results, add_seed, args_record, names, parser, quiet_dcp_warnings
from _disk import scratch_dir
from _measure import median, spread
from _plugin_levels_jobs import CONFIGS, LABELS, blocked_main, memory_main
from _report import (
    Results,
    figure,
    goal_line,
    markdown_table,
    measured,
    print_header,
    times,
)
from dcp_multilevel.levels.lanes import RESULTS_KEPT
from dcp_multilevel.testing.ranks import run_ranks

WORLD = 2  # ranks, one per simulated node
BLOCKED_GOAL = 1.05  # three levels / first level alone, median blocked seconds
WAIT_GOAL = 1.05  # plugin wait() / manager wait(), median (this machine's noise)
READ_GOAL = 0.10  # disk reads of a round / the bytes its drains read from the first level
GROWTH_GOAL = 1024  # bytes of Python-level memory per save, between the last two samples


# --------------------------------------------------------------------------- summaries


def merge(per_rank: list[list[dict]]) -> dict[str, list[dict]]:
    """Per configuration, its rounds: each save's slowest rank, the levels busy at a
    save's start on any rank, the slowest rank's wait, the drains of every rank."""
    out: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for recs in zip(*per_rank, strict=True):
        first = recs[0]
        out[first["config"]].append(
            {
                "round": first["round"],
                "blocked": [max(xs) for xs in zip(*(r["blocked"] for r in recs), strict=True)],
                "busy": [
                    sorted(set().union(*xs)) for xs in zip(*(r["busy"] for r in recs), strict=True)
                ],
                "wait_s": max(r["wait_s"] for r in recs),
                "disk_read": [r.get("disk_read") for r in recs],
                "state_bytes": [r.get("state_bytes") for r in recs],
                "drains": [d | {"rank": r["rank"]} for r in recs for d in r["drains"]],
            }
        )
    return out


def counted(rounds: list[dict], key: str = "blocked") -> list[float]:
    """Every save but each round's first."""
    return [x for r in rounds for x in r[key][1:]]


def cell(xs: list[float], digits: int = 3) -> str:
    return f"{median(xs):.{digits}f} ({spread(xs, digits)})" if xs else "n/a"


def blocked_table(runs: dict[str, list[dict]], configs: list[str]) -> str:
    rows = []
    for c in configs:
        rs = runs[c]
        saves = counted(rs)
        overlapped = sum(bool(b) for r in rs for b in r["busy"][1:])
        waits = [r["wait_s"] for r in rs] if c != "stock" else []
        rows.append(
            [
                LABELS[c],
                cell(saves),
                str(len(saves)),
                cell([r["blocked"][0] for r in rs]),
                f"{overlapped} of {len(saves)}" if c in ("three-levels", "manager") else "-",
                cell(waits) if waits else "-",
            ]
        )
    return markdown_table(
        [
            "configuration",
            "blocked per save, s: median (min to max)",
            "saves",
            "first save of a round, s (not counted)",
            "saves begun with a drain running",
            "wait() after the last save, s",
        ],
        rows,
    )


def drain_read_shares(rounds: list[dict]) -> list[float]:
    """Per round and rank: the bytes it read from storage over the round, as a share of
    the bytes its committed drains read from the first level (its state per drain)."""
    out = []
    for r in rounds:
        for rank, (read, size) in enumerate(zip(r["disk_read"], r["state_bytes"], strict=True)):
            drained = size * sum(
                1 for d in r["drains"] if d["rank"] == rank and d["committed"] and not d["skipped"]
            )
            if read is not None and drained:
                out.append(read / drained)
    return out


def drains_table(runs: dict[str, list[dict]]) -> str:
    """The drains' seconds (slowest rank per step and level), to check the step's length."""
    rows = []
    for c in ("three-levels", "manager"):
        by: dict[tuple[str, int, int], float] = {}
        superseded = 0
        for r in runs[c]:
            for d in r["drains"]:
                if d["superseded"]:
                    superseded += d["rank"] == 0
                    continue
                key = (d["level"], r["round"], d["step"])
                by[key] = max(by.get(key, 0.0), d["seconds"])
        for level in sorted({k[0] for k in by}):
            xs = [s for k, s in by.items() if k[0] == level]
            rows.append([LABELS[c], level, cell(xs, 2), str(len(xs))])
        if superseded:
            rows.append([LABELS[c], "superseded (a newer save overtook)", str(superseded), ""])
    return markdown_table(
        ["configuration", "level", "drain, s: median (min to max)", "drains"], rows
    )


def memory_table(mem: list[list[dict]]) -> str:
    rows = []
    for rank, samples in enumerate(mem):
        for s in samples:
            books = ", ".join(f"{k} {'n/a' if v is None else v}" for k, v in s["books"].items())
            rows.append(
                [
                    str(rank),
                    str(s["save"]),
                    f"{s['traced'] / 1e6:.3f}",
                    f"{s['rss'] / 1e6:.1f}",
                    books,
                ]
            )
    return markdown_table(["rank", "after save", "Python traced, MB", "RSS, MB", "books"], rows)


def growth(samples: list[dict], key: str, start: int = -2) -> float:
    """Bytes per save of ``key`` from sample ``start`` to the last."""
    a, b = samples[start], samples[-1]
    return (b[key] - a[key]) / max(1, b["save"] - a["save"])


def grown_books(samples: list[dict]) -> dict[str, tuple]:
    """The books (the c10d store aside) that grew between the last two samples:
    name -> (before, after). ``drains.results`` grows up to the newest
    ``RESULTS_KEPT`` outcomes, then stays: a run must be long enough to fill it."""
    a, b = samples[-2]["books"], samples[-1]["books"]
    return {
        k: (a[k], b[k])
        for k in a
        if k != "c10d store keys" and None not in (a[k], b[k]) and b[k] > a[k]
    }


def flat_books(samples: list[dict]) -> bool:
    """No book grew between the last two samples (the c10d store aside)."""
    return not grown_books(samples)


def books_detail(mem: list[list[dict]]) -> str:
    def entry(k: str, a: int, b: int) -> str:
        kept = f" (keeps the newest {RESULTS_KEPT})" if k == "drains.results" else ""
        return f"{k} {a} -> {b}{kept}"

    grown = [
        f"rank {rank}: " + ", ".join(entry(k, a, b) for k, (a, b) in g.items())
        for rank, m in enumerate(mem)
        if (g := grown_books(m))
    ]
    keys = [m[-1]["books"].get("c10d store keys") for m in mem]
    store = f"; c10d store keys {mem[0][-2]['books'].get('c10d store keys')} -> {keys[0]}"
    return ("books the same size" if not grown else "books grew: " + "; ".join(grown)) + store


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--mb", type=float, default=256, help="state per rank, MB of fp32; 256")
    p.add_argument(
        "--saves",
        type=int,
        default=6,
        help="saves per configuration and round (the first is not counted); 6",
    )
    p.add_argument(
        "--step-seconds", type=float, default=5.0, help="training step before each save, seconds; 5"
    )
    p.add_argument(
        "--step-kind",
        choices=("sleep", "compute"),
        default="sleep",
        help="the step: sleep (default) or small single-threaded tensor ops",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds over the configurations; 3")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"subset of: {', '.join(CONFIGS)}; default: all",
    )
    p.add_argument(
        "--remote-codec",
        default="bytegroup",
        help="the remote level's codec ('none' for none); bytegroup",
    )
    p.add_argument(
        "--mem-saves",
        type=int,
        default=100,
        help="saves of the memory measurement (sampled after 10, half, all); 100",
    )
    p.add_argument(
        "--mem-mb", type=float, default=2.0, help="state per rank of the memory measurement, MB; 2"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the levels' temporary directory goes (default: the system's, "
        "/tmp); it is removed afterwards",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds for each run of the ranks (and their collectives); 3600",
    )
    add_seed(p)
    add_results(p, "plugin_levels")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8 MB per rank, 2 rounds of 3 saves, 0.5 s steps, 40 saves of memory",
    )
    args = p.parse_args(argv)
    args.configs = names(p, args.configs, CONFIGS, "config", required=True)
    if args.quick:
        args.mb, args.saves, args.step_seconds, args.repeat = 8, 3, 0.5, 2
        args.mem_saves = 40
    if args.saves < 2 or args.repeat < 1 or args.mb <= 0 or args.step_seconds < 0:
        p.error("--saves must be >= 2, --repeat >= 1, --mb > 0, --step-seconds >= 0")
    if args.mem_saves and args.mem_saves < 10:
        p.error("--mem-saves must be 0 (none) or >= 10")
    args.remote_codec = None if args.remote_codec in ("", "none") else args.remote_codec
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_dcp_warnings()
    run = Results(__file__)
    t_start = time.perf_counter()
    points = sorted({10, args.mem_saves // 2, args.mem_saves}) if args.mem_saves else []
    with scratch_dir(None, "bench-plugin-levels-", parent=args.out) as root:
        print_header(__file__, root)
        payload = {
            "root": str(root),
            "mb": args.mb,
            "seed": args.seed,
            "saves": args.saves,
            "step_seconds": args.step_seconds,
            "step_kind": args.step_kind,
            "repeat": args.repeat,
            "configs": args.configs,
            "remote_codec": args.remote_codec,
            "mem_saves": args.mem_saves,
            "mem_mb": args.mem_mb,
            "points": points,
        }
        print(
            f"{WORLD} ranks on {WORLD} simulated nodes, {args.mb:g} MB per rank; "
            f"{args.repeat} round{'s' * (args.repeat != 1)} of {', '.join(args.configs)}",
            flush=True,
        )
        per_rank = run_ranks(blocked_main, WORLD, payload, timeout=args.timeout)
        mem = run_ranks(memory_main, WORLD, payload, timeout=args.timeout) if points else []
    runs = merge(per_rank)
    codec = args.remote_codec or "none"
    print()
    print("## Levels through the plugin: blocked time, wait(), memory")
    print()
    print(
        f"- state: {args.mb:g} MB fp32 per rank (8 tensors, random normal values, keys of "
        f"its own), {WORLD} ranks on {WORLD} simulated nodes (directories of one disk)"
    )
    print(
        f"- levels (keep=2, every=1): the node's first level; partner copies on the other "
        f"node (gloo on loopback); a folder standing in for the remote (codec {codec})"
    )
    print(
        f"- loop: {args.saves} saves per configuration and round (the first not counted), "
        f"each after a {args.step_seconds:g} s {args.step_kind} step; {args.repeat} "
        f"round{'s' * (args.repeat != 1)}, "
        "configurations alternated (order rotated); slowest rank per save"
    )
    print(f"- total runtime {time.perf_counter() - t_start:.0f} s")
    print()
    print(blocked_table(runs, args.configs))
    print()
    if any(runs[c] for c in ("three-levels", "manager")):
        print(drains_table(runs))
        print()
    if mem:
        print(
            f"Memory: {args.mem_saves} saves of {args.mem_mb:g} MB per rank through the "
            "plugin with the three levels, back to back; after each sampled save: "
            "dcp_multilevel.wait(), gc.collect()"
        )
        print()
        print(memory_table(mem))
        print()

    a, b = counted(runs["first-level"]), counted(runs["three-levels"])
    ratio = median(b) / median(a) if a and b else float("nan")
    per_round = [
        median(rb["blocked"][1:]) / median(ra["blocked"][1:])
        for ra, rb in zip(runs["first-level"], runs["three-levels"], strict=False)
    ]
    wp = [r["wait_s"] for r in runs["three-levels"]]
    wm = [r["wait_s"] for r in runs["manager"]]
    wait_ratio = median(wp) / median(wm) if wp and wm else float("nan")
    print("### Goals")
    print()
    print(
        goal_line(
            ratio <= BLOCKED_GOAL if measured(ratio) else None,
            f"dcp.save with three levels blocks at most {BLOCKED_GOAL}x the first level alone",
            f"median {times(ratio)} ({median(b):.3f} s / {median(a):.3f} s); per round "
            + (", ".join(times(x) for x in per_round) or "n/a"),
        )
    )
    print(
        goal_line(
            wait_ratio <= WAIT_GOAL if measured(wait_ratio) else None,
            "dcp_multilevel.wait() after the last save costs no more than CheckpointManager.wait()",
            f"median {times(wait_ratio)} ({median(wp):.3f} s / {median(wm):.3f} s; "
            f"<= {WAIT_GOAL}x: this machine's noise)",
        )
    )
    shares = drain_read_shares(runs["three-levels"] + runs["manager"])
    print(
        goal_line(
            max(shares) <= READ_GOAL if shares else None,
            f"drains read the first level from the page cache: the disk reads of a round are "
            f"at most {READ_GOAL:.0%} of the bytes its drains read",
            ", ".join(f"{x:.1%}" for x in shares) + " (per round and rank; /proc/self/io "
            "read_bytes)"
            if shares
            else "not measured (no /proc/self/io)",
        )
    )
    growths = [growth(m, "traced") for m in mem]
    if mem:
        ok = all(flat_books(m) for m in mem) and max(growths) < GROWTH_GOAL
        print(
            goal_line(
                ok,
                f"memory flat over {args.mem_saves} saves",
                f"Python-level growth per save from save {mem[0][-2]['save']} to "
                f"{mem[0][-1]['save']}: "
                + ", ".join(f"{g:.0f} B" for g in growths)
                + f" (ranks; < {GROWTH_GOAL} B); RSS "
                + ", ".join(f"{growth(m, 'rss') / 1024:.1f} KiB" for m in mem)
                + "; "
                + books_detail(mem),
            )
        )
    else:
        print(goal_line(None, "memory flat", "not measured (--mem-saves 0)"))
    busy = sum(bool(x) for r in runs["three-levels"] + runs["manager"] for x in r["busy"][1:])
    if busy:
        print(
            f"\nWARNING: {busy} counted saves began while a drain of an earlier save still "
            "ran: a longer --step-seconds lets the drains finish first."
        )

    figures = {}
    for c in args.configs:
        if runs[c]:
            figures[f"{c}.blocked_s"] = figure(counted(runs[c]), "s")
            figures[f"{c}.first_save_s"] = figure([r["blocked"][0] for r in runs[c]], "s")
            if c != "stock":
                figures[f"{c}.wait_s"] = figure([r["wait_s"] for r in runs[c]], "s")
    if per_round:
        figures["three-levels.blocked_ratio"] = figure(per_round, "x")
    if shares:
        figures["drains.disk_read_share"] = figure(shares, "x")
    figures["state_bytes"] = figure([int(args.mb * 1e6) // 4 // 8 * 4 * 8], "B")
    if mem:
        figures["memory.traced_per_save"] = figure(growths, "B")
        figures["memory.rss_per_save"] = figure([growth(m, "rss") for m in mem], "B")
        figures["memory.saves"] = figure([args.mem_saves], "saves")
        figures["memory.books_flat"] = figure([float(flat_books(m)) for m in mem], "bool")
    run.write(
        args.results,
        figures=figures,
        alternated=args.configs,
        rounds=args.repeat,
        data={"args": args_record(args), "runs": runs, "memory": mem},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

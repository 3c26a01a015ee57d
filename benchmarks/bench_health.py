"""What the health checks cost a save: checks on against checks off, and stock DCP.

Every save runs health checks by default (``docs/health.md``): the writer counts
NaN and infinity in each floating-point item as it hashes (raw) or codes it
(``nonfinite``), judges the loss given with the save (``loss``), and
``BalancedSavePlanner(verify_replicas=True)`` hashes every item on every rank in
its local plan so that the coordinator can compare the copies of replicated
items (``replicas``; it turns DCP's plan caching off). This benchmark measures
what that costs, in blocked time and in CPU.

Two real ranks (processes, gloo; ``dcp_multilevel.testing.run_ranks``), data
parallel with the optimizer state sharded (ZeRO-1, as
``ZeroRedundancyOptimizer`` shards it): a GPT-like model (``d=1024``, a 32,768-word
embedding, as many layers as ``--gb`` asks; ``--gb`` 1.5 GB of unique state by
default) whose weights every rank holds, the same bytes on both (the replicated
part); AdamW's ``exp_avg`` and ``exp_avg_sq`` of each parameter on one rank
only (parameters given, largest first, to the rank holding fewer bytes).
``--weights fp32`` (default): fp32 weights and moments, 12 bytes per parameter, a
third of them replicated; ``--weights bf16``: bf16 weights replicated and an fp32
master copy sharded with the moments (mixed precision, 14 bytes per parameter).
Random normal values, a fixed seed (weights 0.02 std, moments 1e-3 and its
square). Before each save a tiny in-place update of every tensor, the same on
both ranks, so every checkpoint differs.

Configurations, alternated in every round (``--repeat`` rounds, order rotated),
each with fresh directories, every save with fsync, one writing thread per rank:

* ``on``: ``dcp.save(state, storage_writer=MultiLevelWriter(path, loss=...),
  planner=planner)`` with one ``BalancedSavePlanner()`` per round: every check at
  its default (``Checks()``, one per round; a loss is given with each save);
* ``off``: the same with ``checks=Checks.off()`` and
  ``BalancedSavePlanner(verify_replicas=False)`` (which gives back DCP's plan
  caching);
* ``writer-checks``: the writer's checks only (``Checks()``, ``verify_replicas=False``);
* ``replica-check``: the planner's replica check only (``Checks.off()``,
  ``verify_replicas=True``);
* ``stock``, for reference: ``FileSystemWriter(path, thread_count=1,
  sync_files=True)`` with one ``DefaultSavePlanner(enable_plan_caching=True)``
  per round, reused by every save: stock DCP's best;
* ``async-on`` / ``async-off``: ``dcp.async_save(state, storage_writer=writer,
  checkpoint_id=path, planner=planner)``, one writer (its staging buffers reused)
  and one planner per round, checks as ``on`` / ``off``; blocked = until
  ``async_save`` returns (the state is copied before it does: the default
  staging), done = until its future completes (waited at once, no training step);
* ``coded-on`` / ``coded-off``: ``on`` / ``off`` with ``codec=`` ``--codec``
  (``bytegroup``): the count runs on the coding thread, chunk by chunk.

Each configuration makes ``--saves`` saves per round; the first is a warm-up and
is not counted (first use of the directories, DCP's plan cache, the staging
buffers; its median is shown apart). The ranks start each save together (a
barrier); blocked = the slowest rank's call. CPU per save = user + system
seconds (``getrusage(RUSAGE_SELF)``: every thread of the rank's process, the
writing and async threads included) from the call until it returned (sync) or
its future completed (async), summed over both ranks. Not in it: the kernel's
own write-back threads (stock writes through the page cache, ours past it with
``O_DIRECT`` where it can). Each save's files are deleted right after it (rank 0,
then a sync), outside the timed region and the CPU count.

The checks' own CPU share = (CPU on - CPU off) / CPU off, the medians of each
round's counted saves, one sample per round; the figure is their median. Goals:
at most 10 % (``on`` against ``off``; the same for async and coded), and blocked
time unchanged within this machine's noise (median ratio at most 1.05). Then, on
each rank, outside the saves, the two passes the checks add, timed alone over
every tensor it holds: xxh3 of each whole item (the replica check's extra pass
in ``create_local_plan``) and the non-finite count in 1 MiB slices (fused with
the writer's own hash in a save).

Results: ``benchmarks/results/health.json`` (``--results``). The full run, on a
quiet machine (about 10 minutes on 2 cores)::

    python benchmarks/bench_health.py

Quick check (about a minute; numbers from it are not figures)::

    python benchmarks/bench_health.py --quick --results ''
"""

from __future__ import annotations

import argparse
import gc
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli import add_results, add_seed, args_record, names, parser, quiet_dcp_warnings
from _disk import remove_tree, scratch_dir
from _measure import GB, median, rounds, spread
from _report import (
    Results,
    figure,
    goal_line,
    markdown_table,
    measured,
    print_header,
    times,
)
from dcp_multilevel.testing.ranks import run_ranks

WORLD = 2  # data-parallel ranks
CPU_GOAL = 0.10  # the checks' CPU / a save's CPU with them off
BLOCKED_NOISE = 1.05  # blocked on / off, median: this machine's noise
MIB = 1 << 20


@dataclass(frozen=True)
class Config:
    """One configuration: how it saves and which checks run."""

    label: str
    mode: str  # "sync", "async" or "stock"
    writer_checks: bool = False  # Checks() (else Checks.off())
    replicas: bool = False  # BalancedSavePlanner(verify_replicas=...)
    coded: bool = False  # MultiLevelWriter(codec=--codec)


CONFIGS: dict[str, Config] = {
    "on": Config("`dcp.save`, checks on (defaults)", "sync", True, True),
    "off": Config("`dcp.save`, checks off", "sync"),
    "writer-checks": Config("`dcp.save`, writer's checks only (nonfinite, loss)", "sync", True),
    "replica-check": Config("`dcp.save`, replica check only", "sync", False, True),
    "stock": Config("`dcp.save`, stock `FileSystemWriter` (plan caching)", "stock"),
    "async-on": Config("`dcp.async_save`, checks on", "async", True, True),
    "async-off": Config("`dcp.async_save`, checks off", "async"),
    "coded-on": Config("`dcp.save`, codec, checks on", "sync", True, True, coded=True),
    "coded-off": Config("`dcp.save`, codec, checks off", "sync", coded=True),
}
#: (name, checks on, checks off): the comparisons the goals are about, then the parts.
PAIRS = (
    ("checks", "on", "off"),
    ("async-checks", "async-on", "async-off"),
    ("coded-checks", "coded-on", "coded-off"),
    ("writer-checks", "writer-checks", "off"),
    ("replica-check", "replica-check", "off"),
)
#: The pairs with goals (the parts attribute the cost; they have none of their own).
GOAL_PAIRS = ("checks", "async-checks", "coded-checks")


# --------------------------------------------------------------------------- state


def layout(gb: float, weights: str) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters (name, shape): a GPT-like stack of ``d=1024`` with a
    32,768-word embedding, as many layers as make ``gb`` GB of unique state (12
    bytes per parameter with fp32 weights, 14 with bf16 weights and fp32 master
    copies); ``d`` and the vocabulary halve for states too small for one layer."""
    params = gb * GB / (12 if weights == "fp32" else 14)
    d, vocab = 1024, 32768
    while d > 64 and vocab * d + 12 * d * d > params:
        d, vocab = d // 2, vocab // 2
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((params - vocab * d) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)),
            (p + "attn.proj.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc.weight", (4 * d, d)),
            (p + "mlp.fc.bias", (4 * d,)),
            (p + "mlp.proj.weight", (d, 4 * d)),
            (p + "mlp.proj.bias", (d,)),
        ]
    return [*shapes, ("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def owners(shapes: list[tuple[str, tuple[int, ...]]], world: int) -> dict[str, int]:
    """Which rank holds each parameter's optimizer state: largest first, to the rank
    holding the fewest elements so far (as ``ZeroRedundancyOptimizer`` partitions)."""
    load = [0] * world
    out = {}
    for name, shape in sorted(shapes, key=lambda s: -numel(s[1])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += numel(shape)
    return out


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_state(rank: int, world: int, gb: float, weights: str, seed: int) -> dict[str, Any]:
    """This rank's state: ``{"model": {...}, "optim": {"state": {name: {...}}}}``,
    the model's weights the same on every rank, the optimizer state of the
    parameters this rank owns (:func:`owners`)."""
    shapes = layout(gb, weights)
    own = owners(shapes, world)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)  # the same on every rank
        w = torch.randn(shape, generator=g).mul_(0.02)
        mine = own[name] == rank
        entry: dict[str, torch.Tensor] = {}
        if weights == "bf16":
            model[name] = w.to(torch.bfloat16)
            if mine:
                entry["master"] = w
        else:
            model[name] = w
        if mine:
            entry["exp_avg"] = torch.randn(shape, generator=g).mul_(1e-3)
            entry["exp_avg_sq"] = torch.randn(shape, generator=g).mul_(1e-3).square_()
            optim[name] = entry
    return {"model": model, "optim": {"state": optim}}


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a state, in order."""
    out = []
    for v in state.values():
        out += tensors(v) if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else []
    return out


def nudge(state: dict[str, Any]) -> None:
    """A tiny in-place update of every tensor, the same on every rank."""
    with torch.no_grad():
        for t in tensors(state):
            t.view(-1)[:256].add_(1e-3)


# --------------------------------------------------------------------------- the ranks


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def run_config(rank: int, name: str, rep: int, state: dict, args: dict) -> dict[str, Any]:
    """One configuration, one round, on this rank: ``saves`` timed saves."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    from dcp_multilevel import BalancedSavePlanner, Checks, MultiLevelWriter

    cfg = CONFIGS[name]
    base = Path(args["root"]) / f"r{rep}-{name}"
    codec = args["codec"] if cfg.coded else None
    checks = Checks() if cfg.writer_checks else Checks.off()  # one per round: the loss rule
    if cfg.mode == "stock":
        planner: Any = DefaultSavePlanner(enable_plan_caching=True)
    else:
        planner = BalancedSavePlanner(verify_replicas=cfg.replicas)
    writer = None
    if cfg.mode == "async":  # one writer per round: its staging buffers reused
        writer = MultiLevelWriter(base / "unused", checks=checks, codec=codec)
    recs: list[dict[str, Any]] = []
    checked: list[str] | None = None
    for n in range(args["saves"]):
        nudge(state)
        loss = 2.5 - 0.01 * (rep * args["saves"] + n)  # a training loss, finite, no spike
        path = base / f"step-{n}"
        gc.collect()
        dist.barrier()
        u0, s0 = cpu_seconds()
        t0 = time.perf_counter()
        done = None
        if cfg.mode == "stock":
            w = FileSystemWriter(str(path), thread_count=1, sync_files=True)
            dcp.save(state, storage_writer=w, planner=planner)
            blocked = time.perf_counter() - t0
        elif cfg.mode == "sync":  # a new writer for every save, as training stacks build them
            w = MultiLevelWriter(path, checks=checks, codec=codec, loss=loss)
            dcp.save(state, storage_writer=w, planner=planner)
            blocked = time.perf_counter() - t0
        else:
            assert writer is not None
            w = writer
            w.loss = loss
            r = dcp.async_save(state, storage_writer=w, checkpoint_id=path, planner=planner)
            blocked = time.perf_counter() - t0
            getattr(r, "upload_completion", r).result()
            done = time.perf_counter() - t0
        u1, s1 = cpu_seconds()
        if rank == 0 and checked is None and cfg.mode != "stock":
            health = getattr(w, "health", None)
            checked = list(health.checked) if health is not None else []
        recs.append({"blocked": blocked, "done": done, "user": u1 - u0, "sys": s1 - s0})
        dist.barrier()
        if rank == 0:  # untimed: every rank is done with it
            remove_tree(path)
    if writer is not None:
        writer.close()
    dist.barrier()
    if rank == 0:
        remove_tree(base)
    return {"config": name, "round": rep, "rank": rank, "saves": recs, "checked": checked}


def pass_costs(state: dict[str, Any], repeat: int = 3) -> dict[str, float]:
    """CPU seconds of the checks' two passes over every tensor this rank holds, each
    alone (best of ``repeat``): xxh3 of each whole item (the replica check's pass)
    and the non-finite count in 1 MiB slices (the writer's, fused with its hash)."""
    import xxhash

    from dcp_multilevel.health import NATIVE, count, rule_for

    views = []
    for t in tensors(state):
        b = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        views.append((memoryview(b), rule_for(t.dtype)))

    def xxh3() -> None:
        for v, _ in views:
            xxhash.xxh3_64_hexdigest(v)

    def nonfinite() -> None:
        for v, rule in views:
            if rule is not None:
                for off in range(0, len(v), MIB):
                    count(v[off : off + MIB], rule)

    def best(fn: Any) -> float:
        out = []
        for _ in range(repeat):
            t0 = time.process_time()
            fn()
            out.append(time.process_time() - t0)
        return min(out)

    held = sum(len(v) for v, _ in views)
    return {
        "bytes": held,
        "xxh3_s": best(xxh3),
        "nonfinite_s": best(nonfinite),
        "native": float(NATIVE),
    }


def rank_main(rank: int, world: int, args: dict) -> dict[str, Any]:
    """Every configuration, ``repeat`` rounds, then the passes (run by ``run_ranks``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    state = make_state(rank, world, args["gb"], args["weights"], args["seed"])
    out = []
    for rep, name in rounds(args["configs"], args["repeat"]):
        out.append(run_config(rank, name, rep, state, args))
        if rank == 0:
            blocked = ", ".join(f"{x['blocked']:.3f}" for x in out[-1]["saves"])
            cpu = ", ".join(f"{x['user'] + x['sys']:.2f}" for x in out[-1]["saves"])
            print(
                f"  round {rep + 1} {name}: blocked {blocked} s; CPU {cpu} s (rank 0)", flush=True
            )
    held = sum(t.numel() * t.element_size() for t in tensors(state))
    return {"runs": out, "passes": pass_costs(state), "held_bytes": held}


# --------------------------------------------------------------------------- summaries


def merge(per_rank: list[list[dict]]) -> dict[str, list[dict]]:
    """Per configuration, its rounds: per save the slowest rank's blocked and done
    times and both ranks' CPU seconds summed."""
    out: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for recs in zip(*per_rank, strict=True):
        first = recs[0]
        saves = list(zip(*(r["saves"] for r in recs), strict=True))
        out[first["config"]].append(
            {
                "round": first["round"],
                "blocked": [max(x["blocked"] for x in s) for s in saves],
                "done": [max(x["done"] for x in s) for s in saves]
                if first["saves"][0]["done"] is not None
                else [],
                "cpu": [sum(x["user"] + x["sys"] for x in s) for s in saves],
                "sys": [sum(x["sys"] for x in s) for s in saves],
                "checked": first["checked"],
            }
        )
    return out


def counted(rounds_: list[dict], key: str) -> list[float]:
    """Every save but each round's first."""
    return [x for r in rounds_ for x in r[key][1:]]


def cell(xs: list[float], digits: int = 3) -> str:
    return f"{median(xs):.{digits}f} ({spread(xs, digits)})" if xs else "n/a"


def per_round(runs: dict[str, list[dict]], on: str, off: str, key: str) -> list[float]:
    """Per round: median(on's counted saves) / median(off's)."""
    return [
        median(a[key][1:]) / median(b[key][1:]) for a, b in zip(runs[on], runs[off], strict=False)
    ]


def share(ratios: list[float]) -> str:
    return ", ".join(f"{x - 1:+.1%}" for x in ratios) or "n/a"


def saves_table(runs: dict[str, list[dict]], configs: list[str]) -> str:
    cpu_off = {
        on: median(counted(runs[off], "cpu")) for _, on, off in PAIRS if runs[on] and runs[off]
    }
    rows = []
    for c in configs:
        rs = runs[c]
        cpu = counted(rs, "cpu")
        vs = f"{median(cpu) / cpu_off[c] - 1:+.1%}" if c in cpu_off else "-"
        done = counted(rs, "done") if CONFIGS[c].mode == "async" else []
        rows.append(
            [
                CONFIGS[c].label,
                cell(counted(rs, "blocked")),
                str(len(counted(rs, "blocked"))),
                cell(done) if done else "-",
                cell(cpu, 2),
                f"{median(counted(rs, 'sys')):.2f}",
                vs,
                cell([r["blocked"][0] for r in rs]),
                ", ".join(rs[0]["checked"] or ["-"]) if rs[0]["checked"] is not None else "-",
            ]
        )
    return markdown_table(
        [
            "configuration",
            "blocked per save, s: median (min to max)",
            "saves",
            "until done (async), s",
            "CPU per save, s, 2 ranks: median (min to max)",
            "of it system, s",
            "CPU vs checks off",
            "first save, s (not counted)",
            "checks recorded",
        ],
        rows,
    )


def pairs_table(runs: dict[str, list[dict]]) -> str:
    rows = []
    for name, on, off in PAIRS:
        if not (runs[on] and runs[off]):
            continue
        cpu, blk = per_round(runs, on, off, "cpu"), per_round(runs, on, off, "blocked")
        c_on, c_off = median(counted(runs[on], "cpu")), median(counted(runs[off], "cpu"))
        b_on, b_off = median(counted(runs[on], "blocked")), median(counted(runs[off], "blocked"))
        rows.append(
            [
                f"{name}: {on} / {off}",
                f"{c_on - c_off:+.3f}",
                f"{median(cpu) - 1:+.1%}",
                share(cpu),
                times(b_on / b_off),
                ", ".join(times(x) for x in blk),
            ]
        )
    return markdown_table(
        [
            "checks on / off",
            "CPU s per save (2 ranks)",
            "checks' CPU share: median",
            "per round",
            "blocked on / off: all saves",
            "per round",
        ],
        rows,
    )


def passes_table(passes: list[dict[str, float]]) -> str:
    rows = []
    for rank, p in enumerate(passes):
        gb = p["bytes"] / GB
        rows.append(
            [
                str(rank),
                f"{gb:.3f}",
                f"{p['xxh3_s']:.3f} ({gb / p['xxh3_s']:.1f} GB/s)",
                f"{p['nonfinite_s']:.3f} ({gb / p['nonfinite_s']:.1f} GB/s)",
            ]
        )
    return markdown_table(
        [
            "rank",
            "GB held",
            "xxh3 of every item, CPU s (replica check)",
            "non-finite count, 1 MiB slices, CPU s",
        ],
        rows,
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--gb",
        type=float,
        default=1.5,
        help="unique state, GB (model weights + AdamW moments); 1.5",
    )
    p.add_argument(
        "--weights",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 weights (default), or bf16 weights + fp32 master copies",
    )
    p.add_argument(
        "--saves",
        type=int,
        default=4,
        help="saves per configuration and round (the first is not counted); 4",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds over the configurations; 3")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"subset of: {', '.join(CONFIGS)}; default: all",
    )
    p.add_argument("--codec", default="bytegroup", help="the coded configurations' codec")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the checkpoints' temporary directory goes (default: the "
        "system's, /tmp); it is removed afterwards",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds for the run of the ranks (and their collectives); 3600",
    )
    add_seed(p)
    add_results(p, "health")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.1 GB, 2 rounds of 3 saves")
    args = p.parse_args(argv)
    args.configs = names(p, args.configs, list(CONFIGS), "config", required=True)
    if args.quick:
        args.gb, args.saves, args.repeat = 0.1, 3, 2
    if args.saves < 2 or args.repeat < 1 or args.gb <= 0:
        p.error("--saves must be >= 2, --repeat >= 1, --gb > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_dcp_warnings()
    run = Results(__file__)
    t_start = time.perf_counter()
    shapes = layout(args.gb, args.weights)
    nparams = sum(numel(s) for _, s in shapes)
    per_param = 12 if args.weights == "fp32" else 14
    replicated = nparams * (4 if args.weights == "fp32" else 2)
    with scratch_dir(None, "bench-health-", parent=args.out) as root:
        print_header(__file__, root)
        payload = {
            "root": str(root),
            "gb": args.gb,
            "weights": args.weights,
            "seed": args.seed,
            "saves": args.saves,
            "repeat": args.repeat,
            "configs": args.configs,
            "codec": args.codec,
        }
        print(
            f"{WORLD} ranks, {nparams / 1e6:.1f} M parameters, {nparams * per_param / GB:.2f} "
            f"GB of state; {args.repeat} round{'s' * (args.repeat != 1)} of "
            f"{', '.join(args.configs)}",
            flush=True,
        )
        out = run_ranks(rank_main, WORLD, payload, timeout=args.timeout)
    runs = merge([o["runs"] for o in out])
    passes = [o["passes"] for o in out]
    held = [o["held_bytes"] for o in out]
    layers = sum(n.endswith("mlp.fc.weight") for n, _ in shapes)
    print()
    print("## Health checks: what they cost a save")
    print()
    print(
        f"- state: {nparams * per_param / GB:.2f} GB, a GPT-like model of "
        f"{nparams / 1e6:.1f} M parameters ({layers} layers, d={shapes[0][1][1]}) + AdamW; "
        f"{args.weights} weights replicated on both ranks ({replicated / GB:.2f} GB), "
        + ("fp32 master copies, " if args.weights == "bf16" else "")
        + "exp_avg and exp_avg_sq (fp32) sharded by parameter (ZeRO-1); each rank holds "
        + " / ".join(f"{h / GB:.2f}" for h in held)
        + " GB"
    )
    print(
        f"- {WORLD} gloo ranks on this machine; every save with fsync, one writing thread "
        f"per rank; codec of the coded configurations: {args.codec}"
    )
    print(
        f"- {args.saves} saves per configuration and round (the first not counted), "
        f"{args.repeat} round{'s' * (args.repeat != 1)}, configurations alternated (order "
        "rotated); blocked: the slowest rank; CPU: user + system of both ranks' processes "
        "(getrusage, every thread) until the save returned (async: its future completed)"
    )
    print(f"- non-finite count: {'native kernel' if passes[0]['native'] else 'numpy fallback'}")
    print(f"- total runtime {time.perf_counter() - t_start:.0f} s")
    print()
    print(saves_table(runs, args.configs))
    print()
    print(pairs_table(runs))
    print()
    print("The checks' two passes, each alone over every tensor a rank holds (best of 3):")
    print()
    print(passes_table(passes))
    print()

    print("### Goals")
    print()
    figures: dict[str, dict] = {}
    for name, on, off in PAIRS:
        if not (runs[on] and runs[off]):
            if name in GOAL_PAIRS:
                print(goal_line(None, f"{name}: {on} / {off}", "not measured (--configs)"))
            continue
        cpu, blk = per_round(runs, on, off, "cpu"), per_round(runs, on, off, "blocked")
        figures[f"{name}.cpu_share"] = figure([x - 1 for x in cpu], "share")
        figures[f"{name}.blocked_ratio"] = figure(blk, "x")
        if name not in GOAL_PAIRS:
            continue
        s = median(cpu) - 1
        c_on, c_off = median(counted(runs[on], "cpu")), median(counted(runs[off], "cpu"))
        print(
            goal_line(
                s <= CPU_GOAL if measured(s) else None,
                f"the checks' own CPU at most {CPU_GOAL:.0%} of a save's ({on} / {off})",
                f"median {s:+.1%} over rounds ({share(cpu)}); {c_on:.2f} s against {c_off:.2f} s "
                "per save, 2 ranks",
            )
        )
        b_on, b_off = median(counted(runs[on], "blocked")), median(counted(runs[off], "blocked"))
        ratio = b_on / b_off
        own = [median(r["blocked"][1:]) for r in runs[off]]
        print(
            goal_line(
                ratio <= BLOCKED_NOISE if measured(ratio) else None,
                f"blocked time unchanged within noise ({on} / {off}, <= {BLOCKED_NOISE}x)",
                f"median {times(ratio)} ({b_on:.3f} s / {b_off:.3f} s); per round "
                f"{', '.join(times(x) for x in blk)}; {off}'s own round medians "
                f"{spread(own, 3)} s",
            )
        )

    for c in args.configs:
        if runs[c]:
            figures[f"{c}.blocked_s"] = figure(counted(runs[c], "blocked"), "s")
            figures[f"{c}.first_save_s"] = figure([r["blocked"][0] for r in runs[c]], "s")
            figures[f"{c}.cpu_s"] = figure(counted(runs[c], "cpu"), "s")
            if CONFIGS[c].mode == "async":
                figures[f"{c}.done_s"] = figure(counted(runs[c], "done"), "s")
    figures["state_bytes"] = figure([nparams * per_param], "B")
    figures["replicated_bytes"] = figure([replicated], "B")
    figures["passes.xxh3_gbps"] = figure([p["bytes"] / GB / p["xxh3_s"] for p in passes], "GB/s")
    figures["passes.nonfinite_gbps"] = figure(
        [p["bytes"] / GB / p["nonfinite_s"] for p in passes], "GB/s"
    )
    run.write(
        args.results,
        figures=figures,
        alternated=args.configs,
        rounds=args.repeat,
        data={"args": args_record(args), "runs": runs, "passes": passes, "held_bytes": held},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

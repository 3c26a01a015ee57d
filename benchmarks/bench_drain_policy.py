"""What each drain policy costs the training loop, and what reaches the remote.

One process, no process group. A loop of ``--saves`` saves of the same fp32
state (``--mb`` MB of random values, a fixed seed), ``--step-seconds`` of
training between two saves (``--step-kind sleep`` by default: the drain gets the
CPU it would get on a machine with cores to spare; ``ops``: small single-threaded
tensor ops), to ``CheckpointManager([Level(<disk>/l1, keep=2), Level(<remote>,
keep=3)])`` where the remote is ``throttled://`` (``_remotes.py``) at
``--remote-mbps`` MB/s in /dev/shm, so that saves come faster than drains.
Each policy (``latest``, the default; ``skip``; ``wait``) runs the same loop,
alternated over ``--repeat`` rounds (a new manager and new directories each time).

Per policy: the time ``save()`` blocked the loop (``SaveMetrics.blocked_seconds +
waited_seconds``: the first level's commit, retention, and under ``wait`` the
wait for the previous drain), median and spread over every save of every
round, over the saves that ran while a drain did (from the drain records'
times), and of it the manager's own work (``waited_seconds``: retention, the
drain decision); how long the final ``wait()`` took; whether the last step reached the
remote, and how many of the due steps did; the lag of the last step (its
first-level commit -> its remote commit: the time a lost node would have cost
it).

Goal: ``save()`` blocks no longer under ``latest`` than under ``skip``
(median ratio), and the last step always reaches the remote.

Quick check::

    python benchmarks/bench_drain_policy.py --quick
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _remotes  # noqa: F401 - registers throttled://
from _cli import add_json, add_seed, args_record, parser, quiet_dcp_warnings
from _disk import remove_tree, scratch_dir
from _measure import cpu_snapshot, median, other_cpu_fraction, rounds, spread
from _report import goal_line, markdown_table, print_header
from dcp_multilevel import CheckpointManager, Level

POLICIES = ("latest", "skip", "wait")


def make_state(mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 8
    per = mb * 1_000_000 // 4 // n
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def train_step(state: dict[str, torch.Tensor], seconds: float, kind: str) -> None:
    for t in state.values():
        t[:1024].add_(1e-3)  # every checkpoint differs
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    x = torch.randn(64, 64)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x) * 0.5


def run_loop(policy: str, root: Path, shm: Path, args, state) -> dict:
    l1 = root / f"l1-{uuid.uuid4().hex[:6]}"
    remote_dir = shm / f"remote-{uuid.uuid4().hex[:6]}"
    remote = Level(f"throttled://{remote_dir}", keep=3, storage_options={"mbps": args.remote_mbps})
    mgr = CheckpointManager(
        [Level(str(l1), keep=2), remote],
        drain_policy=policy,
        on_metrics=lambda r: r["kind"] == "drain" and drains.append(r),
    )
    blocked: list[float] = []
    waited: list[float] = []  # of blocked, the manager's own work (retention, decisions)
    spans: list[tuple[float, float]] = []  # each save's wall-clock start and end
    drains: list[dict] = []  # the drain records (metrics), for when each drain ran
    due: list[int] = []
    try:
        for step in range(1, args.saves + 1):
            train_step(state, args.step_seconds, args.step_kind)
            t0 = time.time()
            m = mgr.save(state, step=step)
            spans.append((t0, time.time()))
            blocked.append(m.blocked_seconds + m.waited_seconds)
            waited.append(m.waited_seconds)
            if remote.url in m.drains_started:
                due.append(step)
        t0 = time.perf_counter()
        mgr.wait()
        final_wait = time.perf_counter() - t0
        results = [r for r in mgr.drain_results if r.level == remote.url]
        committed = sorted(r.step for r in results if r.committed)
        last = [r for r in results if r.step == args.saves and r.committed]
        ran = [(r["unix"] - r["seconds"], r["unix"]) for r in drains if r["seconds"] > 0]
        overlaps = [any(a < end and start < b for a, b in ran) for start, end in spans]
        return {
            "policy": policy,
            "blocked": blocked,
            "waited": waited,
            "overlaps": overlaps,
            "final_wait": final_wait,
            "committed": committed,
            "superseded": sorted(r.step for r in results if r.superseded),
            "skipped": sorted(r.step for r in results if r.skipped),
            "last_on_remote": bool(last),
            "last_lag": last[0].lag_seconds if last else float("nan"),
        }
    finally:
        mgr.close()
        remove_tree(l1)
        remove_tree(remote_dir)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mb", type=int, default=128, help="state size in MB (default 128)")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--step-seconds", type=float, default=0.2)
    p.add_argument("--step-kind", choices=("sleep", "ops"), default="sleep")
    p.add_argument("--remote-mbps", type=float, default=200.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", type=Path, default=None, help="scratch dir for L1 (disk)")
    p.add_argument("--quick", action="store_true", help="--mb 32 --saves 5 --repeat 2")
    add_seed(p)
    add_json(p)
    args = p.parse_args()
    if args.quick:
        args.mb, args.saves, args.repeat = 32, 5, 2
    quiet_dcp_warnings()
    logging.getLogger("dcp_multilevel").setLevel(logging.ERROR)
    state = make_state(args.mb, args.seed)
    runs: dict[str, list[dict]] = defaultdict(list)
    with (
        scratch_dir(args.root, "bench-drain-policy-") as root,
        scratch_dir(None, "bench-drain-policy-", parent=Path("/dev/shm")) as shm,
    ):
        print_header(__file__, root)
        before = cpu_snapshot()
        for rep, policy in rounds(POLICIES, args.repeat):
            run = run_loop(policy, root, shm, args, state)
            runs[policy].append(run)
            print(
                f"round {rep} {policy}: blocked median {median(run['blocked']):.3f} s, "
                f"remote holds {run['committed']}",
                file=sys.stderr,
            )
        busy = other_cpu_fraction(before, cpu_snapshot())
    print(
        f"- state: {args.mb} MB fp32; {args.saves} saves, {args.step_seconds} s "
        f"({args.step_kind}) between; remote {args.remote_mbps:g} MB/s; "
        f"{args.repeat} rounds, policies alternated"
    )
    print(f"- other processes used {busy:.0%} of the CPU while this ran\n")
    rows = []
    for policy in POLICIES:
        rs = runs[policy]
        blocked = [b for r in rs for b in r["blocked"]]
        during = [b for r in rs for b, o in zip(r["blocked"], r["overlaps"], strict=True) if o]
        waits = [r["final_wait"] for r in rs]
        own = [w for r in rs for w in r["waited"]]
        lags = [r["last_lag"] for r in rs]
        rows.append(
            [
                policy,
                f"{median(blocked):.3f} ({spread(blocked, 3)})",
                f"{median(during):.3f} ({len(during)} of {len(blocked)})" if during else "none",
                f"{median(own):.4f} ({spread(own, 4)})",
                f"{median(waits):.2f} ({spread(waits)})",
                f"{sum(r['last_on_remote'] for r in rs)}/{len(rs)}",
                f"{median([len(r['committed']) for r in rs]):g} of {args.saves}",
                f"{median(lags):.2f}" if all(r["last_on_remote"] for r in rs) else "not there",
            ]
        )
    print(
        markdown_table(
            [
                "policy",
                "save() blocked, s: median (min to max)",
                "of saves beside a drain: median (how many)",
                "of which the manager's own work (waited_seconds)",
                "final wait(), s",
                "last step on remote",
                "steps on remote",
                "last step's lag, s",
            ],
            rows,
        )
    )

    def blocked_of(policy: str, beside_a_drain: bool | None = None) -> float:
        return median(
            [
                b
                for r in runs[policy]
                for b, o in zip(r["blocked"], r["overlaps"], strict=True)
                if beside_a_drain in (None, o)
            ]
        )

    own = median([w for r in runs["latest"] for w in r["waited"]]) / median(
        [w for r in runs["skip"] for w in r["waited"]]
    )
    ratio = blocked_of("latest") / blocked_of("skip")
    beside = blocked_of("latest", True) / blocked_of("skip", True)
    print()
    print(
        goal_line(
            ratio <= 1.05,
            "save() blocks no longer under latest than under skip",
            f"median ratio {ratio:.2f}x over all saves; {beside:.2f}x over the saves "
            "that ran beside a drain (<= 1.05x: noise on this VM)",
        )
    )
    print(
        goal_line(
            own <= 1.05,
            "the manager's own work in save() (waited_seconds)",
            f"median ratio {own:.2f}x latest / skip",
        )
    )
    ok = all(r["last_on_remote"] for r in runs["latest"])
    print(
        goal_line(
            ok,
            "the last step reaches the remote under latest",
            f"{sum(r['last_on_remote'] for r in runs['latest'])}/{args.repeat} rounds",
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"args": args_record(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

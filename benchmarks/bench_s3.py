"""A checkpoint straight to S3, and drained to it: ours against stock DCP and AWS's
``s3torchconnector``, on one S3 server.

One process, no process group. The state: ``--gb`` GB (1 by default) of fp32 in 64
tensors of random normal values (a fixed seed). The S3 server is moto on loopback in
a child process (``_remotes.moto_s3``), reached by every writer and reader through
the same endpoint. Every round saves the state once per configuration, in an order
rotated every round, then loads each checkpoint back (bit for bit):

* ``stock``: ``dcp.save(state, storage_writer=FsspecWriter(url, thread_count=2),
  planner=DefaultSavePlanner(enable_plan_caching=True))`` (s3fs), stock's best
  configuration for an object store; loads with ``FsspecReader``;
* ``s3torchconnector``: its DCP ``S3StorageWriter(region, url, thread_count=2)``
  (the AWS CRT client, 8 MiB parts, path-style addressing to reach the loopback
  server); loads with its ``S3StorageReader``. Left out, and said so, where the
  package is not installed (``make bench-setup`` installs it);
* ``ours``: ``dcp.save(state, storage_writer=MultiLevelWriter(url))`` with the
  store's defaults (spooled, then uploaded in parts); loads with
  ``MultiLevelReader(url)``;
* ``drain``: ``dcp.save(state, storage_writer=MultiLevelWriter("step-N",
  levels=[Level(local), Level(s3)]))`` then ``dcp_multilevel.wait()``: the time the
  save blocked (the local first level) and the drain's own seconds (read the local
  files, upload, commit on S3).

Goals: our save straight to S3 no slower than the faster of ``stock`` and
``s3torchconnector``; the drain to S3 no slower than our direct save; our load
from S3 no slower than the faster of theirs.

Quick check::

    python benchmarks/bench_s3.py --quick
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# Measure this checkout's dcp_multilevel whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dcp_multilevel
from _cli import add_results, add_root, add_seed, args_record, parser, quiet_dcp_warnings
from _disk import scratch_dir
from _measure import median, rounds, spread
from _remotes import moto_s3
from _report import Results, figure, goal_line, markdown_table, measured, times
from dcp_multilevel import Level, MultiLevelReader, MultiLevelWriter

CONFIGS = ("stock", "s3torchconnector", "ours", "drain")
LABELS = {
    "stock": "stock `FsspecWriter(thread_count=2)`, plan caching",
    "s3torchconnector": "`s3torchconnector` `S3StorageWriter(thread_count=2)`",
    "ours": "`MultiLevelWriter(s3://...)`",
    "drain": "`MultiLevelWriter(levels=[local, s3])`: the drain",
}
REGION = "us-east-1"


def make_state(gb: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 64
    per = max(1, int(gb * 1e9) // 4 // n)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def connector(options: dict[str, Any]) -> tuple[Any, Any] | None:
    """``s3torchconnector``'s writer and reader classes bound to the loopback server, or
    None where it is not installed."""
    if importlib.util.find_spec("s3torchconnector") is None:
        return None
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    config = S3ClientConfig(force_path_style=True, part_size=8 << 20)
    endpoint = options["client_kwargs"]["endpoint_url"]

    def fs() -> Any:
        client = S3Client(REGION, endpoint=endpoint, s3client_config=config)
        return S3FileSystem(REGION, s3_client=client)

    def writer(url: str) -> Any:
        w = S3StorageWriter(REGION, url, s3client_config=config, thread_count=2)
        w.fs = fs()  # the same server as the others
        return w

    def reader(url: str) -> Any:
        r = S3StorageReader(REGION, url, s3client_config=config)
        r.fs = fs()
        return r

    return writer, reader


def one(config: str, state: dict, bucket: str, options: dict, root: Path, args: Any) -> dict:
    """Save ``state`` with ``config`` and load it back; seconds of each, bit-exactness."""
    url = f"{bucket}/{config}-{uuid.uuid4().hex[:8]}"
    out = blank(state)
    rec: dict[str, Any] = {"config": config}
    if config == "stock":
        planner = DefaultSavePlanner(enable_plan_caching=True)
        t0 = time.perf_counter()
        dcp.save(
            state, storage_writer=FsspecWriter(url, thread_count=2, **options), planner=planner
        )
        rec["save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=FsspecReader(url, **options))
    elif config == "s3torchconnector":
        writer, reader = args.connector
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer(url))
        rec["save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=reader(url))
    elif config == "ours":
        options = args.ours_options
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=MultiLevelWriter(url, storage_options=options))
        rec["save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=MultiLevelReader(url, storage_options=options))
    else:  # drain
        options = args.ours_options
        local = root / f"l1-{uuid.uuid4().hex[:8]}"
        levels = [Level(str(local)), Level(url, storage_options=options)]
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=MultiLevelWriter("step-1", levels=levels))
        rec["blocked_s"] = time.perf_counter() - t0
        (result,) = [r for r in dcp_multilevel.wait() if r.level.rstrip("/") == url]
        if not result.committed:
            raise RuntimeError(f"the drain to S3 failed: {result.error}")
        rec["save_s"] = result.seconds
        shutil.rmtree(local)  # the load below reads S3 only
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=MultiLevelReader(f"{url}/step-1", storage_options=options))
    rec["load_s"] = time.perf_counter() - t0
    rec["bit_exact"] = equal(out, state)
    return rec


def parse_args(argv: list[str] | None = None) -> Any:
    p = parser(__doc__)
    p.add_argument("--gb", type=float, default=1.0, help="state size (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--quick", action="store_true", help="0.1 GB, 2 rounds")
    add_root(p, "scratch directory for the first level and the spool")
    add_seed(p)
    add_results(p, "s3")
    args = p.parse_args(argv)
    if args.quick:
        args.gb, args.repeat = 0.1, 2
    return args


def cell(xs: list[float]) -> str:
    return f"{median(xs):.2f} ({spread(xs)})" if xs else "n/a"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_dcp_warnings()
    run = Results(__file__)
    state = make_state(args.gb, args.seed)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {size / 1e9:.2f} GB; {args.repeat} rounds")
    recs: list[dict] = []
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(scratch_dir(args.root, "bench-s3-"))
        bucket, options = stack.enter_context(moto_s3())
        args.ours_options = {**options, "spool_dir": str(root / "spool")}
        args.connector = connector(options)
        configs = [c for c in CONFIGS if c != "s3torchconnector" or args.connector is not None]
        if args.connector is None:
            print("s3torchconnector is not installed: left out (make bench-setup installs it)")
        for rep, config in rounds(configs, args.repeat):
            rec = one(config, state, bucket, options, root, args) | {"round": rep}
            recs.append(rec)
            print(
                f"  round {rep + 1} {config}: save {rec['save_s']:.2f} s, "
                f"load {rec['load_s']:.2f} s, bit-exact {rec['bit_exact']}",
                flush=True,
            )
    by = {c: [r for r in recs if r["config"] == c] for c in configs}
    rows = [
        [
            LABELS[c],
            cell([r["save_s"] for r in by[c]]),
            cell([r["blocked_s"] for r in by[c]]) if c == "drain" else "-",
            cell([r["load_s"] for r in by[c]]),
            str(len(by[c])),
        ]
        for c in configs
    ]
    print()
    headers = ["configuration", "save (drain), s", "save blocked, s", "load, s", "rounds"]
    print(markdown_table(headers, rows))
    print()
    med = {c: {k: median([r[k] for r in by[c]]) for k in ("save_s", "load_s")} for c in configs}
    theirs = [c for c in ("stock", "s3torchconnector") if c in med]
    best_save = min(theirs, key=lambda c: med[c]["save_s"])
    best_load = min(theirs, key=lambda c: med[c]["load_s"])
    print("### Goals")
    print()
    goals = [  # (what, ours, theirs, whose)
        (
            "a save straight to S3 no slower than the faster of stock and s3torchconnector",
            med["ours"]["save_s"],
            med[best_save]["save_s"],
            best_save,
        ),
        (
            "a drain to S3 no slower than our save straight to S3",
            med["drain"]["save_s"],
            med["ours"]["save_s"],
            "our direct save",
        ),
        (
            "a load from S3 no slower than the faster of stock and s3torchconnector",
            med["ours"]["load_s"],
            med[best_load]["load_s"],
            best_load,
        ),
    ]
    for what, a, b, whose in goals:
        ratio = a / b
        ok = ratio <= 1.0 if measured(ratio) else None
        print(goal_line(ok, what, f"{a:.2f} s against {whose} {b:.2f} s ({times(ratio)})"))
    exact = all(r["bit_exact"] for r in recs)
    print(goal_line(exact, "every load bit-exact", f"{len(recs)} loads"))
    figures = {"state_bytes": figure([size], "B")}
    for c in configs:
        figures[f"{c}.save_s"] = figure([r["save_s"] for r in by[c]], "s")
        figures[f"{c}.load_s"] = figure([r["load_s"] for r in by[c]], "s")
    figures["drain.blocked_s"] = figure([r["blocked_s"] for r in by["drain"]], "s")
    run.write(
        args.results,
        figures=figures,
        alternated=configs,
        rounds=args.repeat,
        data={"args": args_record(args) | {"connector": args.connector is not None}, "runs": recs},
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())

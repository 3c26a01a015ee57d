"""Device check: device state round trips bit-exact, then what saves cost a training loop.

    python benchmarks/gpu_check.py                  # CUDA, GPT-2-medium-sized model
    python benchmarks/gpu_check.py --device cpu     # tiny model, what CI runs
    python benchmarks/gpu_check.py --device cpu --size gpt2 --methods ours,stock-best
                                                    # the CPU goal's size, fewer methods

Part 1 (``_gpu_roundtrips.py``): plain device tensors of several dtypes,
``dcp.save``/``dcp.load`` with our writer and reader (and the balanced
planner, a codec), ``dcp.async_save`` with the state changed right after it
returns, a two-level ``CheckpointManager`` (and a load after losing level 1),
FSDP2 ``fully_shard`` DTensors with AdamW state (``dcp.save`` and
``async_save``), and the CLI on a checkpoint written from the device. Each
loads into device destinations and compares bytes.

Part 2 (``_gpu_bench.py``): a GPT-2-shaped model (AdamW, bf16 autocast on
CUDA) trained with a save every ``--every`` steps, ours against stock DCP's
default staging and its best (pinned, async, non-blocking), alternating, and
the load of that state into device destinations against stock's reader and
the pinned host-to-device bandwidth. Each method's row also gives its CPU
per save (the machine's busy seconds, less the loop without saves).

Exit status: 1 if a round trip failed. ``--json`` writes every figure.
Checkpoints go under ``--dir`` (default /dev/shm when it has room: the
figures are about staging and the host, not the disk).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scratch(arg: str | None, need: int) -> Path:
    if arg:
        return Path(arg)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return Path(tempfile.mkdtemp(prefix="dcp-ml-gpu-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="dcp-ml-gpu-"))


def _on_disk(root: Path) -> Path:
    """Where the round trips write: ``root`` unless it is in memory (/dev/shm), then
    a directory on a disk, so that they go through the ``O_DIRECT`` writes (from
    pinned staging buffers on a GPU) that a file system in memory never takes."""
    from dcp_multilevel.stores import _direct

    if not _direct.memory_backed(root):
        return root / "rt"
    for parent in (Path(tempfile.gettempdir()), Path.cwd() / "bench_out"):
        parent.mkdir(parents=True, exist_ok=True)
        if not _direct.memory_backed(parent):
            return Path(tempfile.mkdtemp(prefix="dcp-ml-gpu-rt-", dir=parent))
    return root / "rt"


def _init(device: torch.device) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )


def _print_bench(b: dict) -> None:
    print(
        f"\nSave every {b['every']} steps, {b['steps']} steps per loop, {b['rounds']} rounds, "
        f"state {b['state_bytes'] / 1e9:.2f} GB, step {b['step_s'] * 1e3:.1f} ms (no saves)"
    )
    print(
        "| method | inflation per save s (spread) | % of training time | CPU per save s "
        "| blocked s | durable s | RSS GB | pinned GB |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for m, r in b["methods"].items():
        spread = r["inflation_spread"] or [float("nan")] * 2
        pct = r["inflation_pct"]
        cpu = r.get("cpu_per_save_s")
        print(
            f"| {m} | {r['inflation_s']:.3f} ({spread[0]:.3f}..{spread[1]:.3f}) | "
            f"{pct:.2f} | {'-' if cpu is None else f'{cpu:.2f}'} | {r['blocked_s']:.3f} | "
            f"{r['durable_s']:.2f} | {r['rss_gb']:.2f} | {r['pinned_gb']:.2f} |"
            if pct is not None
            else f"| {m} | - | - | - | - | - | - | - |"
        )
    print("\nExtra ms of the k-th step after a save (k = 1, 2, ...; against the loop without)")
    for m, r in b["methods"].items():
        print(f"  {m}: " + " ".join(f"{1e3 * x:+.0f}" for x in r.get("after_save_s") or []))


def _print_flat(fl: dict) -> None:
    rows, gb = fl["saves"], 1e9

    def row(name: str, r: dict) -> str:
        pinned = "-" if r["pinned"] is None else f"{r['pinned'] / gb:.3f}"
        return f"| {name} | {r['rss'] / gb:.3f} | {pinned} | {r['pool'] / gb:.3f} |"

    print("| after | RSS GB | pinned GB | staging pool GB |")
    print("|---|---:|---:|---:|")
    for i in sorted({0, 1, len(rows) // 2, len(rows) - 1}):
        print(row(f"save {i + 1}", rows[i]))
    print(row("close()", fl["closed"]))
    verdict = "PASS" if fl["flat"] else "MISS"
    print(
        f"{verdict}: flat from the second save to the last ({len(rows)} saves; RSS and pinned "
        f"within 1 % + 64 MB, the pool equal), the pool empty after close(); "
        f"{fl['allocated'] / gb:.3f} GB ever allocated"
    )


def _print_load(ld: dict) -> None:
    h2d = ld["h2d_pinned_gbps"]
    print(f"\nLoad {ld['state_bytes'] / 1e9:.2f} GB into device destinations")
    print("| reader | s | GB/s | % of pinned H2D |\n|---|---:|---:|---:|")
    for k, v in ld["load"].items():
        pct = f"{100 * v['gbps'] / h2d:.0f}" if h2d else "-"
        print(f"| {k} | {v['s']:.3f} | {v['gbps']:.2f} | {pct} |")
    if h2d:
        print(f"pinned host-to-device copy: {h2d:.1f} GB/s")
    for n, gbps in (ld.get("file_read_gbps") or {}).items():
        print(
            f"the same files read by {n} thread(s) into host memory, nothing else: {gbps:.2f} GB/s"
        )
    if ld.get("profile"):
        lines = [x for x in ld["profile"].splitlines() if x.strip()]
        print("\nOurs' load, one more under cProfile (by own time; the JSON has it all):")
        print("\n".join(lines[:30]))
    print("\nSynchronous dcp.save from device tensors\n| writer | s | GB/s |\n|---|---:|---:|")
    for k, v in ld["save"].items():
        print(f"| {k} | {v['s']:.3f} | {v['gbps']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    from _gpu_bench import METHODS, NOT_BY_DEFAULT, bench_flat, bench_load, bench_steps
    from _gpu_roundtrips import run_all

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("tiny", "small", "gpt2", "medium"), default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per loop")
    ap.add_argument("--every", type=int, default=10, help="save every N steps")
    ap.add_argument("--budget-s", type=float, default=170, help="stop starting rounds after this")
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to compare with no saves (default: all but "
        "ours-process, on CUDA ours-nocopy, on CPU ours-devsnap: see NOT_BY_DEFAULT in "
        "_gpu_bench.py)",
    )
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-roundtrips", action="store_true", help="only the benchmark")
    ap.add_argument("--skip-load", action="store_true", help="no load benchmark")
    ap.add_argument(
        "--flat-saves",
        type=int,
        default=20,
        help="saves in the memory check (RSS, pinned and pool bytes flat); 0: none",
    )
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--watchdog-s",
        type=float,
        default=0,
        help="after this many seconds, print every thread's stack and exit (a hung save "
        "says where it hangs before a lent machine's time limit kills it); 0: never",
    )
    args = ap.parse_args(argv)
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    if args.methods is None:
        skip = NOT_BY_DEFAULT["cuda" if args.device.startswith("cuda") else "cpu"]
        args.methods = ",".join(m for m in METHODS[1:] if m not in skip)
    only = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if unknown := sorted(set(only) - set(METHODS)):
        ap.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS[1:])}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = args.size or ("medium" if device.type == "cuda" else "tiny")
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    need = {"medium": 40 << 30, "gpt2": 12 << 30}.get(size, 1 << 30)
    root = _scratch(args.dir, need=need)
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": size,
        "dir": str(root),
        "cpus": os.cpu_count(),
    }
    print("gpu_check:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    _init(device)
    rt = _on_disk(root)
    info["roundtrip_dir"] = str(rt)
    report: dict = {"info": info}
    try:
        report["roundtrips"] = []
        if not args.skip_roundtrips:
            print(
                f"\nRound trips (bit-exact, loaded into device destinations) in {rt}:", flush=True
            )
            report["roundtrips"] = run_all(rt, device)
        if not args.skip_bench:
            print("\nTraining loop with saves:", flush=True)
            report["bench"] = bench_steps(
                size, device, root / "bench", args.rounds, args.steps, args.every, deadline, only
            )
            _print_bench(report["bench"])
            if not args.skip_load:
                report["load"] = bench_load(size, device, root / "load", repeats=4)
                _print_load(report["load"])
            if args.flat_saves:
                print(f"\nMemory over {args.flat_saves} async saves (overlap):", flush=True)
                # 20 saves of the 4.26 GB state took about 70 s on the lent H100.
                report["flat"] = bench_flat(
                    size, device, root / "flat", args.flat_saves, time.monotonic() + 100
                )
                _print_flat(report["flat"])
    finally:
        report["seconds"] = round(time.monotonic() - t_start, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(rt, ignore_errors=True)
        dist.destroy_process_group()
    failed = [r["check"] for r in report["roundtrips"] if not r["ok"]]
    print(
        f"\n{len(failed)} round trip(s) failed{': ' + ', '.join(failed) if failed else ''}; "
        f"{report['seconds']} s in all"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
2. **direct**: ``dcp.save(state, storage_writer=MultiLevelWriter(<remote>/direct/step-N,
   codec=...))``: the loop is blocked until the checkpoint is committed on the
   remote, so blocked time = time to durable (untimed afterwards: the remote copy
   is deleted to bound the server's memory);
3. **manager**: ``CheckpointManager([Tier(local, every=1, keep=2), Tier(<remote>/managed,
   every=1, keep=1, codec=...)]).save(state, step=N)``; blocked = the ``save``
   call (the L1 commit plus the manager's own retention work), after which the
   loop trains on for ``--step-seconds`` while the drain copies the checkpoint to
   the remote in the background; then ``mgr.wait()``. Time to durable on the
   remote = the L1 commit (``SaveMetrics.blocked_seconds``) + the drain's
   ``DrainResult.lag_seconds`` (L1 commit -> remote manifest written). Waiting
   for the drain before the next iteration keeps every save's drain measurable
   (with the default policy "skip", a save arriving while the previous drain runs
   would not be copied to the remote at all); that wait is in the ``--json`` output.

Remotes:

* ``s3``: a moto ``ThreadedMotoServer`` on 127.0.0.1 (a free port, dummy
  credentials, ``AWS_ENDPOINT_URL``), run in a child process so that its request
  handling does not compete for the measured process's GIL, reached with s3fs;
* ``throttled``: ``throttled:///<dir>``, a local directory (in /dev/shm by
  default, so the simulated remote does not load the disk L1 uses) behind a
  simulated link of ``--remote-mbps`` MB/s (default 200) defined in this file:
  every upload (``put_file``/``pipe_file``) and download (``cat_file``) holds one
  shared link per direction for ``bytes / bandwidth`` seconds (FIFO), the real
  copy running inside that time.

Both paths use the same MultiLevelWriter defaults (one data file per rank,
spooled locally, then uploaded) and the same codec on the remote; L1 is
uncompressed. Where the time goes is measured by wrapping (in this process
only) the library's read, checksum, codec, spool-write and upload calls.

Correctness: after a cell's loop the L1 tier is deleted (node replaced), and a
fresh manager's ``load_latest`` must return the last step from the remote,
bit-exact. Done for every throttled cell and the first s3 cell (``--verify-all``:
every cell; moto copies the whole object for every ranged GET, which makes
loading a compressed checkpoint from it take minutes).

Goals (issue 5): manager blocked time at least 5x smaller than a direct remote
save; the checkpoint durable on the remote within 1.2x the direct save's time.

Quick check::

    python benchmarks/bench_manager.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem

# Measure this checkout's dcp_multilevel whatever is installed, and find _common.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcp_multilevel._transfer as transfer_mod
import dcp_multilevel.codecs.pipeline as pipeline_mod
import dcp_multilevel.tiers.local as local_mod
import dcp_multilevel.writer as writer_mod
from _common import (
    BertConfig,
    assert_state_equal,
    bert_pretraining_shapes,
    build_state_dict,
    cpu_snapshot,
    machine_info,
    markdown_table,
    median,
    other_cpu_fraction,
    state_nbytes,
    wait_for_idle,
    zeros_like_state,
)
from _data import bert_layers, tiny_bert_config
from dcp_multilevel import CheckpointManager, MultiLevelWriter, Tier
from dcp_multilevel.tiers import remote as remote_mod
from dcp_multilevel.tiers import tier_for

State = dict[str, torch.Tensor]
REMOTES = ("s3", "throttled")
CODECS = ("none", "bytegroup")
BLOCKED_GOAL = 5.0  # direct save / manager blocked >= this
DURABLE_GOAL = 1.2  # manager time to durable / direct save <= this


# --------------------------------------------------------------------------- throttled remote


class _Link:
    """One direction of a simulated network link: transfers queue FIFO at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def hold(self, nbytes: int) -> float:
        """Reserve the link for ``nbytes``; return the perf_counter time the transfer ends."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    @staticmethod
    def until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


_LINKS: dict[tuple[float, str], _Link] = {}
_LINKS_LOCK = threading.Lock()


def _link(mbps: float, direction: str) -> _Link:
    with _LINKS_LOCK:
        return _LINKS.setdefault((mbps, direction), _Link(mbps * 1e6))


class ThrottledFileSystem(LocalFileSystem):
    """``throttled:///path``: a local directory behind a bandwidth-limited link.

    Uploads (``put_file``, ``pipe_file``) and downloads (``cat_file``) take at
    least ``bytes / (mbps * 1e6)`` seconds each, queued on one link per
    direction shared by every instance with the same ``mbps``; metadata calls
    (``info``, ``ls``, ``rm``) are free.
    """

    protocol = ("throttled",)

    def __init__(self, mbps: float = 200.0, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(**kwargs)
        self.mbps = float(mbps)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("throttled://"):
            path = path[len("throttled://") :]
        return super()._strip_protocol(path)

    def put_file(self, lpath: str, rpath: str, callback: Any = None, **kwargs: Any) -> None:
        done = _link(self.mbps, "up").hold(os.path.getsize(lpath))
        super().put_file(lpath, rpath, callback=callback, **kwargs)
        _Link.until(done)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        done = _link(self.mbps, "up").hold(len(value))
        super().pipe_file(path, value, *args, **kwargs)
        _Link.until(done)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        data = super().cat_file(path, start=start, end=end, **kw)
        _Link.until(_link(self.mbps, "down").hold(len(data)))
        return data


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)


# --------------------------------------------------------------------------- S3 on loopback

_MOTO_CHILD = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the parent closes our stdin (or exits)
server.stop()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server in a child process; yields the s3fs storage options."""
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, "-c", _MOTO_CHILD, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline() if child.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"moto server did not start (said {line!r})")
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            "AWS_ACCESS_KEY_ID": "dcp-ml-bench-key",
            "AWS_SECRET_ACCESS_KEY": "dcp-ml-bench-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        os.environ.update(env)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
            os.environ.pop(name, None)
        yield {
            "key": env["AWS_ACCESS_KEY_ID"],
            "secret": env["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _new_bucket(options: dict[str, Any]) -> str:
    import boto3

    ck = options["client_kwargs"]
    name = f"dcp-ml-bench-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=ck["endpoint_url"],
        region_name=ck["region_name"],
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
    ).create_bucket(Bucket=name)
    return name


# --------------------------------------------------------------------------- profiling


class Profile:
    """Seconds spent in wrapped library calls, per phase and per thread kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._undo: list[Callable[[], None]] = []

    #: Thread name prefixes of the drain (its worker, copy, upload and codec threads).
    DRAIN_THREADS = ("dcp-ml-drain", "dcp-ml-copy", "dcp-ml-upload", "dcp-ml-recode")

    @classmethod
    def _who(cls) -> str:
        name = threading.current_thread().name
        return "drain" if name.startswith(cls.DRAIN_THREADS) else "main"

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[self._who()][phase] += seconds

    def take(self) -> dict[str, dict[str, float]]:
        with self._lock:
            out = {k: dict(v) for k, v in self.seconds.items()}
            self.seconds.clear()
            return out

    def wrap(self, owner: Any, name: str, phase: str, *, materialize: bool = False) -> None:
        original = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = original(*args, **kwargs)
                return list(out) if materialize else out
            finally:
                self.add(phase, time.perf_counter() - t0)

        setattr(owner, name, timed_call)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        prof = self

        class TimedHasher(transfer_mod.Hasher):
            __slots__ = ()

            def update(self, data: Any) -> None:
                t0 = time.perf_counter()
                super().update(data)
                prof.add("hash output", time.perf_counter() - t0)

        for mod in (transfer_mod, writer_mod):
            original = mod.Hasher
            mod.Hasher = TimedHasher
            self._undo.append(lambda m=mod, o=original: setattr(m, "Hasher", o))
        self.wrap(local_mod._LocalReadHandle, "read_into", "read L1")
        self.wrap(transfer_mod, "checksum_of", "verify checksum")
        self.wrap(transfer_mod, "decode_buffer", "decode")
        # Summed over the codec pool's threads: may exceed the wall time.
        self.wrap(pipeline_mod, "encode_chunk", "encode chunks (pool threads)")
        # The remote tier's spool handle (the drain and the direct path write nothing else).
        handle = getattr(remote_mod, "FdWriteHandle", None) or getattr(
            remote_mod, "_SpoolWriteHandle", None
        )
        if handle is not None:
            self.wrap(handle, "write", "spool write")
        self.wrap(remote_mod.RemoteTier, "put_file", "upload data (put_file)")
        self.wrap(remote_mod.RemoteTier, "write_atomic", "upload manifest")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


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
    profile_direct: dict[str, float] = field(default_factory=dict)
    profile_drain: dict[str, float] = field(default_factory=dict)
    verify: str = ""
    load_s: float = float("nan")

    def med(self, name: str) -> float:
        return median(getattr(self, name))

    @property
    def blocked_ratio(self) -> float:
        return self.med("direct_s") / self.med("blocked_s")

    @property
    def durable_ratio(self) -> float:
        return self.med("durable_s") / self.med("direct_s")


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
    prof: Profile,
    verify: bool,
) -> Cell:
    codec_arg = None if codec == "none" else codec
    tag = f"{remote}-{codec}-{uuid.uuid4().hex[:6]}"
    l1 = root / f"l1-{tag}"
    direct_root = f"{remote_root}/{tag}/direct"
    managed = Tier(f"{remote_root}/{tag}/managed", every=1, keep=1, codec=codec_arg,
                   storage_options=options)  # fmt: skip
    tiers = [Tier(str(l1), every=1, keep=2), managed]
    mgr = CheckpointManager(tiers)
    cell = Cell(remote, codec, state_nbytes(state))
    prof.take()
    prof_direct: dict[str, list[float]] = defaultdict(list)
    prof_drain: dict[str, list[float]] = defaultdict(list)
    before = cpu_snapshot()
    for step in range(1, args.saves + 1):
        if args.wait_idle > 0 and wait_for_idle(timeout=args.wait_idle) is None:
            print(f"  (machine still busy after {args.wait_idle} s; measuring anyway)")
        training_step(state, args.step_seconds, args.step_kind, update=True)

        # (a) straight to the remote
        writer = MultiLevelWriter(f"{direct_root}/step-{step}", codec=codec_arg,
                                  storage_options=options)  # fmt: skip
        prof.take()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        direct = time.perf_counter() - t0
        phases = prof.take().get("main", {})
        phases["total"] = direct
        for k, v in phases.items():
            prof_direct[k].append(v)
        cell.direct_s.append(direct)
        cell.direct_bytes.append(writer.bytes_written)
        writer.tier.remove_tree("")  # untimed: bound the server's memory

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
        phases = prof.take().get("drain", {})
        phases["total"] = result.seconds
        for k, v in phases.items():
            prof_drain[k].append(v)
        print(
            f"  {remote:9s} {codec:9s} step {step}: direct {direct:6.2f} s | manager blocked "
            f"{cell.blocked_s[-1]:6.3f} s (L1 commit {metrics.blocked_seconds:.3f} s), durable "
            f"{cell.durable_s[-1]:6.2f} s, drain {result.seconds:6.2f} s",
            flush=True,
        )
    cell.other_cpu = other_cpu_fraction(before, cpu_snapshot())
    cell.profile_direct = {k: median(v) for k, v in prof_direct.items()}
    cell.profile_drain = {k: median(v) for k, v in prof_drain.items()}
    mgr.close()
    if verify:
        _verify(cell, state, tiers, args.saves)
    else:
        cell.verify = "not verified (--verify-all)"
    with contextlib.suppress(OSError):
        tier_for(f"{remote_root}/{tag}", **options).remove_tree("")
    shutil.rmtree(l1, ignore_errors=True)
    return cell


def _verify(cell: Cell, state: State, tiers: list[Tier], step: int) -> None:
    """Lose the node (delete L1), resume from the remote, compare bit for bit."""
    shutil.rmtree(tiers[0].url)
    managed = tiers[1]
    fresh = CheckpointManager(tiers)
    dest = zeros_like_state(state)
    t0 = time.perf_counter()
    got = fresh.load_latest(dest)
    cell.load_s = time.perf_counter() - t0
    sources = fresh.last_load_sources
    fresh.close()
    try:
        if got != step:
            raise AssertionError(f"load_latest returned step {got}, expected {step}")
        if len(sources) != 1 or not next(iter(sources)).startswith(managed.url):
            raise AssertionError(f"loaded from {sources}, expected the remote only")
        assert_state_equal(state, dest)
        cell.verify = "bit-exact from remote"
    except AssertionError as e:
        cell.verify = f"FAILED: {e}"
    del dest


# --------------------------------------------------------------------------- report


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def report(cells: list[Cell], args: argparse.Namespace, info: dict[str, str], extra: str) -> str:
    out = ["## CheckpointManager vs a direct remote save", ""]
    out += [f"- {k}: {v}" for k, v in info.items()]
    out += [extra, ""]
    headers = [
        "remote",
        "codec",
        "state GB",
        "direct save s (= blocked = durable)",
        "manager blocked s (save call)",
        "of which L1 commit s",
        "blocked ratio (goal >= 5x)",
        "manager durable s",
        "durable / direct (goal <= 1.2x)",
        "drain s",
        "remote GB direct / drained",
        "other CPU %",
    ]
    rows = []
    for c in cells:
        rows.append(
            [
                c.remote,
                c.codec,
                _f(c.state_bytes / 1e9),
                _f(c.med("direct_s")),
                _f(c.med("blocked_s"), 3),
                _f(c.med("l1_commit_s"), 3),
                f"{c.blocked_ratio:.1f}x",
                _f(c.med("durable_s")),
                f"{c.durable_ratio:.2f}x",
                _f(c.med("drain_s")),
                f"{median(c.direct_bytes) / 1e9:.3f} / {median(c.drain_bytes) / 1e9:.3f}",
                f"{100 * c.other_cpu:.0f}",
            ]
        )
    out += [
        f"Medians of {args.saves} saves each; {args.step_kind} step of {args.step_seconds} s "
        "between saves.",
        "",
        markdown_table(headers, rows),
        "",
    ]

    out += ["### Goals", ""]
    goal_rows = []
    for c in cells:
        b = "PASS" if c.blocked_ratio >= BLOCKED_GOAL else "MISS"
        d = "PASS" if c.durable_ratio <= DURABLE_GOAL else "MISS"
        goal_rows.append(
            [
                f"{c.remote} / {c.codec}",
                f"{b} ({c.blocked_ratio:.1f}x)",
                f"{d} ({c.durable_ratio:.2f}x)",
                c.verify + (f" (load {c.load_s:.2f} s)" if c.load_s == c.load_s else ""),
                str(c.skipped),
            ]
        )
    out += [
        markdown_table(
            [
                "remote / codec",
                "blocked >= 5x smaller",
                "durable <= 1.2x direct",
                "load after losing L1",
                "drains skipped",
            ],
            goal_rows,
        ),
        "",
    ]

    out += ["### Where the time goes (median seconds per save, wrapped library calls)", ""]
    phases: list[str] = []
    for c in cells:
        for p in list(c.profile_direct) + list(c.profile_drain):
            if p != "total" and p not in phases:
                phases.append(p)
    prow = []
    for c in cells:
        for label, prof in (("direct", c.profile_direct), ("drain", c.profile_drain)):
            total = prof.get("total", float("nan"))
            rest = total - sum(v for k, v in prof.items() if k != "total")
            prow.append(
                [f"{c.remote} / {c.codec} / {label}", _f(total)]
                + [_f(prof[p]) if p in prof else "-" for p in phases]
                + [_f(rest)]
            )
    out += [
        markdown_table(["path", "total", *phases, "other"], prow),
        "",
        'direct "other": planning, the codec (in its pool, overlapped with spooling) and '
        'the commit; drain "other": listing, reading the manifest, buffer allocation. '
        '"upload data" includes the size check after each upload.',
        "",
    ]
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def _csv(value: str, known: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        p.error(f"unknown {what} {bad}; known: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scale", type=float, default=0.125,
                   help="fraction of the 24 BERT layers; 0.125 (3, ~0.41 GB)")  # fmt: skip
    p.add_argument("--saves", type=int, default=5, help="saves per cell (median); 5")
    p.add_argument("--step-seconds", type=float, default=1.0,
                   help="training step between saves, seconds; 1.0")  # fmt: skip
    p.add_argument("--step-kind", choices=("compute", "sleep"), default="compute",
                   help="step: small single-threaded tensor ops (default) or sleep")  # fmt: skip
    p.add_argument("--remotes", default=",".join(REMOTES), help=f"subset of: {', '.join(REMOTES)}")
    p.add_argument("--codec", default=",".join(CODECS), help=f"subset of: {', '.join(CODECS)}")
    p.add_argument("--remote-mbps", type=float, default=200.0,
                   help="bandwidth of the throttled remote, MB/s; 200")  # fmt: skip
    p.add_argument("--root", type=Path, default=None,
                   help="scratch directory for L1 and the remote tier's spool files (default: "
                   "a new temporary directory, removed afterwards)")  # fmt: skip
    p.add_argument("--remote-dir", type=Path, default=None,
                   help="where the throttled remote stores its objects (default: a new "
                   "directory in /dev/shm if there is one, so the simulated remote does not "
                   "load the local disk that L1 and the spool use; else under --root)")  # fmt: skip
    p.add_argument("--spool-dir", type=Path, default=None,
                   help="where remote tiers spool files before upload (default: under "
                   "--root, the disk L1 uses)")  # fmt: skip
    p.add_argument("--verify-all", action="store_true",
                   help="check the load after losing L1 in every cell (default: every "
                   "throttled cell, only the first s3 cell: moto copies the whole object "
                   "per ranged GET, so a compressed checkpoint loads for minutes)")  # fmt: skip
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="before each iteration, wait up to this many seconds for other "
                   "processes to go quiet; 0 (don't)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the raw samples here")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny BERT, 2 saves, 0.2 s steps")  # fmt: skip
    args = p.parse_args(argv)
    args.remotes = _csv(args.remotes, REMOTES, "remotes", p)
    args.codec = _csv(args.codec, CODECS, "codecs", p)
    if args.quick:
        args.saves, args.step_seconds = 2, 0.2
    if args.saves < 1 or args.scale <= 0 or args.step_seconds < 0 or args.remote_mbps <= 0:
        p.error("--saves must be >= 1, --scale and --remote-mbps > 0, --step-seconds >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    cfg = (
        tiny_bert_config() if args.quick else BertConfig(num_hidden_layers=bert_layers(args.scale))
    )
    state = build_state_dict(bert_pretraining_shapes(cfg), seed=args.seed)
    size = state_nbytes(state)
    print(f"state: {len(state)} tensors, {size / 1e9:.3f} GB ({cfg.num_hidden_layers} layers)")

    own_root = args.root is None
    root = Path(tempfile.mkdtemp(prefix="bench-manager-")) if own_root else args.root
    root.mkdir(parents=True, exist_ok=True)
    spool = args.spool_dir if args.spool_dir is not None else root / "spool"
    shm = Path("/dev/shm")
    if args.remote_dir is not None:
        remote_dir = args.remote_dir
    elif shm.is_dir() and os.access(shm, os.W_OK):
        remote_dir = Path(tempfile.mkdtemp(prefix="bench-manager-remote-", dir=shm))
    else:
        remote_dir = root / "remote"
    prof = Profile()
    cells: list[Cell] = []
    try:
        prof.install()
        with contextlib.ExitStack() as stack:
            for remote in args.remotes:
                if remote == "s3":
                    opts = stack.enter_context(moto_s3())
                    base = f"s3://{_new_bucket(opts)}"
                else:
                    opts = {"mbps": args.remote_mbps}
                    base = f"throttled://{remote_dir.resolve()}"
                opts = {**opts, "spool_dir": str(spool)}
                for i, codec in enumerate(args.codec):
                    verify = args.verify_all or args.quick or remote != "s3" or i == 0
                    cells.append(
                        run_cell(remote, codec, state, args, root, base, opts, prof, verify)
                    )
    finally:
        prof.uninstall()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
        if args.remote_dir is None:
            shutil.rmtree(remote_dir, ignore_errors=True)

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
    text = report(cells, args, machine_info(root.parent if own_root else root), extra)
    print()
    print(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cells], indent=1))
    ok = not any(c.verify.startswith("FAILED") for c in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

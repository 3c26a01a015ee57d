"""Many files: discovery, ``ls``, ``gc`` and retention on a level root of many steps of
many files each, at this working tree ("new") and at a git revision ("old") side by side.

The local root: ``--steps`` committed steps of ``--files`` data files each, plus
one newer step without a manifest (a save that did not finish) and one old
temporary file in the data directory of a committed step, created after its
commit (what a crashed second save of that step leaves; ``gc`` must find it).
The data files are hard links (one 16-byte file per step, linked ``--files``
times: every name is a real directory entry, as many as a real root has, at a
fraction of the time and space of writing them). Each step's manifest is
written after its files, as a save does, and names ``--manifest-files`` of
them: ``ls`` decodes every manifest, and a manifest that names 1,000 files
takes tens of milliseconds to decode (measured and printed separately), which
would swamp the listing this benchmark is about.

Timed, each in a fresh process importing one version, versions alternating
(medians of ``--repeat``; the outputs of both versions must be equal):

- discovery: ``driver_for(Level(root)).steps()``, what ``load_latest`` asks each level;
- start: ``CheckpointManager([Level(root)])`` (its sweep of crash leftovers) + ``steps(0)``;
- ls: ``dcp-multilevel ls ROOT --all --json`` (every step; ``--all`` is the default of
  versions before it); ls (table): the same without ``--json``; ls (default): the
  table of the newest 50 steps and a count of the others (old versions: every step);
- gc --dry-run: ``dcp-multilevel gc ROOT --keep 3 --dry-run --json`` (what a cleanup
  would delete: all but 3 steps);
- gc: ``dcp-multilevel gc ROOT --keep STEPS-1 --json``: removes the oldest step and the
  temporary (and reads the manifests of the STEPS-1 kept steps, for their references);
- retention: the manager's retention of the level (``keep=STEPS-1``), which removes the
  oldest step (on a level without deltas it reads no manifest).

What gc and retention remove is put back between runs, untimed. Then the same
operations on S3 (moto's server on loopback, in this process), on a root of
``--s3-steps`` steps at two file counts, counting the HTTP requests the server
receives during each operation.

    python benchmarks/bench_many_files.py --steps 10000 --files 1000 --repeat 3
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from _cli import add_root, args_record, parser
from _measure import median, rounds, spread
from _report import REPO, markdown_table, print_header

OPS = ("discovery", "start", "ls", "ls (table)", "ls (default)", "gc --dry-run", "gc", "retention")
#: Operations whose output changed on purpose (``ls`` describes the newest 50 steps).
CHANGED = ("ls (default)",)
#: Operations that remove the oldest step (put back after each run).
DESTRUCTIVE = ("gc", "retention")

# One operation in a fresh process; prints {"seconds", "requests", "result", "module"}.
_WORKER = r"""
import json, sys, time, urllib.request
op, root, keep, options, count_url = sys.argv[1:6]
keep, options = int(keep), json.loads(options)
import dcp_multilevel
from click.testing import CliRunner
from dcp_multilevel import CheckpointManager
from dcp_multilevel.cli import main
from dcp_multilevel import Level
from dcp_multilevel.levels import driver_for

def count():
    return int(urllib.request.urlopen(count_url).read()) if count_url != "-" else 0

def cli(*argv, as_json=True):
    extra = ["--storage-options", json.dumps(options)] if options else []
    extra += ["--json"] if as_json else []
    result = CliRunner().invoke(main, [*argv, *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) if as_json else result.stdout

setup = None
if op == "discovery":
    driver = driver_for(Level(root, storage_options=options))
    run = driver.steps
elif op == "start":
    def run():
        mgr = CheckpointManager([Level(root, storage_options=options)])
        try:
            return mgr.steps(0)
        finally:
            mgr.close()
elif op in ("ls", "ls (table)", "ls (default)"):
    # Every step: the default of old versions, --all in later ones.
    every = ["--all"] if any("--all" in p.opts for p in main.commands["ls"].params) else []
    every = [] if op == "ls (default)" else every
    run = lambda: cli("ls", root, *every, as_json=op == "ls")
elif op == "gc --dry-run":
    run = lambda: cli("gc", root, "--keep", "3", "--dry-run")
elif op == "gc":
    run = lambda: cli("gc", root, "--keep", str(keep))
elif op == "retention":
    level = Level(root, keep=keep, storage_options=options)
    mgr = CheckpointManager([level], sweep_older_than_s=None)
    run = lambda: mgr._holdings.retain(0)
before = count()
start = time.perf_counter()
result = run()
seconds = time.perf_counter() - start
requests = count() - before - 1  # less the count request itself
print(json.dumps({"seconds": seconds, "requests": requests, "result": result,
                  "module": dcp_multilevel.__file__}))
"""


# --------------------------------------------------------------------------- versions


def old_tree(rev: str, scratch: Path) -> Path:
    """The package at git revision ``rev``, extracted below ``scratch`` (plus the built
    native codec of this tree, which git does not hold)."""
    out = scratch / f"old-{rev}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "dcp_multilevel"],
        capture_output=True,
        check=True,
    ).stdout
    tar = out / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(out, filter="data")
    tar.unlink()
    for built in (REPO / "dcp_multilevel" / "codecs").glob("_planes*.so"):
        shutil.copy2(built, out / "dcp_multilevel" / "codecs" / built.name)
    return out


def run_op(version: Path, op: str, root: str, keep: int, options: dict, count_url: str) -> dict:
    """``op`` once in a fresh process importing the package from ``version``."""
    env = {**os.environ, "PYTHONPATH": str(version)}
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, op, root, str(keep), json.dumps(options), count_url],
        cwd=version,  # not the repo: python -c puts the working directory first on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{op} at {version} failed:\n{out.stderr[-3000:]}")
    record = json.loads(out.stdout.splitlines()[-1])
    if not record["module"].startswith(str(version)):
        raise RuntimeError(f"{op} imported {record['module']}, not the version at {version}")
    return record


# --------------------------------------------------------------------------- the local root


def manifest_bytes(step: int, files: list[str]) -> bytes:
    """A real manifest of one small tensor per file in ``files`` (16 bytes each)."""
    from dcp_multilevel.testing.manifests import tiny_manifest

    return tiny_manifest(
        files, save_id=f"bench-{step}", world_size=len(files), created_unix=1.7e9 + step
    )


class LocalRoot:
    """The local level root (see the module docstring) and how to put back what gc and
    retention remove."""

    def __init__(self, scratch: Path, steps: int, files: int, manifest_files: int) -> None:
        self.path = scratch / "root"
        self.sources = scratch / "sources"
        self.steps, self.files, self.manifest_files = steps, files, manifest_files
        self.names = [f"data/{n}-0.0123456789abcdef.bin" for n in range(files)]
        self.tmp = self.path / "step-1" / "data" / "7-0.0123456789abcdef.bin.tmp-5f3a9c"

    @property
    def url(self) -> str:
        return str(self.path)

    def build(self) -> float:
        """Create the root; return the seconds it took."""
        start = time.perf_counter()
        for d in (self.path, self.sources):
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
        for step in range(self.steps):
            self.put_step(step)
        unfinished = self.path / f"step-{self.steps}" / "data"  # newer than every commit
        unfinished.mkdir(parents=True)
        (unfinished / "0-0.fedcba9876543210.bin").write_bytes(b"x" * 16)
        self.put_tmp()
        return time.perf_counter() - start

    def put_step(self, step: int) -> None:
        """Step ``step`` as a save leaves it: data files, then the manifest."""
        source = self.sources / str(step)
        if not source.exists():
            source.write_bytes(b"x" * 16)  # ext4 allows 65,000 links per file
        data = self.path / f"step-{step}" / "data"
        data.mkdir(parents=True)
        for name in self.names:
            os.link(source, data.parent / name)
        manifest = manifest_bytes(step, self.names[: self.manifest_files])
        (data.parent / "manifest.json").write_bytes(manifest)

    def put_tmp(self) -> None:
        """The old temporary file in step 1's data/, created after its commit."""
        self.tmp.write_bytes(b"x")
        old = time.time() - 7200
        os.utime(self.tmp, (old, old))

    def restore(self, op: str) -> None:
        """Put back what ``op`` removed (the oldest step; gc and start: the temporary)."""
        if op in DESTRUCTIVE and not (self.path / "step-0").exists():
            self.put_step(0)
        if not self.tmp.exists():
            self.put_tmp()


# --------------------------------------------------------------------------- S3


class CountingApp:
    """moto's WSGI app, counting the requests it serves; ``GET /__count__`` answers the
    count so far (and counts itself). ``latency_s``: added to every other request (a
    round trip to a real object store, rather than loopback's fraction of a millisecond)."""

    def __init__(self, app: Any, latency_s: float = 0.0) -> None:
        self.app = app
        self.latency_s = latency_s
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        with self._lock:
            self.count += 1
            n = self.count
        if environ.get("PATH_INFO") == "/__count__":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [str(n).encode()]
        time.sleep(self.latency_s)
        return self.app(environ, start_response)


def counting_s3(latency_s: float) -> tuple[str, dict, Any]:
    """moto's S3 server on a free loopback port, in this process; (endpoint, options, server)."""
    import logging
    import socket

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server(
        "127.0.0.1", port, CountingApp(app, latency_s), True, request_handler=MotoRequestHandler
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {
        "key": "dcp-ml-bench-key",
        "secret": "dcp-ml-bench-secret",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    return endpoint, options, server


class S3Root:
    """The same kind of root in a new bucket (no temporary: objects appear only whole)."""

    def __init__(self, endpoint: str, steps: int, files: int, manifest_files: int) -> None:
        import uuid

        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="dcp-ml-bench-key",
            aws_secret_access_key="dcp-ml-bench-secret",
            region_name="us-east-1",
        )
        self.bucket = f"dcp-ml-bench-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}/root"
        self.steps, self.files, self.manifest_files = steps, files, manifest_files
        self.names = [f"data/{n}-0.0123456789abcdef.bin" for n in range(files)]

    def build(self) -> None:
        for step in range(self.steps):
            self.put_step(step)
        self.put(f"step-{self.steps}/data/0-0.fedcba9876543210.bin", b"x" * 16)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"root/{key}", Body=body)

    def put_step(self, step: int) -> None:
        for name in self.names:
            self.put(f"step-{step}/{name}", b"x" * 16)
        self.put(
            f"step-{step}/manifest.json", manifest_bytes(step, self.names[: self.manifest_files])
        )

    def restore(self, op: str) -> None:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix="root/step-0/", MaxKeys=1)
        if op in DESTRUCTIVE and not listed.get("KeyCount"):
            self.put_step(0)


# --------------------------------------------------------------------------- runs


def measure(
    versions: dict[str, Path], where: Any, keep: int, options: dict, count_url: str, repeat: int
) -> dict[tuple[str, str], list[dict]]:
    """Every op at every version, ``repeat`` alternating rounds; the outputs compared."""
    url = where.url
    samples: dict[tuple[str, str], list[dict]] = {}
    for op in OPS:
        for _, version in rounds(list(versions), repeat):
            where.restore(op)
            record = run_op(versions[version], op, url, keep, options, count_url)
            samples.setdefault((op, version), []).append(record)
        where.restore(op)
        results = {v: samples[(op, v)][0]["result"] for v in versions}
        if op in CHANGED:
            continue
        if len({json.dumps(r, sort_keys=True) for r in results.values()}) != 1:
            raise RuntimeError(f"{op}: the versions disagree: {json.dumps(results)[:2000]}")
    return samples


def decode_seconds(files: int) -> tuple[int, float]:
    """Size and median decode time of a manifest naming ``files`` files (one item each)."""
    from dcp_multilevel.format.manifest import decode_manifest

    raw = manifest_bytes(0, [f"data/{n}-0.0123456789abcdef.bin" for n in range(files)])
    times = []
    for _ in range(5):
        start = time.perf_counter()
        decode_manifest(raw)
        times.append(time.perf_counter() - start)
    return len(raw), median(times)


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--steps", type=int, default=10_000, help="committed steps (default 10000; 0: S3 only)"
    )
    p.add_argument("--files", type=int, default=1_000, help="data files per step (default 1000)")
    p.add_argument(
        "--manifest-files", type=int, default=1, help="files each manifest names (default 1)"
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--old", default="HEAD", help="the git revision to compare (default HEAD)")
    p.add_argument("--s3-steps", type=int, default=100, help="steps on S3; 0: skip S3")
    p.add_argument("--s3-files", default="10,40", help="files per step on S3, one root each")
    p.add_argument(
        "--s3-latency-ms", type=float, default=0.0, help="added to every S3 request (default 0)"
    )
    p.add_argument("--keep-root", action="store_true", help="leave the local root in place")
    p.add_argument("--json", type=Path, default=None, help="also write the raw samples here")
    add_root(p, "scratch directory (default: bench_out/ in the repo)")
    args = p.parse_args()
    scratch = args.root / "many_files"
    print_header(__file__, args.root)
    versions = {"old": old_tree(args.old, scratch), "new": REPO}
    print(f"- old: git {args.old}; new: this working tree")

    record: dict[str, Any] = {"args": args_record(args)}
    if args.steps:
        record["local"] = run_local(args, scratch, versions)
    if args.s3_steps:
        record["s3"] = run_s3(args, versions)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


def run_local(args: Any, scratch: Path, versions: dict[str, Path]) -> dict[str, list[float]]:
    """The local root: build it, time every op at both versions, print the table."""
    local = LocalRoot(scratch, args.steps, args.files, args.manifest_files)
    built = local.build()
    names = args.steps * (args.files + 2) + 3
    print(
        f"- local root: {args.steps} steps x {args.files} files ({names} names, "
        f"{args.steps * 2 + 2} directories) built in {built:.1f} s "
        f"({names / built:,.0f} names/s); manifests name {args.manifest_files} file(s)"
    )
    size, seconds = decode_seconds(args.files)
    print(
        f"- a manifest naming {args.files} files is {size / 1e3:.0f} kB and decodes in "
        f"{seconds * 1e3:.1f} ms: `ls` reads every manifest, so on a root whose manifests "
        f"name {args.files} files it takes at least {args.steps} x that "
        f"({args.steps * seconds:.0f} s), with either version"
    )
    try:
        samples = measure(versions, local, args.steps - 1, {}, "-", args.repeat)
    finally:
        if not args.keep_root:
            shutil.rmtree(local.path)
            shutil.rmtree(local.sources)
    print()
    print(f"Local disk ({args.steps} steps x {args.files} files): seconds, median of {args.repeat}")
    print()
    rows = []
    for op in OPS:
        old = [r["seconds"] for r in samples[(op, "old")]]
        new = [r["seconds"] for r in samples[(op, "new")]]
        rows.append(
            [
                op,
                f"{median(old):.3f}",
                f"{median(new):.3f}",
                f"{median(old) / median(new):.1f}x",
                spread(old, 3),
                spread(new, 3),
            ]
        )
    print(markdown_table("operation | old s | new s | old/new | old spread | new spread", rows))
    return {f"{op}/{v}": [r["seconds"] for r in rs] for (op, v), rs in samples.items()}


def run_s3(args: Any, versions: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """The S3 roots: every op once at both versions, requests counted; print the table."""
    endpoint, options, server = counting_s3(args.s3_latency_ms / 1e3)
    count_url = f"{endpoint}/__count__"
    rows, record = [], {}
    try:
        for files in (int(f) for f in args.s3_files.split(",")):
            s3 = S3Root(endpoint, args.s3_steps, files, args.manifest_files)
            s3.build()
            got = measure(versions, s3, args.s3_steps - 1, options, count_url, 1)
            for op in OPS:
                old, new = got[(op, "old")][0], got[(op, "new")][0]
                rows.append(
                    [
                        op,
                        f"{args.s3_steps} x {files}",
                        old["requests"],
                        new["requests"],
                        f"{old['seconds']:.2f}",
                        f"{new['seconds']:.2f}",
                    ]
                )
                record[f"{op}/{files}"] = {
                    "requests": {"old": old["requests"], "new": new["requests"]},
                    "seconds": {"old": old["seconds"], "new": new["seconds"]},
                }
    finally:
        server.shutdown()
    print()
    latency = f", {args.s3_latency_ms:g} ms added to each" if args.s3_latency_ms else ""
    print(f"S3 (moto on loopback{latency}): HTTP requests the server received during each op")
    print()
    print(
        markdown_table(
            "operation | steps x files | old requests | new requests | old s | new s", rows
        )
    )
    return record


if __name__ == "__main__":
    main()

"""Many files: finding a root's steps, ``ls``, ``gc`` and retention
cost requests per step, never per file, and never list inside a step on their own.

On S3 every HTTP request moto's server receives is counted (a WSGI layer in
front of it), for the same steps at two file counts. On a local disk inotify
reports every open(2) inside the steps: listing a directory opens it, reading a
file opens it (a ``stat`` opens nothing and is not seen).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import torch
from _s3 import S3Server, free_port
from click.testing import CliRunner

from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.checkpoint import CheckpointRoot
from dcp_multilevel.cli import main
from dcp_multilevel.levels import driver_for
from dcp_multilevel.stores import store_for
from dcp_multilevel.testing.manifests import tiny_manifest

STEPS = 12
FILES = (2, 24)  # per step: every count below must be the same for both


def data_names(files: int) -> list[str]:
    return [f"data/{n}-0.0123456789abcdef.bin" for n in range(files)]


def manifest(step: int, files: list[str]) -> bytes:
    """A real manifest: one 16-byte tensor in each of ``files``."""
    return tiny_manifest(files, save_id=f"s{step}", world_size=1, created_unix=1.7e9 + step)


def cli(*argv: str, options: dict | None = None) -> Any:
    extra = ["--storage-options", json.dumps(options)] if options else []
    result = CliRunner().invoke(main, [*argv, *extra, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- S3, counted


class RequestLog:
    """moto's WSGI app, recording each request it serves: (method, key path, query)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        #: Paths answered 403 (access denied) instead of being served.
        self.refused: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        request = (
            environ["REQUEST_METHOD"],
            environ.get("PATH_INFO", ""),
            parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
        )
        with self._lock:
            self.requests.append(request)
            refused = request[1] in self.refused
        if refused:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [b""]
        return self.app(environ, start_response)

    def during(self, fn: Any) -> tuple[Any, list[tuple[str, str, dict[str, list[str]]]]]:
        """``fn()`` and the requests the server received meanwhile."""
        with self._lock:
            start = len(self.requests)
        out = fn()
        with self._lock:
            return out, self.requests[start:]


@pytest.fixture(scope="module")
def counted() -> Iterator[tuple[S3Server, RequestLog]]:
    """A moto S3 server of its own whose requests are recorded."""
    import logging

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    log = RequestLog(DomainDispatcherApplication(create_backend_app))
    port = free_port()
    server = make_server("127.0.0.1", port, log, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield S3Server(endpoint_url=f"http://127.0.0.1:{port}"), log
    finally:
        server.shutdown()
        thread.join()


class S3Root:
    """``STEPS`` committed steps of ``files`` data files each and one newer step without
    a manifest, in a bucket of its own."""

    def __init__(self, server: S3Server, files: int) -> None:
        self.server, self.files = server, files
        self.bucket = server.new_bucket()
        self.url = f"s3://{self.bucket}/root"
        self.client = server.client()
        for step in range(STEPS):
            self.put_step(step)
        self.put(f"step-{STEPS}/data/0-0.fedcba9876543210.bin")

    def put(self, key: str, body: bytes = b"x" * 16) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"root/{key}", Body=body)

    def put_step(self, step: int) -> None:
        for name in data_names(self.files):
            self.put(f"step-{step}/{name}")
        self.put(f"step-{step}/manifest.json", manifest(step, data_names(self.files)))


@pytest.fixture(scope="module")
def s3_roots(counted: tuple[S3Server, RequestLog]) -> dict[int, S3Root]:
    return {files: S3Root(counted[0], files) for files in FILES}


def listed_prefixes(requests: Iterable[tuple[str, str, dict]], bucket: str) -> list[str]:
    """The ``Prefix`` of every listing (ListObjectsV2) of ``bucket`` among ``requests``."""
    return [
        q.get("prefix", [""])[0]
        for method, path, q in requests
        if method == "GET" and path.strip("/") == bucket and "list-type" in q
    ]


def kinds(requests: Iterable[tuple[str, str, dict]]) -> Counter:
    """Requests by kind: ``list``, ``delete`` (DeleteObjects), else the HTTP method."""
    out: Counter = Counter()
    for method, _, q in requests:
        out["list" if "list-type" in q else "delete" if "delete" in q else method] += 1
    return out


def step_prefixes(prefixes: Iterable[str]) -> Counter:
    """How often each step's own prefix (``root/step-<N>/``) was listed."""
    return Counter(p for p in prefixes if re.fullmatch(r"root/step-\d+/", p))


def committed_by(op: str, url: str, options: dict) -> list[int]:
    """The committed steps ``op`` finds below ``url`` (gc: the ones it keeps)."""
    if op == "discovery":
        return driver_for(Level(url, storage_options=options)).steps()
    if op == "scan":
        return list(CheckpointRoot(url, options).scan().committed)
    if op == "ls":
        listing = cli("ls", url, options=options)["roots"][0]["checkpoints"]
        return [c["step"] for c in listing if c["complete"]]
    return cli("gc", url, "--keep", "2", "--dry-run", options=options)["kept"]


@pytest.mark.parametrize("op", ["discovery", "scan", "ls", "gc --dry-run"])
def test_s3_requests_grow_with_steps_never_with_files(counted, s3_roots, op):
    server, log = counted
    options = server.storage_options
    per_files = {}
    for files, root in s3_roots.items():
        run = functools.partial(committed_by, op, root.url, options)
        found, requests = log.during(run)
        assert list(found) == (list(range(STEPS)) if op != "gc --dry-run" else [10, 11])
        prefixes = listed_prefixes(requests, root.bucket)
        # Nothing lists a step's own prefix: one lookup of its manifest answers.
        assert step_prefixes(prefixes) == Counter()
        per_files[files] = (len(requests), kinds(requests))
    (n, by_kind), (m, _) = per_files.values()
    assert n == m, per_files  # the same requests whatever the number of files
    # 13 step directories (one without a manifest): one root listing each time the
    # root is looked at, one HEAD per manifest (plus a 1-key listing for the missing
    # one), and for ls/gc the manifests they read (a HEAD and a GET each).
    scans = {"discovery": 1, "scan": 1, "ls": 2, "gc --dry-run": 2}[op]
    scan = 1 + (STEPS + 1) + 1
    reads = {"discovery": 0, "scan": 0, "ls": STEPS, "gc --dry-run": 2}[op]
    # ls and gc first ask whether ROOT is itself a checkpoint (a HEAD and a listing).
    probe = 2 if op in ("ls", "gc --dry-run") else 0
    assert n <= probe + scans * scan + 2 * reads, by_kind


def test_s3_gc_removes_a_step_with_one_listing_of_its_prefix_and_batched_deletes(counted):
    server, log = counted
    root = S3Root(server, 30)
    plan, requests = log.during(
        lambda: cli("gc", root.url, "--keep", str(STEPS - 1), options=server.storage_options)
    )
    assert plan["expired"] == [0]
    assert server.keys(root.bucket, "root/step-0/") == []
    assert len(server.keys(root.bucket, "root/")) == (STEPS - 1) * 31 + 1
    prefixes = listed_prefixes(requests, root.bucket)
    assert step_prefixes(prefixes) == Counter({"root/step-0/": 1})
    by_kind = kinds(requests)
    assert by_kind["delete"] == 2  # the manifest first, then the 30 data files at once
    assert by_kind["DELETE"] == 0  # never one request per file


def test_s3_existing_asks_once_per_path_concurrently(counted, s3_roots):
    server, log = counted
    root = s3_roots[FILES[0]]
    store = store_for(root.url, **server.storage_options)
    asked = [f"step-{s}/manifest.json" for s in range(STEPS + 1)] + ["step-1/data", "nothing"]
    found, requests = log.during(lambda: store.existing(asked))
    assert found == {f"step-{s}/manifest.json" for s in range(STEPS)} | {"step-1/data"}
    # One HEAD per path; a path that is no object is then asked as a prefix (1 key).
    assert kinds(requests) == Counter({"HEAD": len(asked), "list": 3})


def test_s3_a_lookup_that_fails_is_no_answer(counted, s3_roots):
    # Access denied on one manifest must not make its step look unfinished (retention
    # would delete it): the scan raises instead.
    server, log = counted
    root = s3_roots[FILES[0]]
    denied = f"/{root.bucket}/root/step-4/manifest.json"
    log.refused.add(denied)
    try:
        with pytest.raises(PermissionError):
            CheckpointRoot(root.url, server.storage_options).scan()
    finally:
        log.refused.discard(denied)


# --------------------------------------------------------------------------- local, inotify

IN_OPEN = 0x20
IN_Q_OVERFLOW = 0x4000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC


class Opens:
    """Every open(2) of the watched directories and of the entries in them (inotify)."""

    def __init__(self, directories: Iterable[Path]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"inotify: {os.strerror(ctypes.get_errno())}")
        self.watched: dict[int, Path] = {}
        for d in directories:
            wd = libc.inotify_add_watch(self.fd, os.fsencode(d), IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self.watched[wd] = d

    def take(self) -> set[Path]:
        """What was opened since the last call (a directory opened: it was listed)."""
        out: set[Path] = set()
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(buf):
                wd, mask, _, length = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16 : pos + 16 + length].rstrip(b"\0").decode()
                pos += 16 + length
                assert not mask & IN_Q_OVERFLOW, "inotify dropped events"
                out.add(self.watched[wd] / name if name else self.watched[wd])

    def close(self) -> None:
        os.close(self.fd)


def put_local_step(root: Path, step: int, files: int) -> None:
    """A step as a save leaves it: data files, then the manifest; the data directory
    dated before the manifest whatever the clock's resolution."""
    data = root / f"step-{step}" / "data"
    data.mkdir(parents=True)
    for name in data_names(files):
        (data.parent / name).write_bytes(b"x" * 16)
    (data.parent / "manifest.json").write_bytes(manifest(step, data_names(files)))
    committed = (data.parent / "manifest.json").stat().st_mtime_ns
    os.utime(data, ns=(committed - 10**9, committed - 10**9))


@pytest.fixture
def local_root(tmp_path: Path) -> Iterator[tuple[Path, Opens]]:
    """10 committed steps of 30 files, step 10 without a manifest; every step directory
    and data directory watched."""
    root = tmp_path / "root"
    for step in range(10):
        put_local_step(root, step, 30)
    (root / "step-10" / "data").mkdir(parents=True)
    (root / "step-10" / "data" / "0-0.fedcba9876543210.bin").write_bytes(b"x")
    opens = Opens([d for step in root.iterdir() for d in (step, step / "data")])
    yield root, opens
    opens.close()


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")


@linux_only
def test_local_discovery_and_ls_open_nothing_inside_a_step_but_its_manifest(local_root):
    root, opens = local_root
    assert driver_for(Level(str(root))).steps() == list(range(10))
    assert CheckpointRoot(str(root)).scan().uncommitted == (10,)
    assert opens.take() == set()  # a stat of each manifest; no listing, no open
    listing = cli("ls", str(root))["roots"][0]["checkpoints"]
    assert [c["step"] for c in listing if c["complete"]] == list(range(10))
    # Each committed step: its manifest; the step without one: one listing of its
    # data directory (is it one node's part of a node-local step?).
    assert opens.take() == {
        *(root / f"step-{s}" / "manifest.json" for s in range(10)),
        root / "step-10" / "data",
    }


@linux_only
def test_local_gc_reads_kept_manifests_and_lists_no_settled_data_directory(local_root):
    root, opens = local_root
    # A crashed second save of step 9 left a temporary file after the commit: that
    # data directory changed since its manifest and is walked (and the file found).
    tmp = root / "step-9" / "data" / "5-0.0123456789abcdef.bin.tmp-a1b2c3"
    tmp.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    opens.take()
    plan = cli("gc", str(root), "--keep", "2", "--dry-run")
    assert plan["expired"] == list(range(8)) and plan["kept"] == [8, 9]
    assert plan["temporaries"] == [str(tmp.relative_to(root))]
    opened = opens.take()
    steps = [root / f"step-{s}" for s in range(11)]
    # Only the kept steps' manifests are read (no deltas here: nothing else is needed).
    assert {p for p in opened if p.name == "manifest.json"} == {
        steps[8] / "manifest.json",
        steps[9] / "manifest.json",
    }
    # The sweep lists each step directory once; inside them only the changed data
    # directory of step 9 and the unfinished step 10's are listed.
    assert {p for p in opened if p.name == "data"} == {steps[9] / "data", steps[10] / "data"}
    assert opened - {p for p in opened if p.name in ("manifest.json", "data")} == set(steps)


@linux_only
def test_local_retention_removes_a_step_without_listing_the_others(local_root):
    root, opens = local_root
    mgr = CheckpointManager([Level(str(root), keep=9)], sweep_older_than_s=3600)
    try:
        opened = opens.take()  # the sweep at construction: step directories only
        assert opened == {root / f"step-{s}" for s in range(10)} | {
            root / "step-10",
            root / "step-10" / "data",
        }
        driver = mgr.drivers[0]
        found = driver.scan()
        assert found.committed == tuple(range(10)) and found.uncommitted == (10,)
        driver.delete(0)
        opened = opens.take()
    finally:
        mgr.close()
    assert not (root / "step-0").exists()
    step0 = root / "step-0"  # rmtree lists what it removes; no other step is opened
    assert all(p == step0 or step0 in p.parents for p in opened), opened


# --------------------------------------------------------------------------- the sweep's rule


def sweep_plan(root: Path) -> list[str]:
    return sorted(CheckpointRoot(str(root)).sweep(3600, dry_run=True))


def test_sweep_passes_over_a_data_directory_unchanged_since_its_manifest(tmp_path):
    root = tmp_path / "root"
    put_local_step(root, 1, 3)
    data = root / "step-1" / "data"
    tmp = data / "0-0.x.bin.tmp-123456"
    tmp.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    committed = (root / "step-1" / "manifest.json").stat().st_mtime_ns
    # Dated after the manifest (a save of this step again): walked, the file found.
    os.utime(data, ns=(committed + 1, committed + 1))
    assert sweep_plan(root) == ["step-1/data/0-0.x.bin.tmp-123456"]
    # Dated as the manifest (a coarse clock cannot tell the order): walked.
    os.utime(data, ns=(committed, committed))
    assert sweep_plan(root) == ["step-1/data/0-0.x.bin.tmp-123456"]
    # Older than the manifest: settled at the commit, which swept it; not listed.
    os.utime(data, ns=(committed - 1, committed - 1))
    assert sweep_plan(root) == []
    # The manifest gone (no checkpoint): everything below the step is walked again.
    (root / "step-1" / "manifest.json").unlink()
    assert sweep_plan(root) == ["step-1/data/0-0.x.bin.tmp-123456"]


def test_a_drain_to_a_store_level_removes_an_earlier_attempts_leftovers(tmp_path):
    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    # A drain of step 5 that died: a data file and a temporary, no manifest.
    dead = l2 / "step-5" / "data"
    dead.mkdir(parents=True)
    (dead / "0-0.deaddeaddeaddead.bin").write_bytes(b"x" * 64)
    (dead / "0-1.deaddeaddeaddead.bin.tmp-abcdef").write_bytes(b"x")
    mgr = CheckpointManager(
        [Level(str(l1)), Level(str(l2))], drain_policy="wait", sweep_older_than_s=None
    )
    try:
        mgr.save({"w": torch.arange(64.0)}, step=5)
        (result,) = mgr.wait()
        assert result.committed
    finally:
        mgr.close()
    named = set(CheckpointRoot(str(l2)).checkpoint(5).manifest().files)
    assert {f"data/{p.name}" for p in dead.iterdir()} == named


def test_ls_describes_the_newest_steps_and_counts_the_others(tmp_path, monkeypatch):
    # Each described step costs a manifest read (tens of ms for 1,000 files): by
    # default ls reads the newest NEWEST and counts the older ones; --all reads all.
    from dcp_multilevel.cli import ls as ls_module

    monkeypatch.setattr(ls_module, "NEWEST", 4)
    root = tmp_path / "root"
    for step in range(7):
        put_local_step(root, step, 2)
    (root / "step-7" / "data").mkdir(parents=True)  # no manifest: incomplete
    listing = cli("ls", str(root))["roots"][0]
    assert [c["step"] for c in listing["checkpoints"]] == [4, 5, 6, 7]
    assert listing["older"] == {"complete": 4, "incomplete": 0}
    every = cli("ls", str(root), "--all")["roots"][0]
    assert [c["step"] for c in every["checkpoints"]] == list(range(8)) and "older" not in every
    table = CliRunner().invoke(main, ["ls", str(root)])
    assert table.exit_code == 0 and "4 older step(s) (0 incomplete): --all" in table.output

"""The remotes ``bench_manager.py`` saves to: a throttled local directory and S3 on loopback.

* ``throttled:///<dir>``: an fsspec filesystem (registered on import): a local
  directory behind a simulated link of ``mbps`` MB/s. Every upload
  (``put_file``/``pipe_file``) and download (``cat_file``) holds one shared link
  per direction for ``bytes / bandwidth`` seconds (FIFO), the real copy running
  inside that time. The link is shared within one process, or, with
  ``link_dir=<dir>``, by every process that names the same directory (a
  simulated node's ranks sharing its network link).
* :func:`moto_s3`: a moto ``ThreadedMotoServer`` on 127.0.0.1 (a free port, dummy
  credentials, ``AWS_ENDPOINT_URL``), run in a child process so that its request
  handling does not compete for the measuring process's GIL; reached with s3fs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

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


class _FileLink:
    """A :class:`_Link` whose state is a file, so that processes share it.

    The time the link is next free (``time.monotonic``, one clock for every
    process on a Linux machine) is kept in ``path`` and updated under an
    exclusive ``flock``: transfers from every process naming the file queue
    FIFO on it.
    """

    def __init__(self, path: str, bytes_per_s: float) -> None:
        self.path = path
        self.bytes_per_s = bytes_per_s

    def hold(self, nbytes: int) -> float:
        """Reserve the link for ``nbytes``; return the ``time.monotonic`` it ends."""
        # Every call opens the file anew: flock then also orders this process's threads.
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                text = f.read().decode() or "0"
                start = max(time.monotonic(), float(text))
                free_at = start + nbytes / self.bytes_per_s
                f.seek(0)
                f.truncate()
                f.write(repr(free_at).encode())
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return free_at

    @staticmethod
    def until(t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _shared_link(link_dir: str, mbps: float, direction: str) -> _FileLink:
    os.makedirs(link_dir, exist_ok=True)
    return _FileLink(os.path.join(link_dir, f"{direction}-{mbps:g}"), mbps * 1e6)


class ThrottledFileSystem(LocalFileSystem):
    """``throttled:///path``: a local directory behind a bandwidth-limited link.

    Uploads (``put_file``, ``pipe_file``) and downloads (``cat_file``) take at
    least ``bytes / (mbps * 1e6)`` seconds each, queued on one link per
    direction shared by every instance with the same ``mbps`` in this process,
    or, with ``link_dir``, by every instance in any process with the same
    ``link_dir`` and ``mbps``; metadata calls (``info``, ``ls``, ``rm``) are free.
    """

    protocol = ("throttled",)

    def __init__(self, mbps: float = 200.0, link_dir: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(**kwargs)
        self.mbps = float(mbps)
        self.link_dir = link_dir

    def _hold(self, direction: str, nbytes: int) -> Callable[[], None]:
        """Reserve this filesystem's link in ``direction``; returns the wait for its end."""
        if self.link_dir is None:
            done = _link(self.mbps, direction).hold(nbytes)
            return lambda: _Link.until(done)
        done = _shared_link(self.link_dir, self.mbps, direction).hold(nbytes)
        return lambda: _FileLink.until(done)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("throttled://"):
            path = path[len("throttled://") :]
        return super()._strip_protocol(path)

    def put_file(self, lpath: str, rpath: str, callback: Any = None, **kwargs: Any) -> None:
        wait = self._hold("up", os.path.getsize(lpath))
        super().put_file(lpath, rpath, callback=callback, **kwargs)
        wait()

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        wait = self._hold("up", len(value))
        super().pipe_file(path, value, *args, **kwargs)
        wait()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        data = super().cat_file(path, start=start, end=end, **kw)
        self._hold("down", len(data))()
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server in a child process; yields the URL of a new bucket on it and
    the s3fs storage options to reach it."""
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
        options = {
            "key": env["AWS_ACCESS_KEY_ID"],
            "secret": env["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        yield f"s3://{_new_bucket(options)}", options
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

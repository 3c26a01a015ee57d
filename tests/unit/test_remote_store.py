"""Remote (fsspec) store: the shared conformance suite on memory://, on s3:// against a
real S3 server on loopback, and on a flaky remote; retries, give-up errors, size
checks, spooling, and DCP round trips through MultiLevelWriter/Reader."""

from __future__ import annotations

import errno
import logging
import socket
import time
import uuid
from typing import TYPE_CHECKING

import fsspec
import pytest
import torch.distributed.checkpoint as dcp
from _faulty_fs import OPERATIONS, FaultyFileSystem
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError
from conftest import install_fake_distribution
from test_roundtrip import assert_state_equal, zeros_like_state
from test_stores import StoreTests

from dcp_multilevel import ConfigError, MultiLevelReader, MultiLevelWriter
from dcp_multilevel.errors import DcpMultilevelError, RegistryError
from dcp_multilevel.stores import STORES, Store, store_for
from dcp_multilevel.stores import remote as remote_mod
from dcp_multilevel.stores.remote import SPOOL_PREFIX, RemoteStore, RemoteStoreError

if TYPE_CHECKING:
    from _s3 import S3Server

pytest_plugins = ["_s3"]

#: The advice every give-up message ends with.
ADVICE = (
    "The storage may be unreachable, overloaded or misconfigured: check the endpoint, "
    "network and credentials, and retry; storage_options={'retries': N, 'backoff': seconds} "
    "(of the Level, or of the writer or reader without levels) sets how long to keep trying."
)

#: What a refused connection's error says after the failing request.
NOT_RETRIED = (
    "Another attempt would get the same answer: check the endpoint in the storage options "
    "(s3fs: client_kwargs={'endpoint_url': ...}) or the environment (AWS_ENDPOINT_URL for "
    "S3), and that the storage service runs there."
)


def unique_root() -> str:
    return f"dcp-ml-{uuid.uuid4().hex[:12]}/root"


@pytest.fixture
def memory_root():
    """A fresh memory:// root (the memory store is process-global), removed afterwards."""
    root = unique_root()
    yield root
    RemoteStore(f"memory://{root.split('/')[0]}").remove_tree("")


def faulty(root: str, *, retries: int = 3, backoff: float = 0.0, **faults) -> RemoteStore:
    """A RemoteStore on faulty://<root> over memory (or ``target_protocol=...``).

    Its own filesystem instance, so fault counters start at zero.
    """
    faults.setdefault("target_protocol", "memory")
    return RemoteStore(
        f"faulty://{root}", retries=retries, backoff=backoff, skip_instance_cache=True, **faults
    )


def fs_of(store: RemoteStore) -> FaultyFileSystem:
    assert isinstance(store.fs, FaultyFileSystem)
    return store.fs


# ---------------------------------------------------------------- conformance suite


class RemoteStoreTests(StoreTests):
    """Object stores list a key when asked for its "directory": check that is hidden."""

    def test_listdir_of_a_file_is_empty(self, store):
        store.write_atomic("top.bin", b"x")
        assert store.listdir("top.bin") == []

    def test_listdir_of_a_directory_holding_its_namesake(self, store):
        store.write_atomic("d/d", b"x")
        assert store.listdir("d") == ["d"]
        assert store.listdir("d/d") == []


class TestMemoryStore(RemoteStoreTests):
    @pytest.fixture
    def store(self, memory_root) -> Store:
        return RemoteStore(f"memory://{memory_root}", backoff=0)

    def test_url_and_no_atomic_rename(self, memory_root):
        store = RemoteStore(f"memory://{memory_root}/")
        assert store.url == f"memory://{memory_root}"
        assert not store.supports_atomic_rename
        assert repr(store) == f"RemoteStore('memory://{memory_root}')"


class TestS3Store(RemoteStoreTests):
    @pytest.fixture
    def store(self, s3_server: S3Server, s3_bucket: str) -> Store:
        return RemoteStore(f"s3://{s3_bucket}/root", **s3_server.storage_options)

    def test_objects_land_under_the_prefix(self, store, s3_server, s3_bucket):
        store.write_atomic("a/x.bin", b"1")
        with store.open_write("a/y.bin") as f:
            f.write(b"22")
        assert s3_server.keys(s3_bucket) == ["root/a/x.bin", "root/a/y.bin"]

    @pytest.mark.parametrize(("options", "parts"), [({}, 3), ({"upload_part_bytes": 5 << 20}, 4)])
    def test_a_large_file_goes_up_in_parts(self, s3_server, s3_bucket, options, parts):
        # 20 MiB in 8 MiB parts (the default) is 3 parts, in 5 MiB parts 4: S3 names a
        # multipart upload's object by its ETag's "-<parts>".
        store = RemoteStore(f"s3://{s3_bucket}/p", **s3_server.storage_options, **options)
        data = bytes(range(256)) * (80 << 10)
        with store.open_write("big.bin") as f:
            f.write(data)
        head = s3_server.client().head_object(Bucket=s3_bucket, Key="p/big.bin")
        assert head["ETag"].strip('"').endswith(f"-{parts}")
        assert store.read_bytes("big.bin") == data

    def test_credentials_and_endpoint_from_the_environment(self, s3_env, s3_bucket):
        store = store_for(f"s3://{s3_bucket}/env", sync=False)
        assert type(store) is RemoteStore
        store.write_atomic("m.json", b"{}")
        assert store.read_bytes("m.json") == b"{}"
        assert s3_env.keys(s3_bucket) == ["env/m.json"]


class TestFlakyStore(RemoteStoreTests):
    """Every operation fails 30% of the time; retries hide it completely."""

    @pytest.fixture
    def store(self, memory_root) -> Store:
        rates = dict.fromkeys(OPERATIONS, 0.3)
        return faulty(memory_root, retries=12, fail_rate=rates, seed=1)

    def test_faults_were_really_injected(self, store):
        for i in range(10):
            store.write_atomic(f"{i}.bin", b"x")
            assert store.read_bytes(f"{i}.bin") == b"x"
        assert fs_of(store).injected["pipe_file"] > 0
        assert fs_of(store).injected["cat_file"] > 0


# ---------------------------------------------------------------- registry and options


@pytest.mark.parametrize("scheme", ["s3", "s3a", "gs", "gcs", "az", "abfs", "memory"])
def test_remote_schemes_are_registered_through_the_entry_point_group(scheme):
    assert STORES.get(scheme) is RemoteStore


def test_tier_for_builds_a_remote_tier_and_ignores_sync(memory_root):
    store = store_for(f"memory://{memory_root}", sync=False)
    assert type(store) is RemoteStore
    assert store.url == f"memory://{memory_root}"


def test_missing_fsspec_backend_says_what_to_install():
    try:
        fsspec.get_filesystem_class("gs")
    except ImportError as e:
        fsspec_says = str(e)
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(RegistryError) as info:
        RemoteStore("gs://bucket/x")
    assert str(info.value) == (
        "remote store gs://bucket/x needs the fsspec backend for 'gs', which cannot be "
        f"imported: {fsspec_says}"
    )


def test_url_fsspec_cannot_open_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        RemoteStore("nosuchproto://x")
    assert str(info.value) == (
        "remote store nosuchproto://x: fsspec cannot open this URL: Protocol not known: nosuchproto"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retries": -1}, "RemoteStore retries must be an integer >= 0, got -1"),
        ({"retries": 1.5}, "RemoteStore retries must be an integer >= 0, got 1.5"),
        ({"backoff": -0.1}, "RemoteStore backoff must be a number >= 0, got -0.1"),
        (
            {"backoff": 2, "backoff_max": 1},
            "RemoteStore backoff_max must be a number >= backoff (2), got 1",
        ),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ConfigError) as info:
        RemoteStore("memory://x", **options)
    assert str(info.value) == message


# ---------------------------------------------------------------- retries


def _upload(store):
    with store.open_write("d/a.bin") as f:
        f.write(b"spooled")
    return "d/a.bin", b"spooled"


def _write_atomic(store):
    store.write_atomic("d/a.bin", b"manifest")
    return "d/a.bin", b"manifest"


def _check_read_bytes(store, clean):
    clean.write_atomic("d/a.bin", b"whole")
    assert store.read_bytes("d/a.bin") == b"whole"


def _check_read_into(store, clean):
    clean.write_atomic("d/a.bin", b"0123456789")
    with store.open_read("d/a.bin") as r:
        buf = bytearray(4)
        assert r.read_into(3, memoryview(buf)) == 4
    assert buf == b"3456"


def _check_exists(store, clean):
    clean.write_atomic("d/a.bin", b"x")
    assert store.exists("d/a.bin")
    assert store.exists("d")


def _check_listdir(store, clean):
    clean.write_atomic("d/b.bin", b"x")
    clean.write_atomic("d/a.bin", b"x")
    assert store.listdir("d") == ["a.bin", "b.bin"]


def _check_remove_tree(store, clean):
    clean.write_atomic("d/a.bin", b"x")
    store.remove_tree("d")
    assert not clean.exists("d/a.bin")


@pytest.mark.parametrize(
    ("failing", "write"),
    [("put_file", _upload), ("pipe_file", _write_atomic), ("info", _write_atomic)],
    ids=["open_write-upload", "write_atomic-put", "write_atomic-size-check"],
)
def test_transient_upload_failures_are_retried_as_whole_uploads(memory_root, failing, write):
    store = faulty(memory_root, retries=3, fail_first={failing: 3})
    path, data = write(store)
    assert RemoteStore(f"memory://{memory_root}").read_bytes(path) == data
    assert fs_of(store).injected[failing] == 3


@pytest.mark.parametrize(
    ("failing", "check"),
    [
        ("cat_file", _check_read_bytes),
        ("cat_file", _check_read_into),
        ("info", _check_read_into),
        ("info", _check_exists),
        ("ls", _check_listdir),
        ("rm", _check_remove_tree),
    ],
    ids=["read_bytes", "read_into", "open_read-stat", "exists", "listdir", "remove_tree"],
)
def test_transient_failures_of_every_operation_are_retried(memory_root, failing, check):
    store = faulty(memory_root, retries=3, fail_first={failing: 3})
    check(store, RemoteStore(f"memory://{memory_root}"))
    assert fs_of(store).injected[failing] >= 3
    assert fs_of(store).calls[failing] > fs_of(store).injected[failing]


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError,
        TimeoutError,
        lambda m: OSError(f"503 Slow Down: {m}"),  # what s3fs makes of a 5xx it does not map
        lambda m: EndpointConnectionError(endpoint_url=m),
        lambda m: ReadTimeoutError(endpoint_url=m),
    ],
    ids=["ConnectionError", "TimeoutError", "OSError-5xx", "botocore-connect", "botocore-read"],
)
def test_transient_error_kinds(memory_root, error):
    store = faulty(memory_root, retries=2, fail_first={"pipe_file": 2}, error=error)
    store.write_atomic("m.json", b"{}")
    assert fs_of(store).calls["pipe_file"] == 3


@pytest.mark.parametrize(
    "error",
    [
        PermissionError,
        FileNotFoundError,
        ValueError,
        lambda m: OSError(errno.EINVAL, "The requested range is not satisfiable", m),
    ],
    ids=["PermissionError", "FileNotFoundError", "ValueError", "OSError-EINVAL"],
)
def test_errors_retrying_cannot_fix_are_raised_at_once_unchanged(memory_root, error):
    store = faulty(memory_root, retries=5, fail_first={"pipe_file": 1}, error=error)
    expected = type(error("probe"))
    with pytest.raises(expected) as info:
        store.write_atomic("m.json", b"{}")
    assert type(info.value) is expected
    assert fs_of(store).calls["pipe_file"] == 1


def test_missing_object_is_file_not_found_naming_its_url_without_retries(memory_root):
    store = faulty(memory_root, retries=5)
    url = f"faulty://{memory_root}/nope.bin"
    for action in (store.read_bytes, lambda p: store.open_read(p).__enter__()):
        with pytest.raises(FileNotFoundError) as info:
            action("nope.bin")
        assert str(info.value) == f"[Errno 2] no such object: '{url}'"
    assert not store.exists("nope.bin")
    assert fs_of(store).calls["info"] == 2
    assert fs_of(store).calls["cat_file"] == 1


def test_a_retry_is_logged(memory_root, caplog):
    store = faulty(memory_root, retries=1, fail_first={"cat_file": 1})
    RemoteStore(f"memory://{memory_root}").write_atomic("m.json", b"{}")
    with caplog.at_level(logging.WARNING, logger="dcp_multilevel.stores.remote"):
        assert store.read_bytes("m.json") == b"{}"
    assert caplog.messages == [
        f"remote store: read faulty://{memory_root}/m.json failed (attempt 1 of 2: "
        f"ConnectionError: injected fault: cat_file call 1 ({memory_root}/m.json)); "
        "retrying in 0.00 s"
    ]


def test_backoff_doubles_with_jitter_up_to_the_cap():
    store = RemoteStore("memory://x", backoff=0.2, backoff_max=1.0)
    for attempt, cap in [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (30, 1.0)]:
        delays = [store._retry_delay(attempt) for _ in range(200)]
        assert all(cap / 2 <= d <= cap for d in delays), attempt
        assert len(set(delays)) > 1  # jittered


def test_retries_really_wait(memory_root):
    store = faulty(memory_root, retries=2, backoff=0.05, fail_first={"pipe_file": 2})
    start = time.monotonic()
    store.write_atomic("m.json", b"{}")
    # Waits of at least 0.025 s and 0.05 s (half of 0.05 and 0.1, the jitter floor).
    assert time.monotonic() - start >= 0.075


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (
            lambda m: ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused", m),
            "the endpoint refused the connection (nothing listens there); "
            "ConnectionRefusedError: [Errno 111] Connection refused: '{m}'",
        ),
        (
            lambda m: socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
            "the endpoint's host name does not resolve; "
            "gaierror: [Errno -2] Name or service not known",
        ),
    ],
    ids=["refused", "unknown-host"],
)
def test_an_unreachable_endpoint_is_not_retried(memory_root, error, why):
    store = faulty(memory_root, retries=5, fail_first={"pipe_file": 1}, error=error)
    with pytest.raises(RemoteStoreError) as info:
        store.write_atomic("m.json", b"{}")
    target = f"{memory_root}/m.json"
    assert str(info.value) == (
        f"remote store: upload faulty://{target} failed and was not retried: "
        f"{why.format(m=f'injected fault: pipe_file call 1 ({target})')}. {NOT_RETRIED}"
    )
    assert info.value.attempts == 1
    assert fs_of(store).calls["pipe_file"] == 1


def test_a_name_lookup_that_timed_out_is_retried(memory_root):
    error = lambda m: socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")  # noqa: E731
    store = faulty(memory_root, retries=2, fail_first={"pipe_file": 2}, error=error)
    store.write_atomic("m.json", b"{}")
    assert fs_of(store).calls["pipe_file"] == 3


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that refuses connections: bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refusing(port: int, **config: object) -> dict[str, object]:
    """s3fs options of an endpoint on ``port`` (``config``: botocore's config_kwargs)."""
    endpoint = {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}
    options: dict[str, object] = {"key": "k", "secret": "s", "client_kwargs": endpoint}
    return {**options, "config_kwargs": config} if config else options


def _requests_sent(store: RemoteStore) -> list[str]:
    """Every HTTP request the store's S3 client sends from now on (botocore's attempts)."""
    sent: list[str] = []
    store.fs.s3.meta.events.register(
        "before-send.s3", lambda request, **_: sent.append(request.url)
    )
    return sent


@pytest.mark.parametrize(
    ("config", "sent"),
    [({}, 1), ({"retries": {"total_max_attempts": 2}}, 2)],
    ids=["default", "botocore-retries-set"],
)
def test_a_refused_s3_endpoint_fails_after_one_request(closed_port, config, sent):
    store = RemoteStore(
        "s3://bucket/run", retries=5, skip_instance_cache=True, **_refusing(closed_port, **config)
    )
    requests = _requests_sent(store)
    with pytest.raises(RemoteStoreError) as info:
        store.exists("step-1/manifest.json")
    url = f"http://127.0.0.1:{closed_port}/bucket/run/step-1/manifest.json"
    assert str(info.value) == (
        "remote store: stat s3://bucket/run/step-1/manifest.json failed and was not retried: "
        "the endpoint refused the connection (nothing listens there); EndpointConnectionError: "
        f'Could not connect to the endpoint URL: "{url}". {NOT_RETRIED}'
    )
    assert info.value.attempts == 1  # this store's attempts; botocore's below
    assert requests == [url] * sent
    assert store.fs.retries == 1  # s3fs's own loop: one try per call


def test_a_level_on_a_refused_endpoint_fails_with_our_error(tmp_path, closed_port):
    import dcp_multilevel
    from dcp_multilevel import Level

    levels = [
        Level(str(tmp_path / "l1")),
        Level("s3://bucket/run", storage_options=_refusing(closed_port)),
    ]
    with pytest.raises(RemoteStoreError) as info:
        dcp_multilevel.newest_step(levels)
    query = "list-type=2&prefix=run%2F&delimiter=%2F&encoding-type=url"
    url = f"http://127.0.0.1:{closed_port}/bucket?{query}"
    assert str(info.value) == (
        "remote store: list s3://bucket/run failed and was not retried: the endpoint refused "
        "the connection (nothing listens there); EndpointConnectionError: Could not connect "
        f'to the endpoint URL: "{url}". {NOT_RETRIED}'
    )


def test_a_save_to_a_refused_endpoint_fails_with_our_error(closed_port):
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    writer = MultiLevelWriter("s3://bucket/run/step-1", storage_options=_refusing(closed_port))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(4)}, storage_writer=writer)
    ((error, _),) = info.value.failures.values()
    url = f"http://127.0.0.1:{closed_port}/bucket/run/step-1/manifest.json"
    assert str(error) == (
        "remote store: stat s3://bucket/run/step-1/manifest.json failed and was not retried: "
        "the endpoint refused the connection (nothing listens there); EndpointConnectionError: "
        f'Could not connect to the endpoint URL: "{url}". {NOT_RETRIED}'
    )


# ---------------------------------------------------------------- giving up


def test_remote_that_stays_down_raises_after_all_attempts_and_leaves_nothing(memory_root):
    store = faulty(memory_root, retries=2, fail_first={"put_file": 10**9})
    with pytest.raises(RemoteStoreError) as info, store.open_write("d/x.bin") as f:
        f.write(b"abc")
    url = f"faulty://{memory_root}/d/x.bin"
    assert str(info.value) == (
        f"remote store: upload {url} failed after 3 attempts; last error: ConnectionError: "
        f"injected fault: put_file call 3 ({memory_root}/d/x.bin). {ADVICE}"
    )
    err = info.value
    assert (err.url, err.operation, err.attempts) == (url, "upload", 3)
    assert isinstance(err, OSError)
    assert isinstance(err, DcpMultilevelError)
    assert isinstance(err.__cause__, ConnectionError)
    assert fs_of(store).calls["put_file"] == 3
    clean = RemoteStore(f"memory://{memory_root}")
    assert not clean.exists("d/x.bin")
    assert clean.listdir("d") == []


@pytest.mark.parametrize(
    ("operation", "failing", "action"),
    [
        ("read", "cat_file", lambda t: t.read_bytes("m.json")),
        ("stat", "info", lambda t: t.exists("m.json")),
        ("list", "ls", lambda t: t.listdir("")),
        ("remove", "rm", lambda t: t.remove_tree("m.json")),
    ],
)
def test_every_operation_gives_up_with_one_error_class(memory_root, operation, failing, action):
    store = faulty(memory_root, retries=0, fail_first={failing: 1})
    with pytest.raises(RemoteStoreError) as info:
        action(store)
    path = "" if operation == "list" else "/m.json"
    target = memory_root + path
    assert str(info.value) == (
        f"remote store: {operation} faulty://{target} failed after 1 attempt; last error: "
        f"ConnectionError: injected fault: {failing} call 1 ({target}). {ADVICE}"
    )


def test_upload_failure_on_s3_leaves_no_object(s3_server, s3_bucket):
    store = faulty(
        f"{s3_bucket}/root",
        retries=1,
        fail_first={"put_file": 10**9},
        target_protocol="s3",
        target_options=s3_server.storage_options,
    )
    with pytest.raises(RemoteStoreError), store.open_write("data/0.bin") as f:
        f.write(b"x" * 1000)
    assert s3_server.keys(s3_bucket) == []


# ---------------------------------------------------------------- size check


def test_truncated_upload_is_detected_and_uploaded_again(memory_root):
    store = faulty(memory_root, retries=2, truncate_puts=1)
    with store.open_write("a.bin") as f:
        f.write(b"0123456789")
    assert RemoteStore(f"memory://{memory_root}").read_bytes("a.bin") == b"0123456789"
    assert fs_of(store).calls["put_file"] == 2


def test_upload_that_stays_truncated_fails_and_removes_the_object_on_s3(s3_server, s3_bucket):
    """A proxy that always drops the last byte: every stored object is one byte short."""
    store = faulty(
        f"{s3_bucket}/root",
        retries=1,
        truncate_puts=10**9,
        target_protocol="s3",
        target_options=s3_server.storage_options,
    )
    with pytest.raises(RemoteStoreError) as info:
        store.write_atomic("manifest.json", b"0123456789")
    url = f"faulty://{s3_bucket}/root/manifest.json"
    assert str(info.value) == (
        f"remote store: upload {url} failed after 2 attempts; last error: {url} holds 9 "
        f"bytes after its upload, but 10 bytes were written. {ADVICE}"
    )
    assert fs_of(store).calls["pipe_file"] == 2
    assert s3_server.keys(s3_bucket) == []


# ---------------------------------------------------------------- spooling and reads


def test_writes_spool_locally_and_leave_no_spool_files(memory_root, tmp_path):
    spool_dir = tmp_path / "spool"  # created on first use
    store = faulty(memory_root, retries=0, spool_dir=spool_dir, fail_first={"put_file": 1})
    with pytest.raises(RemoteStoreError), store.open_write("failed-upload.bin") as f:
        f.write(b"x")
    with pytest.raises(RuntimeError, match="boom"), store.open_write("failed-caller.bin") as f:
        f.write(b"x")
        raise RuntimeError("boom")
    with store.open_write("ok.bin") as f:
        f.write(b"x" * 100)
        (spool,) = spool_dir.iterdir()
        assert spool.name.startswith(SPOOL_PREFIX)
        assert spool.stat().st_size == 100
    assert list(spool_dir.iterdir()) == []
    assert store.listdir("") == ["ok.bin"]


def test_large_reads_are_split_into_ranged_requests(memory_root, monkeypatch):
    monkeypatch.setattr(remote_mod, "_READ_CHUNK", 7)
    store = faulty(memory_root)
    data = bytes(range(100))
    store.write_atomic("a.bin", data)
    with store.open_read("a.bin") as r:
        buf = bytearray(60)
        assert r.read_into(3, memoryview(buf)) == 60
        assert buf == data[3:63]
        assert fs_of(store).calls["cat_file"] == 9  # ceil(60 / 7)
        assert r.read_into(95, memoryview(buf)) == 5  # short only at the end
        assert buf[:5] == data[95:]
        assert r.read_into(100, memoryview(buf)) == 0


# ---------------------------------------------------------------- DCP round trips


def test_dcp_round_trip_on_s3(s3_env, s3_bucket, all_dtypes_state):
    url = f"s3://{s3_bucket}/run1/step-1"
    dcp.save(
        all_dtypes_state,
        storage_writer=MultiLevelWriter(url, thread_count=2, codec="bytegroup"),
    )
    keys = s3_env.keys(s3_bucket)
    assert "run1/step-1/manifest.json" in keys
    assert sum(k.startswith("run1/step-1/data/") for k in keys) == 2
    loaded = zeros_like_state(all_dtypes_state)
    dcp.load(loaded, storage_reader=MultiLevelReader(url, thread_count=2))
    assert_state_equal(loaded, all_dtypes_state)

    # Overwrite: the new manifest commits, then the old data objects are swept.
    dcp.save(all_dtypes_state, storage_writer=MultiLevelWriter(url, overwrite=True))
    data_keys = [k for k in s3_env.keys(s3_bucket) if k.startswith("run1/step-1/data/")]
    assert len(data_keys) == 1
    loaded = zeros_like_state(all_dtypes_state)
    dcp.load(loaded, storage_reader=MultiLevelReader(url))
    assert_state_equal(loaded, all_dtypes_state)


def test_dcp_round_trip_on_memory(memory_root, all_dtypes_state):
    url = f"memory://{memory_root}/ckpt"
    dcp.save(all_dtypes_state, storage_writer=MultiLevelWriter(url))
    assert MultiLevelReader.validate_checkpoint_id(url)
    loaded = zeros_like_state(all_dtypes_state)
    dcp.load(loaded, storage_reader=MultiLevelReader(url))
    assert_state_equal(loaded, all_dtypes_state)


@pytest.fixture
def faulty_scheme(tmp_path, monkeypatch):
    """Make faulty:// a store the way a third-party package would (entry point)."""
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        "faulty-store",
        "[dcp_multilevel.stores]\nfaulty = dcp_multilevel.stores.remote:RemoteStore\n",
    )
    STORES.refresh()
    yield
    STORES.refresh()


def test_dcp_save_and_load_through_a_flaky_remote(
    faulty_scheme, memory_root, monkeypatch, all_dtypes_state
):
    # The writer builds its store from the URL alone; fsspec's own configuration
    # carries the fault plan to the filesystem it creates.
    faults = dict.fromkeys(["info", "put_file", "pipe_file", "cat_file"], 1)
    conf = {"target_protocol": "memory", "fail_first": faults, "skip_instance_cache": True}
    monkeypatch.setitem(fsspec.config.conf, "faulty", conf)
    url = f"faulty://{memory_root}/ckpt"
    writer = MultiLevelWriter(url)
    dcp.save(all_dtypes_state, storage_writer=writer)
    assert dict(fs_of(writer.store).injected) == dict.fromkeys(["info", "put_file", "pipe_file"], 1)
    reader = MultiLevelReader(url)
    loaded = zeros_like_state(all_dtypes_state)
    dcp.load(loaded, storage_reader=reader)
    assert_state_equal(loaded, all_dtypes_state)
    assert fs_of(reader.store).injected["cat_file"] == 1


def test_compressed_items_are_read_with_few_large_ranged_requests(memory_root, monkeypatch):
    import torch

    from dcp_multilevel import Compression
    from dcp_multilevel.stores import coalescing as coalescing_mod

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(64, 64, generator=g) for i in range(20)}
    state["big"] = torch.randn(3 << 18, generator=g)  # 3 MiB: three 1 MiB chunks
    url = f"faulty://{memory_root}/ckpt"
    options = {"target_protocol": "memory", "skip_instance_cache": True}
    codec = Compression("bytegroup", chunk_size=1 << 20)
    dcp.save(state, storage_writer=MultiLevelWriter(url, codec=codec, storage_options=options))

    def gets() -> int:
        reader = MultiLevelReader(url, storage_options=options)
        loaded = zeros_like_state(state)
        dcp.load(loaded, storage_reader=reader)
        assert_state_equal(loaded, state)
        return fs_of(reader.store).calls["cat_file"]

    coalesced = gets()
    assert coalesced == 2  # the manifest, then the one data file in one ranged GET
    monkeypatch.setattr(coalescing_mod, "COALESCE_BYTES", 64 << 10)
    bounded = gets()
    monkeypatch.setattr(RemoteStore, "prefers_large_reads", False)
    one_per_record = gets()  # header, chunk records, payloads, terminators: one GET each
    assert coalesced < bounded < one_per_record
    assert one_per_record > 80

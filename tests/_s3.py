"""A real S3-speaking server on loopback for tests (moto's ThreadedMotoServer).

Use from a test module with ``pytest_plugins = ["_s3"]``, then ask for:

* ``s3_server`` (one per test run): the running server; ``new_bucket()`` creates a bucket
  with a unique name, ``storage_options`` are the s3fs options that reach it;
* ``s3_bucket``: a fresh, empty bucket name for one test;
* ``s3_env``: AWS_* environment variables pointing every boto/s3fs client that
  gets no options (e.g. ``store_for("s3://...")`` inside a writer) at the server,
  restored after the test.

Nothing reaches a real cloud: the endpoint is 127.0.0.1 on a port chosen at
run time, and the credentials are dummies.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["S3Server", "free_port", "s3_bucket", "s3_env", "s3_server"]

_KEY = "dcp-ml-test-key"
_SECRET = "dcp-ml-test-secret"
_REGION = "us-east-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class S3Server:
    """Where the test S3 server listens and how to talk to it."""

    endpoint_url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options (``RemoteStore(url, **storage_options)``)."""
        return {
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": _REGION},
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment for clients built without options (botocore reads AWS_ENDPOINT_URL)."""
        return {
            "AWS_ACCESS_KEY_ID": _KEY,
            "AWS_SECRET_ACCESS_KEY": _SECRET,
            "AWS_DEFAULT_REGION": _REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            # Keep a developer's ~/.aws out of the tests.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def client(self) -> Any:
        """A boto3 S3 client for checks that bypass the code under test."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=_KEY,
            aws_secret_access_key=_SECRET,
            region_name=_REGION,
        )

    def new_bucket(self) -> str:
        """Create an empty bucket with a unique name and return the name."""
        name = f"dcp-ml-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` below ``prefix`` (sorted), read with boto3."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the whole test run (starting one takes about a second)."""
    from moto.server import ThreadedMotoServer

    # The server logs every request through werkzeug; keep test output readable.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(endpoint_url=f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket for one test."""
    return s3_server.new_bucket()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """Point option-less S3 clients at the test server for one test."""
    from s3fs import S3FileSystem

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    # fsspec caches S3FileSystem instances by their options, and an option-less
    # one keeps the endpoint the environment named when it was created.
    S3FileSystem.clear_instance_cache()
    yield s3_server
    S3FileSystem.clear_instance_cache()

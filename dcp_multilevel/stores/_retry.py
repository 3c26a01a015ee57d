"""Retrying remote operations: which errors another attempt may fix, and the retry loop.

An error is *transient* when sending the same request again may succeed:
connection resets, timeouts, 5xx-style ``OSError`` from the backend, an
uploaded object of the wrong size (:class:`UploadSizeMismatch`). Errors that
retrying cannot fix (missing object, access denied, bad arguments) and this
package's own errors are *permanent*: :func:`retry` raises them at once,
unchanged. An endpoint that cannot be reached at all (:func:`unreachable`: the
connection refused, the host name unknown) is not retried either; :func:`retry`
raises :class:`~dcp_multilevel.errors.RemoteStoreError` saying so at once.
Transient errors that outlast the attempts become ``RemoteStoreError`` too, the
last one chained.

Waits grow exponentially up to a cap, with jitter (:func:`backoff_delay`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import DcpMultilevelError, RemoteStoreError

__all__ = [
    "RETRY_OPTIONS",
    "UploadSizeMismatch",
    "backoff_delay",
    "describe",
    "is_transient",
    "one_attempt_client",
    "one_attempt_options",
    "retry",
    "unreachable",
]

#: How a user sets the attempts and waits, in the words of the options they pass.
RETRY_OPTIONS = (
    "storage_options={'retries': N, 'backoff': seconds} (of the Level, or of the "
    "writer or reader without levels)"
)

T = TypeVar("T")

#: OSError subclasses and errnos that another attempt cannot fix.
_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
#: Bad request, access, size limits, not supported, wrong region: s3fs maps S3
#: error codes onto these errnos, and unlike EIO/EBUSY (5xx, SlowDown) sending
#: the same request again gets the same answer.
_PERMANENT_ERRNO_NAMES = (
    "EINVAL",
    "EACCES",
    "EPERM",
    "EROFS",
    "ENAMETOOLONG",
    "EMSGSIZE",
    "ENOSYS",
    "ENOTEMPTY",
    "EREMCHG",
    "ENOSPC",
    "EDQUOT",
)
_PERMANENT_ERRNOS = frozenset(
    getattr(errno, name) for name in _PERMANENT_ERRNO_NAMES if hasattr(errno, name)
)

#: Transient error types of optional client libraries, by module. They are only
#: looked up in ``sys.modules``: a library that was never imported cannot have
#: raised, and the store need not import botocore/aiohttp/azure to recognize them.
_FOREIGN_TRANSIENT = {
    "botocore.exceptions": ("ConnectionError", "HTTPClientError", "IncompleteReadError"),
    "aiohttp": ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError"),
    "azure.core.exceptions": ("ServiceRequestError", "ServiceResponseError"),
}


#: URL schemes whose client retries on its own (s3fs over botocore), turned off so that
#: :func:`retry` makes the only attempts: botocore's default (five attempts, with a
#: backoff between them) inside each of ours delays a refused connection's first
#: error by its whole backoff, and multiplies the attempts before a store gives up.
_SELF_RETRYING = ("s3", "s3a")


def one_attempt_options(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """The fsspec ``options`` for a URL of ``scheme``: on S3, botocore's retries at one
    attempt, unless ``config_kwargs={"retries": {...}}`` sets them."""
    if scheme not in _SELF_RETRYING:
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**options, "config_kwargs": config}


def one_attempt_client(scheme: str, fs: Any) -> None:
    """On S3, s3fs's own retries of timeouts and throttling at one attempt per call.

    ``S3FileSystem.retries`` is a class attribute, not an option, so it is set on
    the instance: fsspec shares one per set of options, and the options
    :func:`one_attempt_options` made are this package's own.
    """
    if scheme in _SELF_RETRYING and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1


class UploadSizeMismatch(OSError):
    """The stored object's size differs from the bytes uploaded (retried: re-upload)."""


def backoff_delay(attempt: int, backoff: float, backoff_max: float) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    Drawn uniformly from ``[d/2, d]`` with ``d = min(backoff_max, backoff *
    2 ** (attempt - 1))``: the jitter keeps ranks that failed together from
    retrying in lockstep.
    """
    cap = min(backoff_max, backoff * 2 ** (attempt - 1))
    return cap / 2 + random.uniform(0, cap / 2)


def retry(
    fn: Callable[[], T],
    *,
    operation: str,
    url: str,
    attempts: int,
    delay: Callable[[int], float],
    logger: logging.Logger,
) -> T:
    """``fn()``, tried up to ``attempts`` times while it fails with transient errors.

    Args:
        fn: the operation; called again, as a whole, after each transient failure.
        operation: what it does, for messages (``"upload"``, ``"read"``, ...).
        url: the object or prefix it is about, for messages.
        attempts: tries in all (at least 1).
        delay: seconds to wait after failed attempt ``n`` (1-based).
        logger: where each retry is logged, as a warning.

    Raises:
        RemoteStoreError: the last attempt failed with a transient error
            (chained as ``__cause__``).
        Exception: a permanent error of ``fn``, at once and unchanged.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if isinstance(e, DcpMultilevelError):
                raise  # ours, already final (e.g. a nested RemoteStoreError)
            cause = unreachable(e)
            if cause is not None:
                raise _unreachable(operation, url, attempt, e, cause) from e
            if not is_transient(e):
                raise
            if attempt == attempts:
                raise _gave_up(operation, url, attempts, e) from e
            wait = delay(attempt)
            logger.warning(
                "remote store: %s %s failed (attempt %d of %d: %s); retrying in %.2f s",
                operation,
                url,
                attempt,
                attempts,
                describe(e),
                wait,
            )
        time.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


def _gave_up(operation: str, url: str, attempts: int, last: BaseException) -> RemoteStoreError:
    tries = "attempt" if attempts == 1 else "attempts"
    return RemoteStoreError(
        f"remote store: {operation} {url} failed after {attempts} {tries}; last error: "
        f"{describe(last)}. The storage may be unreachable, overloaded or "
        "misconfigured: check the endpoint, network and credentials, and retry; "
        f"{RETRY_OPTIONS} sets how long to keep trying.",
        url=url,
        operation=operation,
        attempts=attempts,
    )


def _unreachable(
    operation: str, url: str, attempt: int, last: BaseException, cause: BaseException
) -> RemoteStoreError:
    why = (
        "the endpoint refused the connection (nothing listens there)"
        if isinstance(cause, ConnectionRefusedError)
        else "the endpoint's host name does not resolve"
    )
    return RemoteStoreError(
        f"remote store: {operation} {url} failed and was not retried: {why}; "
        f"{describe(last)}. Another attempt would get the same answer: check the "
        "endpoint in the storage options (s3fs: client_kwargs={'endpoint_url': ...}) or "
        "the environment (AWS_ENDPOINT_URL for S3), and that the storage service runs there.",
        url=url,
        operation=operation,
        attempts=attempt,
    )


def describe(exc: BaseException) -> str:
    """``exc`` for a log line or message: its type and text (a size mismatch: its text)."""
    if isinstance(exc, UploadSizeMismatch):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


#: getaddrinfo's answers that another lookup gives again: the name does not exist
#: (EAI_AGAIN, a resolver that did not answer in time, may pass and is retried).
_UNKNOWN_HOST_ERRNOS = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)
)


def unreachable(exc: BaseException) -> BaseException | None:
    """The refused connection or unknown host name behind ``exc``, or None.

    Client libraries wrap the socket's error: botocore keeps it in ``kwargs["error"]``
    (an aiohttp ``ClientConnectorError``, whose ``os_error`` is the socket's), others
    chain it; every link is looked at.
    """
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return e
        if isinstance(e, socket.gaierror) and e.errno in _UNKNOWN_HOST_ERRNOS:
            return e
        kwargs = getattr(e, "kwargs", None)
        wrapped = kwargs.get("error") if isinstance(kwargs, dict) else None
        todo += [e.__cause__, e.__context__, wrapped, getattr(e, "os_error", None)]
    return None


def is_transient(exc: BaseException) -> bool:
    """True when another attempt of the same operation may succeed."""
    if isinstance(exc, DcpMultilevelError):
        return False  # ours, already final (e.g. a nested RemoteStoreError)
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, UploadSizeMismatch)):
        return True
    if isinstance(exc, OSError):
        # s3fs turns unrecognized service errors (500, 503, ...) into plain OSError.
        return not isinstance(exc, _PERMANENT_OS_ERRORS) and exc.errno not in _PERMANENT_ERRNOS
    foreign: list[type] = []
    for module_name, names in _FOREIGN_TRANSIENT.items():
        module = sys.modules.get(module_name)
        if module is not None:
            foreign += [t for n in names if isinstance(t := getattr(module, n, None), type)]
    return isinstance(exc, tuple(foreign))

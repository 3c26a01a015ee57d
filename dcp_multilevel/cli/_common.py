"""What every command shares: storage options, ``--json``, progress, errors, sizes.

Errors: a command raises; :class:`ErrorHandlingGroup` turns a package error
(:class:`~dcp_multilevel.errors.DcpMultilevelError`) or an ``OSError`` into
one line, ``error: <message>``, on stderr and exit status 1. Usage errors
stay click's (exit 2). A check that ran and found problems prints its report
and exits 1 through :class:`CheckFailed`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ..checkpoint import CheckpointRoot, StoredCheckpoint
from ..errors import CheckpointNotFoundError, DcpMultilevelError
from ..format import MANIFEST_NAME, Health
from ..format.health import health_from_json
from ..stores import parse_location
from ._parts import not_committed, part_ranks

__all__ = [
    "CheckFailed",
    "ErrorHandlingGroup",
    "Target",
    "emit_json",
    "format_bytes",
    "format_codecs",
    "format_health",
    "format_time",
    "health_of",
    "json_option",
    "one_line",
    "open_checkpoint",
    "options_for",
    "progress",
    "resolve",
    "stdout_console",
    "storage_options_option",
]

F = TypeVar("F", bound=Callable[..., Any])


class CheckFailed(click.ClickException):
    """A check ran and failed (its report is already printed): exit status 1, no more text."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        """Print the one-line reason, if any (the report itself was printed already)."""
        if self.message:
            click.echo(f"error: {self.message}", err=True)


class ErrorHandlingGroup(click.Group):
    """A click group whose commands fail with one line on stderr instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; any error but click's own becomes ``error: ...`` and exit 1."""
        try:
            return super().invoke(ctx)
        except (DcpMultilevelError, OSError) as e:
            click.echo(f"error: {one_line(e)}", err=True)
            ctx.exit(1)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors (exit 2), --help, Ctrl-C
        except Exception as e:  # noqa: BLE001
            # The outermost layer: storage backends raise their own types (botocore's
            # NoCredentialsError is no OSError); a user gets one line, not a traceback.
            click.echo(f"error: {type(e).__name__}: {one_line(e)}", err=True)
            ctx.exit(1)


def one_line(e: BaseException) -> str:
    """The error's message on one line (a message never spans lines in a terminal)."""
    return " ".join(str(e).split()) or type(e).__name__


# --------------------------------------------------------------------------- options


def _parse_storage_options(ctx: click.Context, param: click.Parameter, value: str | None) -> dict:
    if value is None:
        return {}
    try:
        options = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON ({e}): {value!r}") from None
    if not isinstance(options, dict):
        raise click.BadParameter(f"must be a JSON object, got {value!r}")
    return options


def storage_options_option(
    name: str = "--storage-options", help_text: str | None = None
) -> Callable[[F], F]:
    """``--storage-options JSON``: options for the store of every URL (fsspec's, for
    ``s3://``: ``key``, ``secret``, ``client_kwargs``); without it, the backend's
    own configuration applies (for S3 the ``AWS_*`` environment variables)."""
    return click.option(
        name,
        "storage_options" if name == "--storage-options" else name.lstrip("-").replace("-", "_"),
        metavar="JSON",
        callback=_parse_storage_options,
        help=help_text
        or 'Store options as a JSON object, e.g. \'{"key": ..., "secret": ...}\' for s3:// '
        "(default: the AWS_* environment variables and the backend's own configuration).",
    )


def json_option(f: F) -> F:
    """``--json``: one JSON document on stdout instead of tables (and no progress bars)."""
    return click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON document on stdout."
    )(f)


def emit_json(doc: Mapping[str, Any]) -> None:
    """Print ``doc`` as one JSON document on stdout."""
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


def stdout_console() -> Console:
    """The console tables go to (stdout; plain text when stdout is not a terminal)."""
    return Console(file=sys.stdout, soft_wrap=False, width=_width())


def _width() -> int | None:
    # Tables wider than a pipe's default 80 columns would wrap FQNs; COLUMNS still wins.
    return None if os.environ.get("COLUMNS") or sys.stdout.isatty() else 200


# --------------------------------------------------------------------------- locations


def options_for(url: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options that apply to ``url``: none for a local path (the local
    store takes none), so one ``--storage-options`` serves a copy between a
    directory and a bucket."""
    return {} if parse_location(url).scheme == "file" else dict(storage_options)


class Target:
    """One location a command was given: a checkpoint, or a root of ``step-<N>`` checkpoints."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        self.url = url
        self.root = CheckpointRoot(url, options_for(url, storage_options))
        self.is_checkpoint = self.root.store.exists(MANIFEST_NAME)

    def checkpoint(self) -> StoredCheckpoint:
        """The checkpoint at the location itself."""
        return StoredCheckpoint(self.root.store, location=self.url)


def resolve(url: str, storage_options: Mapping[str, Any]) -> Target:
    """Open ``url`` and find out what it holds.

    Raises:
        CheckpointNotFoundError: neither a committed checkpoint nor a root of
            ``step-<N>`` directories is there.
    """
    target = Target(url, storage_options)
    found = None if target.is_checkpoint else target.root.scan()  # one listing of the root
    if found is not None and not (found.committed or found.uncommitted):
        if part_ranks(target.checkpoint()) is not None:
            raise not_committed(target.checkpoint())  # one node's part: says so
        raise CheckpointNotFoundError(
            f"no checkpoint at {target.root.store.url}: it has no {MANIFEST_NAME} and no "
            "step-<N> directories (check the path, or the storage options for a remote URL)",
            checkpoint=target.root.store.url,
        )
    return target


def open_checkpoint(url: str, storage_options: Mapping[str, Any]) -> StoredCheckpoint:
    """The committed checkpoint at ``url``, its manifest read and validated.

    Raises:
        CheckpointNotFoundError: there is no committed checkpoint there (the
            message says when ``url`` is a root and names its newest step).
        ManifestError: the manifest is invalid.
    """
    target = Target(url, storage_options)
    if not target.is_checkpoint:
        steps = target.root.steps()
        if not steps:
            raise not_committed(target.checkpoint())
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {target.root.store.url}; it is a root of checkpoints, "
            f"e.g. {target.root.location(steps[-1])}",
            checkpoint=target.root.store.url,
        )
    ckpt = target.checkpoint()
    ckpt.manifest()
    return ckpt


# --------------------------------------------------------------------------- output


@contextmanager
def progress(
    description: str, total: int | None, *, enabled: bool
) -> Iterator[Callable[..., None]]:
    """A byte progress bar on stderr; yields ``advance(n, total=None)`` (a ``total``
    given later replaces the first, for work whose size is known only once begun).

    Shown only when ``enabled`` (not ``--json``) and stderr is a terminal, so
    pipes, logs and tests see no control characters.
    """
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda n, total=None: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            bar.advance(task, n)

        yield advance


def format_bytes(n: int | None) -> str:
    """``n`` bytes for people (``1.5 MiB``); ``-`` when unknown."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_codecs(codecs: list[str] | None) -> str:
    """Codec descriptors for people: the built-ins without their package prefix
    (``bytegroup/4``), ``none`` for uncoded, ``-`` when unknown."""
    if codecs is None:
        return "-"
    return ", ".join(c.removeprefix("dcp_multilevel.") for c in codecs) or "none"


def format_time(unix: float | None) -> str:
    """A commit time for people: ISO 8601 in UTC, to the second; ``-`` when unknown."""
    if unix is None:
        return "-"
    return datetime.fromtimestamp(unix, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def health_of(doc: Mapping[str, Any]) -> Health | None:
    """The health record of a command's JSON entry (its ``health`` value, from a
    manifest that decoded: valid); None: no record, or no manifest."""
    return health_from_json(doc.get("health"), ValueError)


def format_health(doc: Mapping[str, Any], width: int | None = None) -> str:
    """A step's health for people, one line: ``QUARANTINED: <reason>`` (the reason cut
    to ``width`` characters), ``clean``, or ``-`` when unknown (no manifest read)."""
    if "health" not in doc:
        return "-"
    health = health_of(doc)
    if health is None or not health.quarantined:
        return "clean"
    reason = health.reason()
    if width is not None and len(reason) > width:
        reason = reason[: width - 1].rstrip() + "…"
    return f"QUARANTINED: {reason}"

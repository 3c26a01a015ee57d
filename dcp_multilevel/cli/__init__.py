"""The ``dcp-multilevel`` command-line tool: list, inspect, verify, copy, clean up and
convert checkpoints.

The top layer of the package: it may import anything in it, and nothing in
the package imports it. One module per command, each a click command
registered on :data:`main` below; what they share (storage options,
``--json``, progress bars, one-line errors) is in ``_common.py``; where a
checkpoint's data files are, at one location or in every node's part of a
level with ``{node}`` in its path (``ls``, ``inspect``, ``verify``), in
``_parts.py``. Every command takes any URL the package's stores accept (a
path, ``s3://...``, ``memory://...``). See ``docs/cli.md``.

Exit status: 0 success; 1 a check failed or something was not found (one
line, ``error: ...``, on stderr); 2 a usage error (click's).
"""

from __future__ import annotations

import click

from .._version import __version__
from . import convert, copy, gc, inspect, ls, verify
from ._common import ErrorHandlingGroup

__all__ = ["main"]


@click.group(cls=ErrorHandlingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dcp-multilevel")
def main() -> None:
    """Work with dcp_multilevel checkpoints: ls, inspect, verify, copy, gc, convert.

    Locations are local paths or URLs (s3://bucket/prefix, gs://..., memory://...);
    pass remote credentials with --storage-options '{"key": ...}' or the backend's
    environment (AWS_* for S3).
    """


# The modules stay the package's attributes (``cli.verify`` is the module); each
# holds one command of the same name.
for _command in (ls.ls, inspect.inspect, verify.verify, copy.copy, gc.gc, convert.convert):
    main.add_command(_command)

"""Parsing a checkpoint location: a local path, ``file://path`` or any ``scheme://`` URL."""

from __future__ import annotations

import os
import re

from ..errors import ConfigError

__all__ = ["Location", "parse_location"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*)://(.*)$")


class Location:
    """A parsed storage location: ``scheme`` (``file`` for plain paths) and ``path``."""

    __slots__ = ("path", "scheme", "url")

    def __init__(self, scheme: str, path: str, url: str) -> None:
        self.scheme = scheme
        self.path = path
        self.url = url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"


def parse_location(where: str | os.PathLike[str]) -> Location:
    """Parse a checkpoint location: a local path, ``file://path`` or ``scheme://...``.

    Raises ConfigError for an empty location.
    """
    text = os.fspath(where)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"checkpoint location must be a non-empty path or URL, got {where!r}")
    m = _SCHEME.match(text)
    if m is None:
        return Location("file", text, f"file://{os.path.abspath(text)}")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "file":
        if not rest:
            raise ConfigError(f"file URL {text!r} names no path")
        return Location("file", rest, text)
    return Location(scheme, text, text)

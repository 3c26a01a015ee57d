"""User-facing configuration: locations (paths and URLs), compression options."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = ["Compression", "Location", "Tier", "parse_location"]

#: Short names for the built-in codecs (their registry names are namespaced).
CODEC_ALIASES = {"zstd": "dcp_multilevel.zstd", "bytegroup": "dcp_multilevel.bytegroup"}


@dataclass(frozen=True)
class Compression:
    """How a writer compresses tensor data (the reader needs no options).

    Attributes:
        codec: ``"bytegroup"`` (float-aware byte planes + zstd), ``"zstd"``, or the
            registry name of a third-party codec.
        level: zstd level (1 is fast; higher levels gain little on floats).
        chunk_size: bytes per independently coded chunk (1-64 MiB). The 1 MiB
            default splits even small tensors across threads and keeps each
            chunk's planes in cache; 4 MiB chunks changed the ratio by ~0.01 %.
        threads: chunks coded in parallel per writer (from the tensor being
            written and the next ones, while it is written): ``threads - 1``
            pool threads and the writing thread, which codes while it would
            otherwise wait.
    """

    codec: str = "bytegroup"
    level: int = 1
    chunk_size: int = 1 << 20
    threads: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str) or not self.codec:
            raise ConfigError(f"Compression.codec must be a codec name, got {self.codec!r}")
        if not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ConfigError(f"Compression.level must be an integer in -7..22, got {self.level!r}")
        if not isinstance(self.chunk_size, int) or not (1 << 20) <= self.chunk_size <= (64 << 20):
            raise ConfigError(
                f"Compression.chunk_size must be 1 MiB..64 MiB, got {self.chunk_size!r}"
            )
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"Compression.threads must be an integer >= 1, got {self.threads!r}")

    @property
    def registry_name(self) -> str:
        return CODEC_ALIASES.get(self.codec, self.codec)

    @staticmethod
    def of(value: Compression | str | None) -> Compression | None:
        """Normalize a writer's ``codec=`` argument."""
        if value is None or isinstance(value, Compression):
            return value
        if isinstance(value, str):
            return Compression(codec=value)
        raise ConfigError(
            f"codec must be None, a codec name or a Compression, got {type(value).__name__}"
        )


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


@dataclass(frozen=True)
class Tier:
    """One storage level of a :class:`~dcp_multilevel.manager.CheckpointManager`.

    Attributes:
        url: root of this level (``/nvme/run1``, ``file:///...``, ``s3://bucket/run1``);
            checkpoints live in ``<url>/step-<step>/``.
        every: keep every ``every``-th save on this level (the first level must
            take every save: ``save`` returns once it is committed there).
        keep: how many complete checkpoints to retain here (``None``: all).
        codec: compression on this level (``None``, ``"bytegroup"``, ``"zstd"``,
            or :class:`Compression`). Local disk is usually faster than
            compression; remote storage is not.
        storage_options: options for the level's store / fsspec.
    """

    url: str
    every: int = 1
    keep: int | None = None
    codec: Compression | str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_location(self.url)
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(
                f"Tier({self.url!r}).every must be an integer >= 1, got {self.every!r}"
            )
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ConfigError(
                f"Tier({self.url!r}).keep must be None or an integer >= 1 (the newest complete "
                f"checkpoint is never deleted), got {self.keep!r}"
            )
        Compression.of(self.codec)

    def due(self, step: int) -> bool:
        """Whether the save at ``step`` goes to this level."""
        return step % self.every == 0

    def checkpoint_url(self, step: int) -> str:
        return f"{self.url.rstrip('/')}/step-{step}"

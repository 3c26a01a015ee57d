"""How a writer compresses: the :class:`Compression` option (re-exported by the package)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["CODEC_ALIASES", "Compression"]

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
            chunk's planes in cache; larger chunks barely change the ratio.
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
        """The codec's registry name: ``codec`` with the built-ins' short aliases expanded."""
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

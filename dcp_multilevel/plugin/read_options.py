"""What a :class:`~dcp_multilevel.MultiLevelReader` checks of its options and of the
checkpoint it is about to read, before any byte is read."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..format import Manifest

__all__ = ["checked_fallbacks", "warn_if_quarantined"]

# The logger users configure, named as documented (the reader's).
logger = logging.getLogger("dcp_multilevel.reader")


def checked_fallbacks(
    fallbacks: Sequence[str | os.PathLike[str]],
    options: Sequence[dict[str, Any] | None] | None,
) -> tuple[list[str | os.PathLike[str]], list[dict[str, Any] | None]]:
    """The fallbacks as a list, and one storage options entry per fallback.

    Raises:
        ConfigError: a single location given as ``fallbacks``, or not one options
            entry per fallback.
    """
    if isinstance(fallbacks, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"fallbacks must be a sequence of locations, got the single location "
            f"{fallbacks!r}; pass fallbacks=[{fallbacks!r}]"
        )
    fallbacks = list(fallbacks)
    options = [None] * len(fallbacks) if options is None else list(options)
    if len(options) != len(fallbacks):
        raise ConfigError(
            f"fallback_storage_options has {len(options)} entries for "
            f"{len(fallbacks)} fallbacks; give one (a dict or None) per fallback"
        )
    return fallbacks, options


def warn_if_quarantined(manifest: Manifest, url: str) -> None:
    """Warn that the checkpoint at ``url`` is quarantined (``docs/health.md``): its
    checks found poisoned state; it is read all the same, as asked."""
    if manifest.quarantined:
        logger.warning(
            "dcp_multilevel: loading %s, which is QUARANTINED: %s", url, manifest.health.reason()
        )  # type: ignore[union-attr]

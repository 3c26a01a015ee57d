"""Validation of the relative paths a manifest may name.

A manifest is untrusted input: a path in it must never reach outside the
checkpoint (``..``, absolute paths, drive letters, backslashes, NUL bytes).
"""

from __future__ import annotations

import re

from ..errors import ManifestError

__all__ = ["validate_relpath"]

# Conservative on purpose: every path we write matches this, and anything else
# in a manifest is either a bug or an attack.
_COMPONENT = re.compile(r"^[A-Za-z0-9_.\-]+$")
_MAX_PATH = 1024


def validate_relpath(path: object, *, what: str = "path", checkpoint: str | None = None) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise ManifestError.

    Safe means: a non-empty ``str`` of at most 1024 characters, components
    separated by ``/``, each component made of ``[A-Za-z0-9_.-]`` and neither
    ``.`` nor ``..``.
    """
    where = f" in checkpoint {checkpoint!r}" if checkpoint else ""
    if not isinstance(path, str) or not path:
        raise ManifestError(
            f"{what} must be a non-empty string{where}, got {path!r}", checkpoint=checkpoint
        )
    if len(path) > _MAX_PATH:
        raise ManifestError(
            f"{what} is longer than {_MAX_PATH} characters{where}: {path[:64]!r}...",
            checkpoint=checkpoint,
        )
    for part in path.split("/"):
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise ManifestError(
                f"{what} {path!r}{where} is not a safe relative path (component {part!r}); "
                "a checkpoint may only name files inside itself",
                checkpoint=checkpoint,
            )
    return path

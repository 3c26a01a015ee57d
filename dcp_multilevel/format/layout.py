"""Where checkpoints and their files live: the one place that names them.

::

    <level root>/step-<N>/                       one checkpoint per saved step
    <level root>/step-<N>/manifest.json          the commit, written last
    <level root>/step-<N>/data/<rank>-<n>.<token>.bin   data files
    ...<name>.tmp-<random>                       a local file being written

``token`` is random per rank and per save, chosen by the writing rank itself
(no coordination: DCP's plan caching may replay an earlier plan, so nothing
sent by the coordinator can be relied on to be fresh). Overwriting a
checkpoint therefore never touches the files the old manifest describes: the
new manifest replaces the old one in one atomic rename, and only then is
every data file it does not name deleted. At every instant the manifest on
disk describes exactly the data files it names.

The paths a manifest names are checked here too (:func:`validate_relpath`): a
manifest is untrusted input, and a path in it must never reach outside the
checkpoint (``..``, absolute paths, drive letters, backslashes, NUL bytes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import ManifestError

__all__ = [
    "DATA_DIR",
    "MANIFEST_NAME",
    "PLACEMENT_NAME",
    "TMP_MARKER",
    "checkpoint_url",
    "data_file_path",
    "is_rank_file",
    "parse_step_dir",
    "rank_files",
    "rank_of_file",
    "step_dir",
    "validate_relpath",
]


#: The manifest's name inside a checkpoint (the commit: it is written last).
MANIFEST_NAME = "manifest.json"
#: The directory of data files inside a checkpoint.
DATA_DIR = "data"
#: Which node each rank of a save was on, beside a node level's part (names lost
#: nodes in restore errors).
PLACEMENT_NAME = "placement.json"
#: Marks a local file still being written (published by renaming it away).
TMP_MARKER = ".tmp-"

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(rf"^{DATA_DIR}/(\d+)-\d+\.")


def step_dir(step: int) -> str:
    """The directory name of the checkpoint of ``step`` below a level's root."""
    return f"step-{step}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name below a level's root holds, or None if it names none."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def checkpoint_url(root: str, step: int) -> str:
    """The location of the checkpoint of ``step`` below the level root ``root``."""
    return f"{root.rstrip('/')}/{step_dir(step)}"


def data_file_path(rank: int, n: int, token: str) -> str:
    """Relative path of the ``n``-th data file written by ``rank`` in the save ``token``."""
    return f"{DATA_DIR}/{rank}-{n}.{token}.bin"


def is_rank_file(path: str, rank: int) -> bool:
    """True when the data file ``path`` (as :func:`data_file_path` names it) is ``rank``'s."""
    return path.startswith(f"{DATA_DIR}/{rank}-")


def rank_of_file(path: str) -> int | None:
    """The rank that wrote the data file ``path`` (as :func:`data_file_path` names it), or None."""
    m = _RANK_FILE.match(path)
    return int(m.group(1)) if m else None


def rank_files(files: Iterable[str], rank: int) -> list[str]:
    """The data files among ``files`` (a manifest's) that ``rank`` wrote, sorted."""
    return sorted(f for f in files if is_rank_file(f, rank))


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

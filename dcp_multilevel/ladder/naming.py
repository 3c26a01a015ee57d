"""Which step a writer's path (or DCP's ``checkpoint_id``) names on a ladder.

With levels, a checkpoint is a step: ``<level root>/step-<N>/`` on every level
(``format/layout.py``). A writer or reader names it by the last part of its
path, and the rest must say where:

- ``"step-100"`` (a name alone): the step below each level's root;
- a path or URL whose folder is the first level's root (``/nvme/run/step-100``
  for ``Level("/nvme/run")``; relative paths are taken from the working
  directory, ``{node}`` as each node expands it or as written);

anything else is a :class:`~dcp_multilevel.ConfigError` naming the levels.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import MISSING, fields

from ..errors import ConfigError
from ..format import parse_step_dir
from ..levels import level_kind
from ..levels.options import Level
from .binding import root_of

__all__ = ["LATEST", "describe", "step_of"]

#: What a reader's path says to load the newest step every rank can read.
LATEST = "latest"


def step_of(path: str | os.PathLike[str], placed: Level, written: Level) -> int:
    """The step ``path`` names on the ladder whose first level is ``placed`` (``{node}``
    filled in for this rank) and was ``written`` (as the user wrote it).

    Raises:
        ConfigError: ``path`` names no step, or lies outside the first level.
    """
    text = os.fspath(path)
    trimmed = text.rstrip("/")
    name = trimmed.rsplit("/", 1)[-1]
    step = parse_step_dir(name)
    if step is None:
        raise ConfigError(
            f"{text!r} names no step: with levels, a checkpoint is 'step-<N>' below each "
            f"level's root (the first: {written.url!r}); pass 'step-<N>' (the same name on "
            "every level), or that name below the first level's root"
        )
    folder = trimmed[: -len(name)].rstrip("/")
    if not folder:  # the name alone: below each level's root
        return step
    roots = {root_of(level.url, level_kind(level)) for level in (placed, written)}
    if root_of(folder, None) not in roots:
        raise ConfigError(
            f"{text!r} is not below the first level's root {placed.url!r}: with levels, "
            f"pass the step's name alone ({name!r}: the same name below every level's root), "
            f"or a path or URL whose folder is {placed.url!r}"
        )
    return step


def describe(levels: Sequence[Level]) -> str:
    """The levels as a short list for messages, each with the fields it sets:
    ``[Level('/nvme/run'), Level('s3://b/run', every=4)]`` (not its storage options)."""
    defaults = {f.name: f.default for f in fields(Level) if f.default is not MISSING}
    out = []
    for level in levels:
        args = [repr(level.url)] + [
            f"{name}={getattr(level, name)!r}"
            for name, default in defaults.items()
            if getattr(level, name) != default
        ]
        out.append(f"Level({', '.join(args)})")
    return "[" + ", ".join(out) + "]"

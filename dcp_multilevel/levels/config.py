"""A level list as the user writes it: :class:`Level`, its checks, its words.

Imported by the package root: everything here is plain data and checks, no
threads, no torch.distributed, so a writer or reader without levels loads
nothing more of ``levels/``. Levels, schedules and the manager depend down on it.

**Which step a path names** (:func:`step_of`): a writer's path (or DCP's
``checkpoint_id``) with levels.

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
import posixpath
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..codecs import CODECS
from ..codecs.options import CODEC_ALIASES, Compression
from ..errors import ConfigError, RegistryError
from ..format import parse_step_dir
from ..format.layout import checkpoint_url
from ..stores.location import parse_location

__all__ = ["LATEST", "Level", "check_codec", "describe", "step_of"]


@dataclass(frozen=True)
class Level:
    """One level of a :class:`~dcp_multilevel.CheckpointManager`: where, how often,
    how many kept, how coded.

    What a level does with a checkpoint (who sends which bytes where) is its
    kind's job (``dcp_multilevel.levels``): a ``url`` that names a store
    (a path, ``s3://...``) is a store level, where each rank's files are
    copied to that URL; a registered kind (``"<kind>:"``) may place them
    elsewhere (other nodes, parity).

    Attributes:
        url: root of this level (``/nvme/run1``, ``file:///...``, ``s3://bucket/run1``);
            checkpoints live in ``<url>/step-<step>/`` (``format/layout.py``).
        every: hold every ``every``-th save on this level (the first level must
            take every save: ``save`` returns once it is committed there). The
            manager's schedule reads it (``dcp_multilevel.schedule``).
        keep: how many complete checkpoints to retain here (``None``: all).
        codec: compression on this level (``None``, ``"bytegroup"``, ``"zstd"``,
            or :class:`Compression`). Local disk is usually faster than
            compression; remote storage is not.
        storage_options: options for the level's store / fsspec.
        options: options of the level's kind, by name (``Level("mirror:/p",
            options={"copies": 3})``): a kind declares which it takes, and its
            driver checks them. The built-in kinds' options also have fields of
            their own (below); either spelling works.
        replicas: ``partner:`` levels: copies of each rank's files in all (its
            own included), each on another node (``levels/partner.py``).
        jump: ``partner:`` levels: place the ``i``-th copy ``i * jump`` nodes
            further along the ring of nodes (spread copies over failure domains).
        data: ``erasure:`` levels: nodes per Reed-Solomon group.
        parity: ``erasure:`` levels: parity blocks per group, each on another
            node; a group survives any ``parity`` lost nodes (``levels/erasure.py``).
        keyframe_every: store levels: every ``keyframe_every``-th checkpoint on
            this level is stored whole (a keyframe), the others as deltas
            against an earlier one on the level (``docs/delta.md``); None or 1:
            every checkpoint whole. Needs a ``codec``.
        delta_against: what a delta is coded against: ``"keyframe"`` (the last
            keyframe: a load reads at most two checkpoints) or ``"previous"``
            (the level's previous checkpoint: smaller deltas, a load reads the
            whole chain back to the keyframe).
        overwrite: a save or drain of a step this level holds committed as another
            save (another ``save_id``: a second run over the same level) replaces
            it, atomically: the new files go under new names, the old step stays
            loadable until the new manifest commits, then its files are removed.
            False (the default): refused (a drain's ``DrainError``, which
            ``CheckpointManager.wait`` raises; a save's ``CheckpointExistsError``),
            and the level keeps the step as it is. The same save again is never
            a replacement.
    """

    url: str
    every: int = 1
    keep: int | None = None
    codec: Compression | str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    replicas: int | None = None
    jump: int | None = None
    data: int | None = None
    parity: int | None = None
    keyframe_every: int | None = None
    delta_against: str = "keyframe"
    options: dict[str, Any] = field(default_factory=dict)
    overwrite: bool = False

    #: The built-in kinds' options that are fields too (checked by their drivers).
    KIND_OPTIONS = ("replicas", "jump", "data", "parity")
    #: What ``delta_against`` may say.
    DELTA_AGAINST = ("keyframe", "previous")

    def __post_init__(self) -> None:
        name = f"{type(self).__name__}({self.url!r})"
        parse_location(self.url)
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"{name}.every must be an integer >= 1, got {self.every!r}")
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ConfigError(
                f"{name}.keep must be None or an integer >= 1 (the newest complete "
                f"checkpoint is never deleted), got {self.keep!r}"
            )
        check_codec(self)
        for option in self.KIND_OPTIONS:
            value = getattr(self, option)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(f"{name}.{option} must be an integer >= 1, got {value!r}")
        if not isinstance(self.options, dict) or not all(
            isinstance(key, str) and key for key in self.options
        ):
            raise ConfigError(
                f"{name}.options must be a dict of option names to values, got {self.options!r}"
            )
        both = set(self.options) & {o for o in self.KIND_OPTIONS if getattr(self, o) is not None}
        if both:
            raise ConfigError(f"{name} sets {sorted(both)} twice: as fields and in options")
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"{name}.overwrite must be True or False, got {self.overwrite!r}")
        k = self.keyframe_every
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"{name}.keyframe_every must be None or an integer >= 1, got {k!r}")
        if self.delta_against not in self.DELTA_AGAINST:
            raise ConfigError(
                f"{name}.delta_against must be one of {self.DELTA_AGAINST}, "
                f"got {self.delta_against!r}"
            )
        if self.deltas and self.codec is None:
            raise ConfigError(
                f"{name}.keyframe_every={k} stores deltas, which are coded: give the level a "
                "codec too (codec='bytegroup')"
            )

    @property
    def deltas(self) -> bool:
        """Whether checkpoints on this level may be stored as deltas."""
        return self.keyframe_every is not None and self.keyframe_every > 1

    def kind_options(self) -> dict[str, Any]:
        """The kind-specific options this level sets (``replicas=2``, ``options=``)."""
        fields = {o: getattr(self, o) for o in self.KIND_OPTIONS if getattr(self, o) is not None}
        return {**fields, **self.options}

    def checkpoint_url(self, step: int) -> str:
        """Where this level holds the checkpoint of ``step``."""
        return checkpoint_url(self.url, step)


def check_codec(level: Level) -> None:
    """The level's codec names an installed codec (ConfigError saying which, and what to do).

    Checked when the level is made, not at its first save: a typo found after
    hours of training loses them.
    """
    compression = Compression.of(level.codec)
    if compression is None:
        return
    try:
        CODECS.get(compression.registry_name)
    except RegistryError as e:
        aliases = ", ".join(repr(a) for a in CODEC_ALIASES)
        raise ConfigError(
            f"{type(level).__name__}({level.url!r}).codec={compression.codec!r} is not a codec "
            f"this process can use (built-ins: {aliases}): {e}"
        ) from e


#: What a reader's path says to load the newest step every rank can read.
LATEST = "latest"


def step_of(path: str | os.PathLike[str], placed: Level, written: Level) -> int:
    """The step ``path`` names on the runtime whose first level is ``placed`` (``{node}``
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


#: fsspec's other spellings of one protocol (the same bucket either way).
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}


def root_of(url: str, kind: str | None) -> tuple[str, str] | None:
    """``(scheme, normalized path)`` of the root a level's url names (its kind stripped).

    Plain paths and ``file://`` URLs are made absolute and normalized; other
    URLs lose repeated, leading and trailing slashes (``s3://b/run/`` is
    ``s3://b/run``), as fsspec reads them.
    """
    where = url[len(kind) + 1 :] if kind is not None else url
    if not where.strip():  # "partner:": the kind's driver says what is missing
        return None
    location = parse_location(where)
    if location.scheme == "file":
        return "file", os.path.normpath(os.path.abspath(location.path))
    rest = location.url.split("://", 1)[1]
    path = posixpath.normpath("/" + rest.strip("/")) if rest.strip("/") else "/"
    return _SCHEME_ALIASES.get(location.scheme, location.scheme), path


# "<kind>:" not followed by "//": a kind of level, not a store URL ("s3://...").
_KIND = re.compile(r"^([a-zA-Z][a-zA-Z0-9_\-]*):(?!//)")


def level_kind(level: Level) -> str | None:
    """The kind a level names (``"partner"`` for ``"partner:"``), None for a store level."""
    m = _KIND.match(level.url)
    return m.group(1).lower() if m else None


#: A node that needs at most this share of a file's bytes gets only those byte ranges.
PART_SHARE = 0.5

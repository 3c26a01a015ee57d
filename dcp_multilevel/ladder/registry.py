"""The ladders of this process: one per level list, shared by every writer and reader.

Training stacks build a new writer for each save; the drains of a level list
must outlive them. :func:`ladder_for` returns the process's ladder for a
level list, binding it the first time (collective), so writers and readers
given the same levels share its drains and its view of what each level
holds. A process keeps one level list per first level: another list under
the same first root (while a ladder over it is in use) is a
:class:`~dcp_multilevel.ConfigError`, as are lists that differ between
ranks (but for the paths of each node's own disk, a first level's or a
node-local kind's, which each node may spell its own way, and the stores'
options).

:func:`wait` waits for every ladder's due drains (``dcp_multilevel.wait()``);
at interpreter exit the same is done for whatever is left, and what could not
be finished is logged by step and level. A ladder lives until the process
exits, or until the last :class:`~dcp_multilevel.CheckpointManager` over it
is closed (:func:`release`).

Call order (every rank, main thread, the same calls in the same order)::

    ladder = ladder_for(levels, topology=...)   each writer, reader or manager: collective
    wait()                                      any time; again at exit
    release(ladder)                             a manager's close
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .. import _dist
from ..errors import ConfigError, DrainError
from ..levels import LEVEL_KINDS, DrainResult, Topology, level_kind
from ..levels.options import Level
from ..restore.agreement import gather_views
from ..restore.plan import PART_SHARE
from ..stores.location import parse_location
from .binding import Binding, root_of
from .ladder import Ladder
from .naming import describe

__all__ = ["TIMEOUT_ENV", "ladder_for", "ladders", "newest_step", "release", "timeout_s", "wait"]

logger = logging.getLogger("dcp_multilevel.levels")

#: Numbers the ladders of this process (made collectively: the same number on every rank).
_INSTANCES = itertools.count()
# The race: two threads of one process asking for ladders at once (a main thread
# and an exit hook); the ladders themselves are made on the main thread.
_LOCK = threading.Lock()
_LADDERS: dict[Any, Ladder] = {}  # first level's root -> its ladder
_EXIT_HOOK: list[bool] = []  # [True] once the exit hook is registered

#: The environment variable that bounds every wait of the levels, in seconds (see
#: ``docs/levels.md``, "Bounded waits"); 3600 when unset.
TIMEOUT_ENV = "DCP_ML_TIMEOUT_S"

#: The options a ladder is made with when none are given (``timeout_s``: :func:`timeout_s`).
DEFAULTS = {"drain_policy": "latest", "part_share": PART_SHARE}


def timeout_s() -> float:
    """The bound of every wait of the levels: ``DCP_ML_TIMEOUT_S``, else 3600 s.

    Raises:
        ConfigError: the variable holds no positive number.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return 3600.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"environment variable {TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} must be a positive "
            "number of seconds (the bound of every wait of the levels)"
        )
    return value


def ladder_for(
    levels: Sequence[Level] | None,
    *,
    topology: Topology | None = None,
    who: str = "MultiLevelWriter",
    **options: Any,
) -> Ladder:
    """This process's ladder for ``levels``, bound the first time. Collective.

    ``options`` (``drain_policy``, ``timeout_s``, ``part_share``) apply when the
    ladder is made; given for one that exists, they must match it. ``who``
    names the caller in messages.

    Raises:
        ConfigError: a bad level list; lists that differ between ranks (each rank's
            named); another list under the same first root in this process; options
            that differ from the ladder's.
    """
    given = _levels_argument(levels, who)
    key = _identity(given, topology)
    root = root_of(given[0].url, level_kind(given[0]))
    with _LOCK:
        existing = _LADDERS.get(root)
    state = "new" if existing is None else ("same" if existing.key == key else "changed")
    # First, before anything that could go another way on another rank.
    everyone = _dist.all_gather_object(
        (_digest(_identity(given, topology, per_node=True)), state, describe(given))
    )
    if len({digest for digest, _, _ in everyone}) > 1:
        raise ConfigError(
            f"{who}(levels=...): the level lists differ between ranks; every rank must pass "
            "the same levels: "
            + "; ".join(f"rank {r}: {d}" for r, (_, _, d) in enumerate(everyone))
        )
    if any(s == "changed" for _, s, _ in everyone):
        old = describe(existing.given) if existing is not None else "another list"
        raise ConfigError(
            f"{who}(levels={describe(given)}): this process saves under the first level "
            f"{given[0].url!r} with the levels {old}; a process keeps one level list per first "
            "level (its drains and retention follow that list). Pass the same levels, or "
            "close the CheckpointManager using the others first"
        )
    if len({s for _, s, _ in everyone}) > 1:
        raise ConfigError(
            f"{who}(levels={describe(given)}): some ranks have these levels in use and others "
            "not ("
            + ", ".join(f"rank {r}: {s}" for r, (_, s, _) in enumerate(everyone))
            + "); build writers, readers and managers in the same order on every rank"
        )
    settings = {
        **DEFAULTS,
        "timeout_s": timeout_s(),
        **{k: v for k, v in options.items() if v is not None},
    }
    if existing is not None:
        _check_options(existing, settings, options, who)
        return existing
    binding = Binding.build(given, topology, settings["timeout_s"])  # collective
    ladder = Ladder(
        given,
        binding,
        key=key,
        instance=next(_INSTANCES),
        policy=settings["drain_policy"],
        timeout_s=settings["timeout_s"],
        part_share=settings["part_share"],
    )
    with _LOCK:
        _LADDERS[root] = ladder
        _hook_exit()
    return ladder


def ladders() -> list[Ladder]:
    """The ladders of this process, in the order they were made."""
    with _LOCK:
        return list(_LADDERS.values())


def wait() -> list[DrainResult]:
    """Wait until every save of this process is followed up and every due drain has
    landed, on every level list; the newest drain outcomes.

    Not collective, but a drain needs every rank's part: call it on every rank
    (after an async save, once its future is done).

    Raises:
        DrainError: drains that failed since the last call (the first level still
            holds their steps), naming each step and level.
    """
    results: list[DrainResult] = []
    errors: list[str] = []
    for ladder in ladders():
        try:
            results.extend(ladder.wait())
        except DrainError as e:
            errors.append(str(e))
    if errors:
        raise DrainError(" ".join(errors))
    return results


def newest_step(levels: Sequence[Level], *, topology: Topology | None = None) -> int | None:
    """The newest step some rank lists on some level of ``levels``; None when no level
    holds a checkpoint (a fresh start). Collective (every rank).

    For a resume that must not fail on a fresh start::

        if dcp_multilevel.newest_step(levels) is not None:
            dcp.load(state, storage_reader=MultiLevelReader("latest", levels=levels))

    ``MultiLevelReader("latest")`` then loads the newest step *every* rank can read,
    which may be older (a lost node's newest files only it held).
    """
    ladder = ladder_for(levels, topology=topology, who="newest_step")
    ladder.follow_up()  # the saves of this process are listed
    candidates = gather_views(ladder.drivers).candidates()
    return candidates[-1] if candidates else None


def release(ladder: Ladder, *, quiet: bool = False) -> None:
    """A manager is done with ``ladder``: after the last one, wait for its drains and
    forget it, so another level list may use its first root.

    Raises:
        DrainError: drains that failed since the last wait (``quiet``: logged instead,
            for a manager collected without ``close()``).
    """
    with _LOCK:
        ladder.holders -= 1
        if ladder.holders > 0 or ladder.closed:
            return
        for root, known in list(_LADDERS.items()):
            if known is ladder:
                del _LADDERS[root]
    try:
        ladder.wait()
    except DrainError as e:
        if not quiet:
            raise
        logger.error("dcp_multilevel: checkpoint drains had failed: %s", e)
    finally:
        ladder.close()


def _finish_at_exit() -> None:
    """At interpreter exit: finish every ladder's due drains, and log by step and level
    whatever did not reach its level."""
    with _LOCK:
        remaining = list(_LADDERS.values())
        _LADDERS.clear()
    for ladder in remaining:
        try:
            ladder.wait()
        except DrainError as e:
            logger.error("dcp_multilevel: at exit, checkpoints did not reach their levels: %s", e)
        except Exception as e:  # noqa: BLE001 - the exit must go on to the other ladders
            logger.error(
                "dcp_multilevel: at exit, %r could not finish: %s: %s  (left: %s)",
                ladder,
                type(e).__name__,
                e,
                ladder.unfinished(),
            )
        finally:
            ladder.close()


def _hook_exit() -> None:
    """Under the lock: run :func:`_finish_at_exit` at interpreter exit, once.

    Registered with threading's exit hooks where Python has them: those run
    before concurrent.futures refuses new work at shutdown (hooks run newest
    first), which a drain still running then needs; atexit runs after it.
    """
    if not _EXIT_HOOK:
        getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)
        _EXIT_HOOK.append(True)


def _levels_argument(levels: Sequence[Level] | None, who: str) -> list[Level]:
    out = list(levels or ())
    if not out or not all(isinstance(level, Level) for level in out):
        raise ConfigError(
            f"{who}(levels=...) needs a non-empty list of dcp_multilevel.Level(...) objects, "
            f"got {levels!r}"
        )
    return out


def _identity(levels: Sequence[Level], topology: Topology | None, per_node: bool = False) -> str:
    """The levels and topology as canonical JSON (values JSON cannot hold by their type:
    an object in ``storage_options`` is the same on every rank only by its type).

    ``per_node``: leave out what may differ between nodes (what ranks compare): the
    paths of each node's own disk, a first level's local path or a node-local kind's,
    and the stores' options (a node's own endpoint, credentials, spool directory).
    """

    def plain(value: Any) -> Any:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"

    docs = [asdict(level) for level in levels]
    if per_node:
        for i, (doc, level) in enumerate(zip(docs, levels, strict=True)):
            doc.pop("storage_options")
            kind = level_kind(level)
            local = kind is None and i == 0 and parse_location(level.url).scheme == "file"
            if local or (kind is not None and LEVEL_KINDS.get(kind).node_local):
                doc["url"] = f"<this node's: {kind or 'path'}>"
    doc = {
        "levels": docs,
        "topology": list(topology.nodes) if topology is not None else None,
    }
    return json.dumps(doc, sort_keys=True, default=plain)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _check_options(
    ladder: Ladder, settings: dict[str, Any], given: dict[str, Any], who: str
) -> None:
    """Options given for a ladder that exists must be the ones it was made with."""
    have = {
        "drain_policy": ladder.policy,
        "timeout_s": ladder.timeout_s,
        "part_share": ladder.part_share,
    }
    differ = {
        k: (have[k], settings[k])
        for k in have
        if given.get(k) is not None and have[k] != settings[k]
    }
    if differ:
        raise ConfigError(
            f"{who}: the levels {describe(ladder.given)} are in use in this process with "
            + ", ".join(f"{k}={old!r}" for k, (old, _) in differ.items())
            + "; asked for "
            + ", ".join(f"{k}={new!r}" for k, (_, new) in differ.items())
        )

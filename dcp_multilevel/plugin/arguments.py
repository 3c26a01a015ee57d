"""The types of the writer's and reader's arguments, checked as they are built.

A wrong type fails at once with a :class:`~dcp_multilevel.ConfigError` naming the
class, the argument and what it takes, instead of a bare ``TypeError`` from
deep inside a later call (``MultiLevelWriter(5)`` would otherwise fail in
``os.fspath``, after the levels were bound).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["check_arguments"]

#: What each kind of argument takes: the types, and the words for the message.
KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "path": ((str, os.PathLike), "a path or URL (str or os.PathLike)"),
    "bool": ((bool,), "True or False"),
    "options": ((Mapping,), "a dict of options"),
}


def check_arguments(who: str, **arguments: tuple[Any, str]) -> None:
    """Each ``name=(value, kind)`` given (None: not given) is of its kind (:data:`KINDS`).

    Raises:
        ConfigError: ``who(name=...) takes <what>, got <value> (<type>)``.
    """
    for name, (value, kind) in arguments.items():
        types, what = KINDS[kind]
        if value is None or isinstance(value, types):
            continue
        raise ConfigError(f"{who}({name}=...) takes {what}, got {value!r} ({type(value).__name__})")

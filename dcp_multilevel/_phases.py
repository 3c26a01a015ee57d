"""The named phases of a save, a drain and a restore, where a fault test stops a process.

A crash can come at any moment; the product promises that whatever moment it
comes, the newest restorable step loads bit-exact and training goes on
(``docs/levels.md``, "After a crash"). The fault tests check that promise at
each phase below by killing the process there (``SIGKILL``: no exit hook, no
flush), chosen by name, not by timing::

    DCP_ML_STOP_AT="<phase>@<step>"   (or "<phase>": at any step)

=========  ===============================================================
phase      where
=========  ===============================================================
write      a rank's first-level data files are written, not yet committed
commit     the first level committed the step; no drain has started
partner    a partner copy's files are exchanged, not yet committed there
erasure    an erasure level's parity is written, not yet committed there
drain      a store level's files are copied, not yet committed there
restore    a restore brought a lost node's files, before the load reads
=========  ===============================================================

Unset (always, outside the fault tests), :func:`reached` reads one
environment variable and returns.
"""

from __future__ import annotations

import os
import signal

from .errors import ConfigError

__all__ = ["PHASES", "STOP_ENV", "reached"]

#: The environment variable that names the phase (and step) to stop at.
STOP_ENV = "DCP_ML_STOP_AT"

#: The phases, in the order a save, its drains and a later restore pass them.
PHASES = ("write", "commit", "partner", "erasure", "drain", "restore")


def reached(phase: str, step: int | None) -> None:
    """This process is at ``phase`` of ``step``: killed there when ``DCP_ML_STOP_AT``
    names it (read on every call: a forked rank sets it after import)."""
    spec = os.environ.get(STOP_ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name not in PHASES or (at and not at.isdigit()):
        raise ConfigError(
            f"{STOP_ENV}={spec!r} names no phase: '<phase>' or '<phase>@<step>', the phase one "
            f"of {', '.join(PHASES)}"
        )
    if name == phase and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)

"""What ``make setup`` installs and builds is required where CI runs.

A test that needs a training stack or a native kernel skips on a developer's
machine that lacks it, but fails where ``CI`` is set (``.ci/run`` sets it): a
broken install must not turn tests into skips while CI stays green.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["missing", "require"]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def require(name: str, minversion: str | None = None) -> ModuleType:
    """Import ``name`` (at least ``minversion``): skip without it, except in CI, where
    the import error (or the old version) fails the test."""
    if not _in_ci():
        return pytest.importorskip(name, minversion=minversion)
    module = importlib.import_module(name)
    if minversion is not None:
        from packaging.version import Version

        have = getattr(module, "__version__", "0")
        assert Version(have) >= Version(minversion), f"{name} {have} < {minversion}"
    return module


def missing(what: str) -> None:
    """``what`` (a kernel, a library) is not here: skip, except in CI, where it fails."""
    if _in_ci():
        pytest.fail(f"{what}: `make setup` builds or installs it, so CI must have it")
    pytest.skip(what)

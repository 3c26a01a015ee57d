"""One lazy plugin registry per plugin kind, fed by an entry-point group.

Built-ins register exactly like third-party packages, through
``[project.entry-points."<group>"]`` in their ``pyproject.toml``; the group is
read on the first lookup, not at import. Explicit ``register`` calls win over
entry points and refuse to replace a taken name unless ``clobber=True``.
"""

from __future__ import annotations

import threading
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from .errors import RegistryError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> plugin objects for one entry-point ``group``.

    Args:
        group: the entry-point group, e.g. ``"dcp_multilevel.stores"``.
        kind: what a plugin is, for messages ("store", "codec").
    """

    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}  # cache of entry points already imported
        self._entry_points: dict[str, EntryPoint] | None = None
        self._lock = threading.Lock()

    def _eps(self) -> dict[str, EntryPoint]:
        with self._lock:
            if self._entry_points is None:
                found: dict[str, EntryPoint] = {}
                for ep in entry_points(group=self.group):
                    # Two distributions claiming one name is ambiguous: refuse
                    # rather than pick whichever the import system lists first.
                    if ep.name in found and found[ep.name].value != ep.value:
                        raise RegistryError(
                            f"{self.kind} {ep.name!r} is registered twice in entry-point group "
                            f"{self.group!r}: {found[ep.name].value} and {ep.value}; "
                            "uninstall one of the packages"
                        )
                    found[ep.name] = ep
                self._entry_points = found
            return self._entry_points

    def register(self, name: str, obj: T, *, clobber: bool = False) -> None:
        """Register ``obj`` as ``name``; a taken name is an error unless ``clobber``."""
        if not clobber and (name in self._registered or name in self._eps()):
            raise RegistryError(
                f"{self.kind} {name!r} is already registered; pass clobber=True to replace it"
            )
        self._registered[name] = obj

    def get(self, name: str) -> T:
        """The plugin called ``name``; RegistryError listing known names if none."""
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        ep = self._eps().get(name)
        if ep is None:
            known = ", ".join(self.names()) or "none"
            raise RegistryError(
                f"unknown {self.kind} {name!r} (known: {known}). Third-party "
                f"{self.kind}s register in entry-point group {self.group!r}."
            )
        try:
            obj = ep.load()
        except ImportError as e:
            raise RegistryError(
                f"{self.kind} {name!r} is registered by {ep.value} but cannot be imported: {e}"
            ) from e
        return self._loaded.setdefault(name, obj)

    def names(self) -> list[str]:
        """Every name a lookup can resolve (registered or installed), sorted."""
        return sorted(set(self._registered) | set(self._eps()))

    def refresh(self) -> None:
        """Forget entry points and what was loaded from them (after (un)installing plugins)."""
        with self._lock:
            self._entry_points = None
            self._loaded.clear()

"""Byte stores: where checkpoint files live (local disk, remote object stores, ...).

Backends are found by URL scheme through the ``dcp_multilevel.stores``
entry-point group; the built-in ``file`` backend registers the same way.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from .._registry import Registry
from .base import ReadHandle, Store, WriteHandle
from .location import Location, parse_location
from .remote import RemoteStore

__all__ = [
    "STORES",
    "Location",
    "ReadHandle",
    "Store",
    "WriteHandle",
    "parse_location",
    "store_for",
]

#: scheme -> Store subclass (constructed as :class:`Store` documents).
STORES: Registry[type[Store]] = Registry("dcp_multilevel.stores", "store")


def store_for(where: str | os.PathLike[str], **options: Any) -> Store:
    """Build the store for a path or URL, choosing the backend by URL scheme.

    Schemes registered in the ``dcp_multilevel.stores`` group win; any other
    protocol fsspec knows (``hf://``, ``oci://``, ...) goes to the remote store.
    """
    loc = parse_location(where)
    fsspec_knows = loc.scheme in fsspec.available_protocols() or loc.scheme in fsspec.registry
    if loc.scheme not in STORES.names() and fsspec_knows:
        return RemoteStore(loc.url, **options)
    backend = STORES.get(loc.scheme)
    return backend(loc.path if loc.scheme == "file" else loc.url, **options)

"""Storage tiers: where checkpoint files live (local disk, remote object stores, ...).

Backends are found by URL scheme through the ``dcp_multilevel.tiers``
entry-point group; the built-in ``file`` backend registers the same way.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from .._registry import Registry
from ..config import parse_location
from .base import ReadHandle, TierBackend, WriteHandle
from .remote import RemoteTier

__all__ = ["TIER_BACKENDS", "ReadHandle", "TierBackend", "WriteHandle", "tier_for"]

#: scheme -> TierBackend subclass (constructed as ``cls(location_path_or_url, **options)``).
TIER_BACKENDS: Registry[type[TierBackend]] = Registry("dcp_multilevel.tiers", "tier backend")


def tier_for(where: str | os.PathLike[str], **options: Any) -> TierBackend:
    """Build the tier for a path or URL, choosing the backend by URL scheme.

    Schemes registered in the ``dcp_multilevel.tiers`` group win; any other
    protocol fsspec knows (``hf://``, ``oci://``, ...) goes to the remote tier.
    """
    loc = parse_location(where)
    fsspec_knows = loc.scheme in fsspec.available_protocols() or loc.scheme in fsspec.registry
    if loc.scheme not in TIER_BACKENDS.names() and fsspec_knows:
        return RemoteTier(loc.url, **options)
    backend = TIER_BACKENDS.get(loc.scheme)
    return backend(loc.path if loc.scheme == "file" else loc.url, **options)

"""Storage tiers: where checkpoint files live (local disk, remote object stores, ...).

Backends are found by URL scheme through the ``dcp_multilevel.tiers``
entry-point group; the built-in ``file`` backend registers the same way.
"""

from __future__ import annotations

import os
from typing import Any

from .._registry import Registry
from ..config import parse_location
from .base import ReadHandle, Tier, WriteHandle

__all__ = ["TIER_BACKENDS", "ReadHandle", "Tier", "WriteHandle", "tier_for"]

#: scheme -> Tier subclass (constructed as ``cls(location_path_or_url, **options)``).
TIER_BACKENDS: Registry[type[Tier]] = Registry(
    "dcp_multilevel.tiers",
    "tier backend",
    hints={
        "s3": "remote object-store tiers come with dcp_multilevel's remote tier "
        "(install s3fs for s3://)",
        "gs": "install gcsfs for gs://",
        "az": "install adlfs for az://",
    },
)


def tier_for(where: str | os.PathLike[str], **options: Any) -> Tier:
    """Build the tier for a path or URL, choosing the backend by URL scheme."""
    loc = parse_location(where)
    backend = TIER_BACKENDS.get(loc.scheme)
    return backend(loc.path if loc.scheme == "file" else loc.url, **options)

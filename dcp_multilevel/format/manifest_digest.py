"""The manifest's digest of its own bytes: every byte of a manifest is checked.

Item checksums only help if the manifest that records them is right: a
manifest whose ``"float32"`` became ``"int32"`` (same width) would load
wrong values from intact data. So a manifest ends with one more field, the
xxh3-64 of every byte before that field's value::

    {"format":"dcp_multilevel", ... ,"items":[...],"digest":"xxh3_64:<16 hex>"}
    \\_______________________ hashed ________________________/

The field is the document's last bytes, exactly as above, so the digest
covers the file as written (whitespace and key order included) and a reader
checks it before parsing anything. Any change to the hashed bytes is a
mismatch; a change to the field itself leaves a value that is not the
recorded hash, bytes that are not JSON, or a document with no valid digest.

Every manifest a release writes is sealed, so one that does not end with a
digest had its digest field damaged or was not written by dcp_multilevel, and
is refused (:func:`unsealed_error`).
"""

from __future__ import annotations

import re

from ..errors import ManifestDigestError
from .checksum import checksum_of
from .layout import MANIFEST_NAME

__all__ = ["DIGEST_FIELD", "seal", "unsealed_error", "verify_sealed"]

DIGEST_FIELD = "digest"

_OPEN = f',"{DIGEST_FIELD}":"'.encode()
_CLOSE = b'"}'
#: The last bytes of a sealed manifest: the digest field, then the closing brace.
_TRAILER = re.compile(rb',"' + DIGEST_FIELD.encode() + rb'":"(xxh3_64:[0-9a-f]{16})"\}\Z')
_TRAILER_LEN = len(_OPEN) + len("xxh3_64:") + 16 + len(_CLOSE)

_WHAT_TO_DO = (
    "The checkpoint's manifest was modified or damaged after it was written; load the "
    "checkpoint from another level's copy, or an earlier checkpoint."
)


def seal(body: str) -> bytes:
    """``body`` (one JSON object's text, ending in ``}``) with the digest field added last."""
    if not body.endswith("}") or body == "{}":
        raise ValueError("a manifest body must be one non-empty JSON object")
    hashed = body[:-1].encode("utf-8") + _OPEN
    return b"".join((hashed, checksum_of(hashed).encode(), _CLOSE))


def _where(checkpoint: str | None) -> str:
    return f"{checkpoint.rstrip('/')}/{MANIFEST_NAME}" if checkpoint else MANIFEST_NAME


def verify_sealed(data: bytes, *, checkpoint: str | None) -> str | None:
    """The digest ``data`` ends with, checked against its bytes; None when it ends with none.

    Raises:
        ManifestDigestError: the bytes do not hash to the recorded digest.
    """
    match = _TRAILER.search(data, max(0, len(data) - _TRAILER_LEN))
    if match is None:
        return None
    recorded = match.group(1).decode()
    actual = checksum_of(memoryview(data)[: match.start(1)])
    if actual != recorded:
        raise ManifestDigestError(
            f"manifest {_where(checkpoint)} does not match its digest: it records "
            f"{recorded}, its bytes hash to {actual}. {_WHAT_TO_DO}",
            checkpoint=checkpoint,
        )
    return recorded


def unsealed_error(
    fields: set[str] | frozenset[str], *, checkpoint: str | None
) -> ManifestDigestError:
    """The error for a manifest that does not end with its digest.

    ``fields``: its top-level field names, which tell a malformed digest field
    from a missing one.
    """
    trailer = f',"{DIGEST_FIELD}":"xxh3_64:<16 hex digits>"}}'
    if DIGEST_FIELD in fields:
        problem = (
            f"has a malformed digest: the field '{DIGEST_FIELD}' must be the file's last bytes,"
        )
    else:
        problem = "has no digest: every manifest dcp_multilevel writes ends with"
    return ManifestDigestError(
        f"manifest {_where(checkpoint)} {problem} {trailer}. {_WHAT_TO_DO}", checkpoint=checkpoint
    )

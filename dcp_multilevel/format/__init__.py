"""On-disk format: manifest (JSON, versioned), data-file layout, checksums, dtypes.

Pure data handling: nothing here does I/O or knows about writers and readers.
"""

from .checksum import Hasher, checksum_of
from .dtypes import dtype_from_name, dtype_name
from .layout import data_file_path, data_prefix
from .manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ItemLocation,
    Manifest,
    decode_manifest,
    encode_manifest,
)
from .paths import validate_relpath

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Hasher",
    "ItemLocation",
    "Manifest",
    "checksum_of",
    "data_file_path",
    "data_prefix",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "validate_relpath",
]

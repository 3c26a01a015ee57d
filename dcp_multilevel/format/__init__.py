"""On-disk format: manifest (JSON, versioned), data-file layout, checksums, dtypes.

Pure data handling: nothing here does I/O or knows about writers and readers.
"""

from .checksum import Hasher, checksum_of
from .dtypes import dtype_from_name, dtype_name
from .layout import DATA_DIR, data_file_path
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
    "DATA_DIR",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Hasher",
    "ItemLocation",
    "Manifest",
    "checksum_of",
    "data_file_path",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "validate_relpath",
]

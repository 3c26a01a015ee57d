"""Where files live inside one checkpoint.

::

    <checkpoint>/manifest.json               the commit, written last
    <checkpoint>/data/<save_id>/<rank>-<n>.bin

Each save writes its data under a fresh ``save_id``. Overwriting a checkpoint
therefore never touches the files the old manifest describes: the new manifest
replaces the old one in one atomic rename, and only then are the old data
files deleted. At every instant the manifest on disk describes exactly the
data files it names.
"""

from __future__ import annotations

__all__ = ["DATA_DIR", "data_file_path", "data_prefix"]

DATA_DIR = "data"


def data_prefix(save_id: str) -> str:
    """Relative directory holding every data file of one save."""
    return f"{DATA_DIR}/{save_id}"


def data_file_path(save_id: str, rank: int, n: int) -> str:
    """Relative path of the ``n``-th data file written by ``rank`` in save ``save_id``."""
    return f"{DATA_DIR}/{save_id}/{rank}-{n}.bin"

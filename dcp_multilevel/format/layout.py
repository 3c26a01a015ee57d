"""Where files live inside one checkpoint.

::

    <checkpoint>/manifest.json               the commit, written last
    <checkpoint>/data/<rank>-<n>.<token>.bin data files

``token`` is random per rank and per save, chosen by the writing rank itself
(no coordination: DCP's plan caching may replay an earlier plan, so nothing
sent by the coordinator can be relied on to be fresh). Overwriting a
checkpoint therefore never touches the files the old manifest describes: the
new manifest replaces the old one in one atomic rename, and only then is
every data file it does not name deleted. At every instant the manifest on
disk describes exactly the data files it names.
"""

from __future__ import annotations

__all__ = ["DATA_DIR", "data_file_path"]

DATA_DIR = "data"


def data_file_path(rank: int, n: int, token: str) -> str:
    """Relative path of the ``n``-th data file written by ``rank`` in the save ``token``."""
    return f"{DATA_DIR}/{rank}-{n}.{token}.bin"

"""Write golden checkpoints into this folder, each named ``<release>-<kind>``.

    python tests/golden/make_golden.py raw zstd delta

writes, for the plugin version installed (``dcp_multilevel.__version__``):

- ``<release>-raw``: uncoded items;
- ``<release>-zstd``: ``dcp_multilevel.zstd``;
- ``<release>-bytegroup``: ``dcp_multilevel.bytegroup``;
- ``<release>-delta``: ``step-0`` (bytegroup, whole) and ``step-1`` (format
  version 2: its floats stored as deltas against ``step-0``).

Run it once per release, for every kind whose bytes that release changed,
with that release's package first on the path (``PYTHONPATH=<a checkout of the
release tag>``): ``0.1.0-*`` were written so, by the 0.1.0 release's code.
0.1.0's bytegroup checkpoint is ``manifest-digest`` (not ``0.1.0-bytegroup``).
Existing folders are never rewritten: they are what a release wrote, and
tests/unit/test_golden.py must keep loading them bit-exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from golden_state import golden_delta_states, golden_state  # noqa: E402

from dcp_multilevel import MultiLevelWriter, __version__  # noqa: E402

#: kind -> the codec its checkpoint is written with.
CODECS = {"raw": None, "zstd": "zstd", "bytegroup": "bytegroup", "delta": "bytegroup"}


def _writer(path: Path, kind: str, reference: Path | None = None) -> MultiLevelWriter:
    return MultiLevelWriter(path, codec=CODECS[kind], reference=reference, stock_hint=False)


def write(kind: str) -> None:
    """``<release>-<kind>``, unless it exists."""
    root = HERE / f"{__version__}-{kind}"
    if root.exists():
        print(f"keeping {root} (golden files are never rewritten)")
        return
    if kind == "delta":
        first, second = golden_delta_states()
        dcp.save(first, storage_writer=_writer(root / "step-0", kind))
        dcp.save(second, storage_writer=_writer(root / "step-1", kind, root / "step-0"))
    else:
        dcp.save(golden_state(), storage_writer=_writer(root, kind))
    print(f"wrote {root}")


if __name__ == "__main__":
    kinds = sys.argv[1:]
    if not kinds or not set(kinds) <= set(CODECS):
        sys.exit(f"usage: make_golden.py KIND..., each KIND one of {', '.join(CODECS)}")
    for kind in kinds:
        write(kind)

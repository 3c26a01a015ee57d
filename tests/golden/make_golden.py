"""Write the golden checkpoints in this folder. Run ONCE per new format/codec version.

    python tests/golden/make_golden.py v1                # every codec
    python tests/golden/make_golden.py v2 bytegroup      # only the codecs that changed
    python tests/golden/make_golden.py v4 bytegroup      # bytegroup/4: sparse planes
    python tests/golden/make_golden.py fmt2-delta        # a delta checkpoint and its reference
    python tests/golden/make_golden.py manifest-digest   # a manifest sealed by its digest

Existing folders are never rewritten: they are what an earlier release wrote,
and tests/test_golden.py must keep loading them bit-exactly forever.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from golden_state import golden_delta_states, golden_state  # noqa: E402

from dcp_multilevel import MultiLevelWriter  # noqa: E402

CODECS = {"raw": None, "zstd": "zstd", "bytegroup": "bytegroup"}


def delta() -> None:
    """``fmt2-delta/step-0`` (whole) and ``step-1`` (deltas against it)."""
    root = HERE / "fmt2-delta"
    if root.exists():
        print(f"keeping {root} (golden files are never rewritten)")
        return
    first, second = golden_delta_states()
    dcp.save(first, storage_writer=MultiLevelWriter(root / "step-0", codec="bytegroup"))
    writer = MultiLevelWriter(root / "step-1", codec="bytegroup", reference=root / "step-0")
    dcp.save(second, storage_writer=writer)
    print(f"wrote {root}")


def digest() -> None:
    """``manifest-digest``: a checkpoint whose manifest ends with the digest of its bytes."""
    root = HERE / "manifest-digest"
    if root.exists():
        print(f"keeping {root} (golden files are never rewritten)")
        return
    writer = MultiLevelWriter(root, codec="bytegroup", stock_hint=False)
    dcp.save(golden_state(4), storage_writer=writer)
    print(f"wrote {root}")


def main(version: str, names: list[str]) -> None:
    if version == "fmt2-delta":
        delta()
        return
    if version == "manifest-digest":
        digest()
        return
    for name, codec in CODECS.items():
        if names and name not in names:
            continue
        path = HERE / f"{version}-{name}"
        if path.exists():
            print(f"keeping {path} (golden files are never rewritten)")
            continue
        state = golden_state(int(version.removeprefix("v")))
        dcp.save(state, storage_writer=MultiLevelWriter(path, codec=codec))
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""Child process for the memory tests of ``dcp_multilevel.convert`` (and docs/interop.md).

``python _convert_memory_child.py make ROOT COUNT MIB`` writes, in ROOT, one
checkpoint of COUNT float32 tensors of MIB MiB each in our format
(``ours``), a stock DCP directory (``stock``) and a torch.save file
(``model.pt``).

``python _convert_memory_child.py convert SRC DST TO [SRC DST TO ...]`` converts
each, one after another, and prints one JSON line per conversion:
``{"peak_anon_growth": bytes, "total": tensor bytes, "seconds": s}``.
The growth is the peak of ``RssAnon`` (/proc/self/status), sampled every
millisecond by a thread, minus its value just before the conversion (after a
small warm-up conversion loaded every lazily imported module). Several
conversions in one process measure each from its own baseline; memory an
earlier one freed but the allocator kept only lowers a later one's growth,
so run one alone for an exact figure. ``RssAnon``
and not ``ru_maxrss``: pages of file-backed mappings (the scratch tensors,
an mmap-ed source) count in RSS while they are resident, but the kernel can
drop them at any time; anonymous pages are what the process really holds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_multilevel import MultiLevelWriter
from dcp_multilevel.convert import convert


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def make(root: str, count: int, mib: int) -> None:
    numel = (mib << 20) // 4
    # Compressible values (a ramp), so a zstd source is quick to write.
    state = {"layers": {str(i): torch.arange(numel, dtype=torch.float32) + i for i in range(count)}}
    state["step"] = 7
    dcp.save(state, storage_writer=MultiLevelWriter(os.path.join(root, "ours"), sync_files=False))
    dcp.save(state, storage_writer=FileSystemWriter(os.path.join(root, "stock")))
    torch.save(state, os.path.join(root, "model.pt"))


def measure(src: str, dst: str, to: str) -> dict[str, int]:
    warm = tempfile.mkdtemp(prefix="warm-", dir=os.path.dirname(dst))
    tiny = {"w": torch.ones(4)}
    dcp.save(tiny, storage_writer=MultiLevelWriter(os.path.join(warm, "src"), sync_files=False))
    out = os.path.join(warm, "out.safetensors" if to == "safetensors" else "out")
    convert(os.path.join(warm, "src"), out, to=to)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    base = rss_anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    report = convert(src, dst, to=to, skip_non_tensors=to == "safetensors")
    stop.set()
    thread.join()
    peak[0] = max(peak[0], rss_anon())
    return {
        "peak_anon_growth": peak[0] - base,
        "total": report.tensor_bytes,
        "seconds": round(report.seconds, 2),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        args = sys.argv[2:]
        for i in range(0, len(args), 3):
            print(json.dumps(measure(*args[i : i + 3])), flush=True)

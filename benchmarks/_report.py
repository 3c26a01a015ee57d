"""Reporting: what the numbers were measured on, markdown tables, number formats and
PASS/MISS goal lines.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- numbers and goals


def fmt(x: float, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals; ``n/a`` for NaN (not measured)."""
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def times(x: float, digits: int = 2) -> str:
    """A ratio as ``1.23x``; ``n/a`` for NaN."""
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}x"


def samples(xs: Iterable[float], digits: int = 2) -> str:
    """Every sample, as ``[0.12, 0.13]``."""
    return "[" + ", ".join(f"{x:.{digits}f}" for x in xs) + "]"


def verdict(ok: bool | None) -> str:
    """PASS, MISS, or ``n/a `` (padded to the same width) where not measured."""
    return "n/a " if ok is None else ("PASS" if ok else "MISS")


def measured(*xs: float) -> bool:
    """Whether every value was measured (none is NaN)."""
    return not any(math.isnan(x) for x in xs)


def goal_line(ok: bool | None, label: str, detail: str) -> str:
    """``- PASS label: detail`` (MISS, or ``n/a`` where ``ok`` is None)."""
    return f"- {verdict(ok)} {label}: {detail}"


# --------------------------------------------------------------------------- run header


def command(script: str) -> str:
    """The command line that ran ``script`` (its ``__file__``), as the docs cite it."""
    return " ".join(["python", os.path.relpath(script, REPO), *sys.argv[1:]])


def print_header(script: str, root: str | os.PathLike[str]) -> None:
    """``# name: `command` `` and one ``- key: value`` line per :func:`machine_info` item."""
    print(f"# {Path(script).stem}: `{command(script)}`")
    for key, value in machine_info(root).items():
        print(f"- {key}: {value}")


# --------------------------------------------------------------------------- machine, tables


def _run(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def machine_info(root: str | os.PathLike[str]) -> dict[str, str]:
    """What the numbers were measured on: code version, CPU, memory, the disk under
    ``root``, software versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    df = _run(["df", "-hT", os.fspath(root)]).splitlines()
    disk = " ".join(df[-1].split()) if df else "unknown"
    dev = df[-1].split()[0] if df else ""
    rota = ""
    name = Path(dev).name
    rota_file = Path(f"/sys/block/{name}/queue/rotational")
    if rota_file.exists():
        rota = " rotational" if rota_file.read_text().strip() == "1" else " non-rotational"
    commit = _run(["git", "-C", os.fspath(REPO), "rev-parse", "--short", "HEAD"]) or "unknown"
    if _run(["git", "-C", os.fspath(REPO), "status", "--porcelain", "--", "dcp_multilevel"]):
        commit += " + uncommitted changes in dcp_multilevel/"
    return {
        "code": f"dcp_multilevel at git {commit}",
        "cpu": f"{cpu}, os.cpu_count()={os.cpu_count()}, nproc={_run(['nproc']) or '?'}",
        "memory": mem,
        "disk": f"{disk} ({dev}{rota} as reported by the kernel)",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": f"{torch.__version__}, torch.get_num_threads()={torch.get_num_threads()}",
    }


def markdown_table(headers: str | Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned.

    ``headers``: the column names, or one string of them separated by `` | ``.
    """
    if isinstance(headers, str):
        headers = headers.split(" | ")
    rows = [[str(c) for c in r] for r in rows]
    # max() of a list: a table with no rows (e.g. `--codecs ''`) is just its header.
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    align = ["---:" if i else ":---" for i in range(len(headers))]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "| "
        + " | ".join(
            a.rjust(w, "-") if i else a.ljust(w, "-")
            for i, (a, w) in enumerate(zip(align, widths, strict=True))
        )
        + " |",
    ]
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""Reporting: what the numbers were measured on, markdown tables, number formats,
PASS/MISS goal lines, and the results files the tables of the docs are built from.

A results file (``benchmarks/results/<name>.json``, :class:`Results`) holds the
command line, the git commit (and whether the tree had changes), the UTC date,
the machine, the load average before and after, the configurations alternated
and the rounds, and each figure as its samples with their median and spread
(:func:`figure`). ``benchmarks/tables.py`` reads nothing else.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: Format of a results file; tables.py refuses others.
RESULTS_VERSION = 1
#: The share of the machine's CPU that other processes used during a run above which
#: it is marked busy. Measured, not inferred from the load average: that average
#: decays over minutes, so it still counts the benchmark that ran just before.
BUSY_OTHERS_SHARE = 0.10


def _machine_cpu_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


class _JobCpu:
    """CPU seconds of this run's own processes: every process in its process group,
    sampled from /proc four times a second (ranks started through a forkserver are not
    this process's children, so its rusage never counts them). A process that
    ends loses at most its last quarter second, which counts as another's."""

    def __init__(self) -> None:
        self._pgrp = os.getpgrp()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._first: dict[int, float] = self._sample()
        self._last: dict[int, float] = dict(self._first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> dict[int, float]:
        seen: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            if int(fields[2]) == self._pgrp:  # fields[0] is the state: pgrp is 3rd
                seen[int(entry)] = (int(fields[11]) + int(fields[12])) / self._tick
        return seen

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._last.update(self._sample())

    def seconds(self) -> float:
        """CPU seconds the job's processes used since this object was made."""
        self._stop.set()
        self._thread.join()
        self._last.update(self._sample())
        return sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())


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


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ram_gib() -> float:
    """Total memory in GiB (NaN where /proc/meminfo is missing)."""
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def machine_info(root: str | os.PathLike[str]) -> dict[str, str]:
    """What the numbers were measured on: code version, CPU, memory, the disk under
    ``root``, software versions."""
    cpu = cpu_model()
    mem = "unknown" if math.isnan(ram_gib()) else f"{ram_gib():.1f} GiB"
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


# --------------------------------------------------------------------------- results files


def git(*args: str) -> str:
    """``git -C <repo> args...``'s output, stripped ('' when git fails)."""
    return _run(["git", "-C", os.fspath(REPO), *args])


def code_version() -> dict[str, Any]:
    """The commit measured: ``commit`` (full hash), ``dirty`` (any uncommitted change to
    a tracked file) and ``dirty_code`` (the changed paths under ``dcp_multilevel/``: a
    figure measured with them is not that commit's)."""
    status = git("status", "--porcelain", "--untracked-files=no").splitlines()
    paths = [line[3:] for line in status if line[3:]]
    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(paths),
        "dirty_code": [p for p in paths if p.startswith("dcp_multilevel/")],
    }


def machine() -> dict[str, Any]:
    """The machine, for a results file: cores, CPU model, memory, Python, torch."""
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "ram_gib": round(ram_gib(), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def figure(samples: Iterable[float], unit: str) -> dict[str, Any]:
    """One figure of a results file: its samples (one per round, or per save where
    the benchmark says so), their median and their spread (min, max)."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError(f"a figure in {unit} without samples")
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "unit": unit,
        "samples": xs,
    }


class Results:
    """A results file in the making: created before the measurements (date, load
    average, commit), written after them with :meth:`write`."""

    def __init__(self, script: str) -> None:
        self.benchmark = Path(script).stem
        self.command = command(script)
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.load_before = os.getloadavg()
        self.code = code_version()
        self._t0 = time.perf_counter()
        self._machine_cpu0, self._job = _machine_cpu_s(), _JobCpu()

    def document(
        self,
        *,
        figures: Mapping[str, Mapping[str, Any]],
        alternated: Sequence[str],
        rounds: int,
        data: object = None,
        notes: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The file's content. ``figures``: name -> :func:`figure`; ``alternated``: the
        configurations measured in turn (their order rotated every round); ``rounds``:
        how many such rounds; ``data``: the benchmark's own record of every sample."""
        load_after = os.getloadavg()
        cores = os.cpu_count() or 1
        wall = time.perf_counter() - self._t0
        machine_cpu = _machine_cpu_s()
        others: float | None = None
        if machine_cpu is not None and self._machine_cpu0 is not None and wall > 0:
            used = (machine_cpu - self._machine_cpu0) - self._job.seconds()
            others = max(0.0, used) / (wall * cores)
        busy = (
            others > BUSY_OTHERS_SHARE
            if others is not None
            else (self.load_before[0] > 0.5 * cores)
        )
        load = f"1-minute load average {self.load_before[0]:.2f} on {cores} cores before the run"
        share = (
            f"other processes used {others:.0%} of the CPU during the run; "
            if (others is not None)
            else ""
        )
        return {
            "format": RESULTS_VERSION,
            "benchmark": self.benchmark,
            "command": self.command,
            **self.code,
            "date": self.date,
            "wall_s": round(time.perf_counter() - self._t0, 1),
            "machine": machine(),
            "load_before": [round(x, 2) for x in self.load_before],
            "load_after": [round(x, 2) for x in load_after],
            "others_cpu_share": None if others is None else round(others, 3),
            "busy": busy,
            "busy_note": f"{'busy' if busy else 'quiet'}: {share}{load}",
            "alternated": list(alternated),
            "rounds": rounds,
            "figures": dict(figures),
            "notes": list(notes),
            "data": data,
        }

    def write(self, path: str | os.PathLike[str] | None, **content: Any) -> dict[str, Any]:
        """Write :meth:`document` to ``path`` (None: nowhere) and say so; returns it."""
        doc = self.document(**content)
        if path:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"\nresults: {path} ({doc['busy_note']}; {doc['wall_s']:.0f} s)")
        return doc

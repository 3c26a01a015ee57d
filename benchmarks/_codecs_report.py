"""``bench_codecs.py``'s tables and goal lines. See that script's docstring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from _contenders import THREADS, Codec
from _measure import MB, median
from _report import fmt, goal_line, markdown_table, measured, times

Stat = Callable[[list[float]], float]  # how repeats of one measurement are summarized

GOAL_SAVE_FACTOR = 1.3
GOAL_STOCK_FACTOR = 2.0


@dataclass
class CodecResult:
    raw_bytes: int = 0
    comp_bytes: int = 0
    # threads -> per-repeat seconds / CPU seconds of this process
    comp_s: dict[int, list[float]] = field(default_factory=dict)
    decomp_s: dict[int, list[float]] = field(default_factory=dict)
    comp_cpu: dict[int, list[float]] = field(default_factory=dict)
    other_cpu: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.comp_bytes / self.raw_bytes if self.raw_bytes else float("nan")

    def mbps(self, kind: str, threads: int, stat: Stat = median) -> float:
        samples = (self.comp_s if kind == "comp" else self.decomp_s).get(threads)
        if not samples:
            return float("nan")
        return self.raw_bytes / MB / stat(samples)


@dataclass
class SaveResult:
    save_s: list[float] = field(default_factory=list)
    # This process's CPU seconds per save, user and system: the system share is
    # the kernel's write path (page cache), which swings with the disk's state.
    user_s: list[float] = field(default_factory=list)
    sys_s: list[float] = field(default_factory=list)
    disk_bytes: int = 0
    files: int = 0
    other_cpu: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- reporting


def codec_table(
    results: dict[str, dict[str, CodecResult]], codecs: list[Codec], stat: Stat = median
) -> str:
    headers = ["set", "codec", "ratio"]
    headers += [f"comp MB/s t{t}" for t in THREADS] + [f"decomp MB/s t{t}" for t in THREADS]
    rows = []
    for set_name, per_codec in results.items():
        for c in codecs:
            r = per_codec.get(c.name)
            if r is None:
                continue
            row: list[object] = [set_name, c.name, fmt(r.ratio, 4)]
            for kind in ("comp", "decomp"):
                for t in THREADS:
                    row.append(fmt(r.mbps(kind, t, stat), 0) if t in c.threads else "-")
            rows.append(row)
    return markdown_table(headers, rows)


def save_table(
    results: dict[str, dict[str, SaveResult]], raw: dict[str, int], stat: Stat = median
) -> str:
    headers = (
        "set | writer | save s | MB/s | on disk MB | files | vs ours codec=None | "
        "CPU user s | CPU sys s"
    )
    rows = []
    for set_name, per_saver in results.items():
        ref = per_saver.get("ours codec=None")
        ref_s = stat(ref.save_s) if ref and ref.save_s else float("nan")
        for name, r in per_saver.items():
            s = stat(r.save_s)
            rows.append(
                [
                    set_name,
                    name,
                    fmt(s, 3),
                    fmt(raw[set_name] / MB / s, 0),
                    fmt(r.disk_bytes / MB, 1),
                    r.files,
                    times(s / ref_s),
                    fmt(stat(r.user_s)) if r.user_s else "n/a",
                    fmt(stat(r.sys_s)) if r.sys_s else "n/a",
                ]
            )
    return markdown_table(headers, rows)


def goals(
    codec_res: dict[str, dict[str, CodecResult]],
    save_res: dict[str, dict[str, SaveResult]],
    stat: Stat = median,
) -> list[str]:
    """PASS/MISS per goal and set; the goals are for ``ours-bytegroup``, the float codec."""
    nan = float("nan")

    def ratio(s: str, codec: str) -> float:
        r = codec_res.get(s, {}).get(codec)
        return r.ratio if r else nan

    def comp(s: str, codec: str, threads: int) -> float:
        r = codec_res.get(s, {}).get(codec)
        return r.mbps("comp", threads, stat) if r else nan

    def save(s: str, saver: str) -> float:
        r = save_res.get(s, {}).get(saver)
        return stat(r.save_s) if r else nan

    def check(ok: bool, *xs: float) -> bool | None:
        return ok if measured(*xs) else None

    lines = ["(a) ratio of ours-bytegroup at or below ZipNN's on every set"]
    for s in codec_res:
        a, b = ratio(s, "ours-bytegroup"), ratio(s, "zipnn")
        detail = f"{fmt(a, 4)} vs ZipNN {fmt(b, 4)} (ours - ZipNN = {fmt(a - b, 4)})"
        lines.append(goal_line(check(a <= b, a, b), s, detail))
    lines.append(
        "(b) compress MB/s of ours-bytegroup with 2 threads >= 2x stock ZStandard's and "
        ">= ZipNN's, each with 2 threads"
    )
    for s in codec_res:
        a, b, c = comp(s, "ours-bytegroup", 2), comp(s, "stock-zstd", 2), comp(s, "zipnn", 2)
        f = GOAL_STOCK_FACTOR
        detail = f"{fmt(a, 0)} vs {fmt(b, 0)} MB/s = {times(a / b)} (goal >= {f:.0f}x)"
        lines.append(goal_line(check(a >= f * b, a, b), f"{s} vs stock t2", detail))
        detail = f"{fmt(a, 0)} vs {fmt(c, 0)} MB/s = {times(a / c)} (goal >= 1x)"
        lines.append(goal_line(check(a >= c, a, c), f"{s} vs ZipNN t2", detail))
    lines.append(
        f"(c) dcp.save with ours codec=bytegroup <= {GOAL_SAVE_FACTOR}x the time of ours codec=None"
    )
    for s in save_res:
        a, b = save(s, "ours codec=bytegroup"), save(s, "ours codec=None")
        detail = f"{fmt(a, 3)} vs {fmt(b, 3)} s = {times(a / b)}"
        lines.append(goal_line(check(a <= GOAL_SAVE_FACTOR * b, a, b), s, detail))
    lines.append(
        "For information, (c) against stock DCP's uncompressed save (FileSystemWriter), the "
        "other reading of 'an uncompressed save':"
    )
    for s in save_res:
        a, b = save(s, "ours codec=bytegroup"), save(s, "stock")
        lines.append(f"- {s}: {fmt(a, 3)} vs {fmt(b, 3)} s = {times(a / b)}")
    lines.append("For information, ours-zstd against the same bars (b) and (c):")
    for s in codec_res:
        a, b, c = comp(s, "ours-zstd", 2), comp(s, "stock-zstd", 2), comp(s, "zipnn", 2)
        x, y = save(s, "ours codec=zstd"), save(s, "ours codec=None")
        lines.append(
            f"- {s}: compress t2 {times(a / b)} stock, {times(a / c)} ZipNN t2; "
            f"dcp.save {times(x / y)} codec=None"
        )
    return lines


def details(
    codec_res: dict[str, dict[str, CodecResult]], save_res: dict[str, dict[str, SaveResult]]
) -> list[str]:
    """Every sample, and the most other processes took of the CPU meanwhile."""

    def rounded(xs: list[float]) -> list[float]:
        return [round(x, 3) for x in xs]

    out = []
    for s, per in codec_res.items():
        for name, r in per.items():
            parts = []
            for t in sorted(r.comp_s):
                cpu = median(c / w for c, w in zip(r.comp_cpu[t], r.comp_s[t], strict=True))
                parts.append(
                    f"t{t} comp s {rounded(r.comp_s[t])} (CPU/wall {cpu:.2f}) "
                    f"decomp s {rounded(r.decomp_s[t])}"
                )
            other = fmt(100 * max(r.other_cpu, default=float("nan")), 0)
            out.append(f"- {s} {name}: {'; '.join(parts)}; other CPU <= {other}%")
    for s, per in save_res.items():
        for name, r in per.items():
            other = fmt(100 * max(r.other_cpu, default=float("nan")), 0)
            out.append(f"- {s} dcp.save {name}: s {rounded(r.save_s)}; other CPU <= {other}%")
    return out

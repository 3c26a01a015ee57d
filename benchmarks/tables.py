"""The measured figures of README.md and docs/benchmarks.md, built from results files.

Every figure in those two tables comes from a results file in
``benchmarks/results/`` (written by the benchmark itself: ``_report.Results``), so
a figure cannot drift from its source. Each row names its file, with the commit
and date it was measured at; the footnotes give each file's command, machine and
load. The tables are written between the markers ``<!-- figures:begin -->`` and
``<!-- figures:end -->``, and nothing else in either file is touched. A file
of ``FILES`` that is missing stops the build; one of ``OPTIONAL`` adds its
rows when it is there and is left out, with a note, while it is not.

``--check`` writes nothing: it fails if a table differs from what the files
give, or if a figure is stale (its commit has changes under ``dcp_multilevel/``
up to HEAD, its tree had uncommitted ones, or the commit is unknown).

    python benchmarks/tables.py            # rewrite both tables (make tables)
    python benchmarks/tables.py --check    # tables current and figures fresh
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
FORMAT = 1  # _report.RESULTS_VERSION
#: The results files the tables read, in the order of their rows.
FILES = ("save_load", "planner", "codecs", "async", "manager", "nodeloss")
#: Results files whose rows (docs/benchmarks.md only) follow when the file is there,
#: and are left out, with a note, while it is not.
OPTIONAL = ("plugin_levels", "health", "s3")


class TablesError(Exception):
    """A table cannot be built or checked; the message says what to do."""


# --------------------------------------------------------------------------- results files


@dataclass
class Source:
    """One results file: its figures and where they come from."""

    name: str
    path: Path
    doc: dict

    @classmethod
    def load(cls, results: Path, name: str) -> Source:
        path = results / f"{name}.json"
        if not path.exists():
            raise TablesError(f"{path} is missing: run `make figures` (or its benchmark) first")
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise TablesError(
                f"{path} is not a results file of format {FORMAT} (it has no "
                "'format' entry or another one): rerun its benchmark"
            )
        return cls(name, path, doc)

    def med(self, key: str) -> float:
        try:
            return self.doc["figures"][key]["median"]
        except KeyError:
            raise TablesError(
                f"{self.path} has no figure {key!r} (its command: {self.doc['command']}): "
                "rerun it as `make figures` does"
            ) from None

    def has(self, key: str) -> bool:
        return key in self.doc["figures"]

    def spread(self, key: str, digits: int, scale: float = 1.0) -> str:
        f = self.doc["figures"][key]
        return f"{f['min'] * scale:.{digits}f}-{f['max'] * scale:.{digits}f}"

    def cite(self, link: str) -> str:
        """``[name.json](link) abc1234, 2026-01-31`` (plus ``busy`` when it was)."""
        busy = ", busy" if self.doc.get("busy") else ""
        return (
            f"[`{self.name}.json`]({link}{self.name}.json) "
            f"{self.doc['commit'][:7]}, {self.doc['date'][:10]}{busy}"
        )

    def footnote(self) -> str:
        d, m = self.doc, self.doc["machine"]
        dirty = " (tree with uncommitted changes)" if d.get("dirty") else ""
        return (
            f"`{self.name}.json`: `{d['command']}` at {d['commit'][:10]}{dirty}, {d['date']}, "
            f"{d['wall_s']:.0f} s; {m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB, "
            f"Python {m['python']}, torch {m['torch']}; {d['busy_note']}, "
            f"{d['load_after'][0]:.2f} after; {d['rounds']} rounds of "
            f"{', '.join(d['alternated'])} (alternated)"
        )


def best(src: Source, prefix: str, figure: str) -> tuple[str, float]:
    """The configuration named ``<prefix>...`` with the highest median ``figure``."""
    names = {k.split(".")[0] for k in src.doc["figures"] if k.startswith(prefix)}
    if not names:
        raise TablesError(f"{src.path} has no configuration {prefix}*: rerun it")
    return max(((n, src.med(f"{n}.{figure}")) for n in names), key=lambda x: x[1])


def x(a: float, b: float, digits: int = 1) -> str:
    return f"{a / b:.{digits}f}x"


def than(theirs: float, ours: float, less: str, more: str) -> str:
    """``3.1x faster`` where ours is the smaller time, ``1.2x slower`` where not."""
    return f"{x(theirs, ours)} {less}" if ours <= theirs else f"{x(ours, theirs)} {more}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.2f} s"


# --------------------------------------------------------------------------- rows

# A row: (claim, stock DCP, dcp_multilevel); the source cell is added per table.
Row = tuple[str, str, str]


def save_load(s: Source) -> tuple[list[Row], list[Row]]:
    gb = s.med("ours-t1.disk_bytes") / 1e9
    rows = {}
    for kind, label in (
        ("save", "save"),
        ("warm", "load right after the save (a restart on the same node)"),
        ("cold", "load from disk"),
    ):
        (sn, sv), (on, ov) = best(s, "stock-t", f"{kind}_gbps"), best(s, "ours-t", f"{kind}_gbps")
        rows[kind] = (label, f"{sv:.2f} GB/s ({sn})", f"**{ov:.2f} GB/s** ({on}; {x(ov, sv)})")
    save, warm, cold = rows["save"], rows["warm"], rows["cold"]
    raw = s.med("raw disk.cold_gbps")
    head = f"save, one process (BERT-large, {gb:.2f} GB fp32, fsync)"
    readme = [(head, save[1], save[2]), warm]
    ts = s.med("torch.save.save_gbps") if s.has("torch.save.save_gbps") else float("nan")
    docs = [
        (head, f"{save[1]}; `torch.save` {ts:.2f} GB/s", save[2]),
        warm,
        (cold[0], f"{cold[1]}; the raw disk read {raw:.2f} GB/s", cold[2]),
    ]
    return readme, docs


def planner(s: Source) -> tuple[list[Row], list[Row]]:
    n = max(int(k.split(".")[0].removeprefix("ranks")) for k in s.doc["figures"])
    st, ou = s.med(f"ranks{n}.stock.balance"), s.med(f"ranks{n}.ours.balance")
    label = f"busiest rank's bytes, {n:,} data-parallel ranks (BERT-large + AdamW)"
    row = (label, f"{st:.1f}x the mean", f"**{ou:.3f}x** the mean")
    sp, op = s.med(f"ranks{n}.stock.plan_s"), s.med(f"ranks{n}.ours.plan_s")
    plan = (
        f"planning that save, {n:,} ranks (plan only)",
        f"{sp:.2f} s",
        f"{op:.2f} s ({than(sp, op, 'faster', 'slower')})",
    )
    return [row], [row, plan]


def codecs(s: Source) -> tuple[list[Row], list[Row]]:
    sets = ("bert-adamw-fp32", "bert-adamw-bf16")

    def each(codec: str, fig: str, digits: int) -> str:
        return " / ".join(f"{s.med(f'{st}.{codec}.{fig}'):.{digits}f}" for st in sets)

    ours, stock, zipnn = "ours-bytegroup", "stock-zstd", "zipnn"
    speed = [
        s.med(f"{st}.{ours}.comp_mbps.t2") / s.med(f"{st}.{stock}.comp_mbps.t2") for st in sets
    ]
    stored = (
        "stored / raw bytes, BERT + AdamW fp32 / bf16",
        f"{each(stock, 'ratio', 2)} (its ZStandard)",
        f"**{each(ours, 'ratio', 2)}** (ZipNN {each(zipnn, 'ratio', 2)})",
    )
    comp = (
        "compression MB/s, 2 threads, fp32 / bf16",
        f"{each(stock, 'comp_mbps.t2', 0)} (ZStandard)",
        f"**{each(ours, 'comp_mbps.t2', 0)}** ({' / '.join(f'{v:.1f}x' for v in speed)}; "
        f"ZipNN {each(zipnn, 'comp_mbps.t2', 0)})",
    )
    minilm = ("minilm-fp32", "minilm-bf16")
    trained = (
        "stored / raw bytes, trained MiniLM fp32 / bf16",
        " / ".join(f"{s.med(f'{st}.{stock}.ratio'):.3f}" for st in minilm),
        " / ".join(f"**{s.med(f'{st}.{ours}.ratio'):.3f}**" for st in minilm)
        + " (ZipNN "
        + " / ".join(f"{s.med(f'{st}.{zipnn}.ratio'):.3f}" for st in minilm)
        + ")",
    )
    docs = [stored, trained, comp]
    if s.has(f"{sets[0]}.save.ours codec=bytegroup.s"):

        def save(w: str) -> str:
            return " / ".join(f"{s.med(f'{st}.save.{w}.s'):.2f}" for st in sets)

        docs.append(
            (
                "`dcp.save` compressed, BERT + AdamW fp32 / bf16 (s)",
                f"{save('stock+ZStandard')} (ZStandard); uncompressed {save('stock')}",
                f"{save('ours codec=bytegroup')} (bytegroup); "
                f"uncompressed {save('ours codec=None')}",
            )
        )
    return [stored, comp], docs


def async_(s: Source) -> tuple[list[Row], list[Row]]:
    gb = s.med("state_bytes") / 1e9

    def fig(v: str, key: str) -> float:
        return s.med(f"{v}.{key}")

    sb, ob, oo = (
        fig("stock-best", "blocked_s"),
        fig("ours", "blocked_s"),
        fig("ours-overlap", "blocked_s"),
    )
    row = (
        f"training blocked per `async_save` ({gb:.2f} GB)",
        f"{ms(sb)} (`DefaultStager`, async staging, reused); default staging "
        f"{ms(fig('stock', 'blocked_s'))}",
        f"**{ms(oo)}** with `StagingConfig(overlap=True)` ({x(oo, sb, 2)} stock's best); "
        f"default staging {ms(ob)}",
    )
    held = (
        "state held until the weights may change (blocked + staging fence)",
        f"{ms(fig('stock-best', 'held_s'))}",
        f"{ms(fig('ours-overlap', 'held_s'))} (overlap), {ms(fig('ours', 'held_s'))} (default)",
    )
    slow = (
        "Python steps slowed while the save is in flight",
        f"{fig('stock-best', 'slowdown'):+.1%}",
        f"{fig('ours-overlap', 'slowdown'):+.1%} (overlap), {fig('ours', 'slowdown'):+.1%}",
    )
    return [row], [row, held, slow]


def manager(s: Source) -> tuple[list[Row], list[Row]]:
    c = "s3-none"
    gb = s.med(f"{c}.state_bytes") / 1e9
    d, b, dur = s.med(f"{c}.direct_s"), s.med(f"{c}.blocked_s"), s.med(f"{c}.durable_s")
    row = (
        f"blocked per save with a copy on S3 (moto on loopback, {gb:.2f} GB)",
        f"{d:.2f} s: `dcp.save` with `FsspecWriter` straight to S3",
        f"**{b:.2f} s** ({than(d, b, 'less', 'more')}): local level, then drained to S3",
    )
    durable = ("on S3 after", f"{d:.2f} s", f"{dur:.2f} s ({dur / d:.2f}x)")
    return [row], [row, durable]


def nodeloss(s: Source) -> tuple[list[Row], list[Row]]:
    gb = s.med("state_bytes") / 1e9

    def r(c: str) -> float:
        return s.med(f"{c}.restore_s")

    p, e = r("partner-2n"), r("erasure-4n")
    rp, re_ = r("remote-2n"), r("remote-4n")
    row = (
        f"a lost node (4 ranks, {gb:.2f} GB replicated + AdamW)",
        f"its copy is gone; a remote copy (200 MB/s per node) restores in {rp:.1f} s "
        f"(2 nodes) / {re_:.1f} s (4 nodes)",
        f"restored from **partner copies in {p:.1f} s** ({than(rp, p, 'faster', 'slower')}), "
        f"**parity in {e:.1f} s** ({than(re_, e, 'faster', 'slower')})",
    )
    blocked = (
        "blocked per save with the node-local level (partner / erasure)",
        f"remote only: {s.med('remote-2n.blocked_s'):.2f} / {s.med('remote-4n.blocked_s'):.2f} s",
        f"{s.med('partner-2n.blocked_s'):.2f} / {s.med('erasure-4n.blocked_s'):.2f} s",
    )
    return [row], [row, blocked]


def plugin_levels(s: Source) -> tuple[list[Row], list[Row]]:
    mb = s.med("state_bytes") / 1e6
    a, b = s.med("first-level.blocked_s"), s.med("three-levels.blocked_s")
    stock = f"{s.med('stock.blocked_s'):.2f} s: `FileSystemWriter`, one copy on the same disk"
    blocked = (
        f"blocked per `dcp.save` with three levels (2 ranks, {mb:.0f} MB each: first level, "
        "partner copies, a folder as the remote)",
        stock if s.has("stock.blocked_s") else "-",
        f"**{b:.2f} s**; the first level alone {a:.2f} s ({x(b, a, 2)})",
    )
    wp, wm = s.med("three-levels.wait_s"), s.med("manager.wait_s")
    wait = (
        "`dcp_multilevel.wait()` after the last save (its drains)",
        "no drains",
        f"{wp:.2f} s; `CheckpointManager.wait()` {wm:.2f} s ({x(wp, wm, 2)})",
    )
    docs = [blocked, wait]
    if s.has("drains.disk_read_share"):
        share = s.doc["figures"]["drains.disk_read_share"]
        docs.append(
            (
                "disk reads while the drains read the first level (`/proc/self/io`)",
                "no drains",
                f"{share['max'] * 100:.1f} % of the bytes drained at most (the page cache)",
            )
        )
    if s.has("memory.traced_per_save"):
        n = int(s.med("memory.saves"))
        flat = s.doc["figures"]["memory.books_flat"]["min"] == 1.0
        docs.append(
            (
                f"memory per save over {n} saves through the plugin (three levels, 2 ranks)",
                "-",
                f"{s.med('memory.traced_per_save'):.0f} B Python-level, "
                f"{s.med('memory.rss_per_save') / 1024:.1f} KiB RSS (saves {n // 2} to {n}); "
                f"the runtime's books {'flat' if flat else '**grew**'}",
            )
        )
    return [], docs


def health(s: Source) -> tuple[list[Row], list[Row]]:
    gb = s.med("state_bytes") / 1e9
    share = lambda key: f"{s.med(key) * 100:+.0f} %"  # noqa: E731
    sync = (
        f"health checks on / off, `dcp.save` (2 ranks, {gb:.2f} GB: weights replicated, "
        "AdamW sharded)",
        f"stock `FileSystemWriter` {s.med('stock.blocked_s'):.2f} s blocked",
        f"blocked {s.med('on.blocked_s'):.2f} / {s.med('off.blocked_s'):.2f} s "
        f"({x(s.med('on.blocked_s'), s.med('off.blocked_s'), 2)}); checks' CPU "
        f"{share('checks.cpu_share')} of the save's (the writer's checks "
        f"{share('writer-checks.cpu_share')}, the replica digests "
        f"{share('replica-check.cpu_share')})",
    )
    asynchronous = (
        "health checks on / off, `dcp.async_save` (the same state)",
        "-",
        f"blocked {s.med('async-on.blocked_s'):.2f} / {s.med('async-off.blocked_s'):.2f} s "
        f"({x(s.med('async-on.blocked_s'), s.med('async-off.blocked_s'), 2)}); done "
        f"{s.med('async-on.done_s'):.2f} / {s.med('async-off.done_s'):.2f} s; checks' CPU "
        f"{share('async-checks.cpu_share')}",
    )
    coded = (
        'health checks on / off, `dcp.save` with `codec="bytegroup"`',
        "-",
        f"blocked {s.med('coded-on.blocked_s'):.2f} / {s.med('coded-off.blocked_s'):.2f} s "
        f"({x(s.med('coded-on.blocked_s'), s.med('coded-off.blocked_s'), 2)}); checks' CPU "
        f"{share('coded-checks.cpu_share')}",
    )
    return [], [sync, asynchronous, coded]


def s3(s: Source) -> tuple[list[Row], list[Row]]:
    gb = s.med("state_bytes") / 1e9
    ours, stock = s.med("ours.save_s"), s.med("stock.save_s")
    tc = s.med("s3torchconnector.save_s") if s.has("s3torchconnector.save_s") else None
    theirs = f"`FsspecWriter` {stock:.2f} s" + (
        f"; `s3torchconnector` {tc:.2f} s" if tc is not None else ""
    )
    best = min(stock, tc) if tc is not None else stock
    save = (
        f"a {gb:.1f} GB save straight to S3 (moto on loopback)",
        theirs,
        f"{ours:.2f} s ({x(ours, best, 2)} the faster of theirs)",
    )
    drain = s.med("drain.save_s")
    drained = (
        "the same bytes drained to S3 from a local first level",
        "-",
        f"the drain {drain:.2f} s ({x(drain, ours, 2)} our direct save); "
        f"`dcp.save` blocked {s.med('drain.blocked_s'):.2f} s",
    )
    load_theirs = f"`FsspecReader` {s.med('stock.load_s'):.2f} s" + (
        f"; `s3torchconnector` {s.med('s3torchconnector.load_s'):.2f} s"
        if s.has("s3torchconnector.load_s")
        else ""
    )
    load = ("a load of it from S3", load_theirs, f"{s.med('ours.load_s'):.2f} s")
    return [], [save, drained, load]


BUILDERS: dict[str, Callable[[Source], tuple[list[Row], list[Row]]]] = {
    "save_load": save_load,
    "planner": planner,
    "codecs": codecs,
    "async": async_,
    "manager": manager,
    "nodeloss": nodeloss,
    "plugin_levels": plugin_levels,
    "health": health,
    "s3": s3,
}

#: Rows no benchmark measures: what the format does, and the test that shows it.
DESIGN: list[tuple[str, str, str, str]] = [
    (
        "a flipped byte",
        "loaded silently",
        "**checksum per item**, next copy used",
        "`tests/unit/test_corruption.py`",
    ),
    (
        "a diverged run (NaN from step 3 on)",
        "saved like any other step; the newest is resumed, NaN and all",
        "**quarantined** on the first level; clean steps kept on every level; the resume "
        "takes the newest clean one",
        "`tests/multiprocess/test_health.py`",
    ),
    (
        "metadata",
        "pickled `.metadata`",
        "versioned JSON, validated; no pickle for tensors",
        "`tests/unit/test_roundtrip.py`",
    ),
]


# --------------------------------------------------------------------------- tables


def _table(rows: list[tuple[str, ...]], head: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + ":--|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def build(results: Path) -> tuple[str, str, list[Source]]:
    """The README's table and docs/benchmarks.md's, and the files they read."""
    sources = [Source.load(results, n) for n in FILES]
    sources += [Source.load(results, n) for n in OPTIONAL if (results / f"{n}.json").exists()]
    readme, docs = [], []
    for src in sources:
        short, long = BUILDERS[src.name](src)
        readme += [(*r, src.cite("benchmarks/results/")) for r in short]
        docs += [(*r, src.cite("../benchmarks/results/")) for r in long]
    readme += DESIGN
    head = ("", "stock DCP, its best configuration", "dcp_multilevel", "results file")
    note = (
        "Generated by `make tables` from the results files; "
        "[docs/benchmarks.md](docs/benchmarks.md) has the commands, machines and more rows."
    )
    readme_text = "\n".join([*_table(readme, head), "", note])
    docs_lines = _table(docs, ("claim", "stock DCP, its best configuration", "ours", "file"))
    docs_lines += ["", "Generated by `make tables`. Each file:", ""]
    docs_lines += [f"- {src.footnote()}" for src in sources]
    return readme_text, "\n".join(docs_lines), sources


def splice(path: Path, table: str) -> tuple[str, str]:
    """(the file's text, the text with ``table`` between its markers)."""
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise TablesError(
            f"{path} needs one line {BEGIN} and, after it, one line {END} where the "
            "table of figures goes (nothing is written without them)"
        )
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return text, f"{head}{BEGIN}\n{table}\n{END}{tail}"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=False, capture_output=True, text=True
    )


def _files(paths: list[str]) -> str:
    return f"{len(paths)} file{'s' if len(paths) != 1 else ''}"


def stale(src: Source, repo: Path) -> str | None:
    """Why ``src``'s figures are not the code at HEAD's, or None."""
    commit = src.doc["commit"]
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return f"{src.path}: commit {commit[:10]} is not in this repository's history"
    if dirty := src.doc.get("dirty_code"):
        return (
            f"{src.path}: measured with uncommitted changes in {_files(dirty)} of "
            f"dcp_multilevel/ (e.g. {dirty[0]}): commit, then rerun it"
        )
    changed = _git(repo, "diff", "--name-only", commit, "HEAD", "--", "dcp_multilevel/")
    if changed.stdout.strip():
        files = changed.stdout.split()
        return (
            f"{src.path}: measured at {commit[:10]}; dcp_multilevel/ changed since "
            f"({_files(files)}, e.g. {files[0]}): rerun `make figures`"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--repo", type=Path, default=REPO, help="the git repository (for --check)")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail if a table differs or a figure is stale",
    )
    args = p.parse_args(argv)
    try:
        readme, docs, sources = build(args.results)
        edits = [
            (path, *splice(path, table))
            for path, table in ((args.readme, readme), (args.docs, docs))
        ]
    except TablesError as e:
        print(f"tables: {e}", file=sys.stderr)
        return 2
    for name in OPTIONAL:
        if not (args.results / f"{name}.json").exists():
            print(
                f"tables: {args.results / name}.json is not there: its rows are left out "
                "(its benchmark writes it)"
            )
    if not args.check:
        for path, old, new in edits:
            if new != old:
                path.write_text(new)
            print(f"{'wrote' if new != old else 'unchanged'} {path}")
        return 0
    problems = [
        f"{path}: its table differs from the results files: run `make tables`"
        for path, old, new in edits
        if new != old
    ]
    problems += [why for src in sources if (why := stale(src, args.repo))]
    for line in problems:
        print(f"tables --check: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

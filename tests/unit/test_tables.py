"""``benchmarks/tables.py``: the docs' tables of figures built from results files.

Results files are made as the benchmarks make them (``_report.Results``): one by
a real run of ``bench_planner.py`` in its smallest mode, the others by hand with
known figures, so that the rows can be asserted whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import tables  # noqa: E402
from _report import Results, figure  # noqa: E402

PROSE = "# Title\n\nProse before.\n\n{}\n\nProse after.\n"
MARKERS = f"{tables.BEGIN}\nold table\n{tables.END}"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _f(value: float, unit: str = "s") -> dict:
    return figure([value * 0.9, value, value * 1.1], unit)


HAND_MADE = {
    "save_load": {
        "stock-t1.save_gbps": _f(1.0),
        "stock-t2.save_gbps": _f(1.2),
        "ours-t1.save_gbps": _f(3.0),
        "ours-t2.save_gbps": _f(2.4),
        "stock-t1.warm_gbps": _f(3.5),
        "stock-t2.warm_gbps": _f(3.0),
        "ours-t1.warm_gbps": _f(7.0),
        "ours-t2.warm_gbps": _f(8.75),
        "stock-t1.cold_gbps": _f(1.0),
        "stock-t2.cold_gbps": _f(1.1),
        "ours-t1.cold_gbps": _f(0.7),
        "ours-t2.cold_gbps": _f(1.0),
        "raw disk.cold_gbps": _f(0.8),
        "torch.save.save_gbps": _f(0.5),
        "ours-t1.disk_bytes": figure([1.47e9], "B"),
    },
    "planner": {
        "ranks1024.stock.balance": figure([29.0], "x"),
        "ranks1024.ours.balance": figure([1.007], "x"),
        "ranks1024.stock.plan_s": _f(16.0),
        "ranks1024.ours.plan_s": _f(4.0),
    },
    "codecs": {
        f"{s}.{c}.{k}": figure([v], "u")
        for s in ("bert-adamw-fp32", "bert-adamw-bf16", "minilm-fp32", "minilm-bf16")
        for c, ratio, mbps in (
            ("stock-zstd", 0.9, 300),
            ("ours-bytegroup", 0.8, 1500),
            ("zipnn", 0.81, 700),
        )
        for k, v in (("ratio", ratio), ("comp_mbps.t2", mbps))
    },
    "async": {
        **{
            f"{v}.{k}": _f(b)
            for v, b in (
                ("stock", 1.2),
                ("stock-best", 0.001),
                ("ours", 0.3),
                ("ours-overlap", 0.002),
            )
            for k in ("blocked_s",)
        },
        **{f"{v}.held_s": _f(0.4) for v in ("stock-best", "ours-overlap", "ours")},
        **{f"{v}.slowdown": _f(0.05, "share") for v in ("stock-best", "ours-overlap", "ours")},
        "state_bytes": figure([1.5e9], "B"),
    },
    "manager": {
        "s3-none.direct_s": _f(7.0),
        "s3-none.blocked_s": _f(0.35),
        "s3-none.durable_s": _f(7.7),
        "s3-none.state_bytes": figure([0.41e9], "B"),
    },
    "nodeloss": {
        **{
            f"{c}.restore_s": _f(v)
            for c, v in (
                ("remote-2n", 12.0),
                ("partner-2n", 3.0),
                ("remote-4n", 8.0),
                ("erasure-4n", 4.0),
            )
        },
        **{
            f"{c}.blocked_s": _f(0.5)
            for c in ("remote-2n", "partner-2n", "remote-4n", "erasure-4n")
        },
        "state_bytes": figure([1.23e9], "B"),
    },
}


def write_results(results: Path, name: str, **override: object) -> dict:
    """A results file as ``bench_<name>.py`` writes it, measured at HEAD, clean tree."""
    run = Results(str(BENCH / f"bench_{name}.py"))
    doc = run.document(figures=HAND_MADE[name], alternated=["stock", "ours"], rounds=3)
    doc.update({"commit": _git("rev-parse", "HEAD"), "dirty": False, "dirty_code": []})
    doc.update(override)
    (results / f"{name}.json").write_text(json.dumps(doc))
    return doc


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    for name in tables.FILES:
        write_results(results, name)
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(PROSE.format(MARKERS))
    docs.write_text(PROSE.format(MARKERS))
    return results, readme, docs


def _run(results: Path, readme: Path, docs: Path, *extra: str) -> int:
    return tables.main(
        ["--results", str(results), "--readme", str(readme), "--docs", str(docs), *extra]
    )


def test_rows_come_from_the_results_files_and_only_the_table_changes(paths, capsys):
    results, readme, docs = paths
    assert _run(results, readme, docs) == 0
    text = readme.read_text()
    head, table = text.split(tables.BEGIN)
    table, tail = table.split(tables.END)
    assert head == "# Title\n\nProse before.\n\n" and tail == "\n\nProse after.\n"
    doc = json.loads((results / "save_load.json").read_text())
    cite = f"{doc['commit'][:7]}, {doc['date'][:10]}" + (", busy" if doc["busy"] else "")
    rows = table.strip().splitlines()
    assert rows[0] == "|  | stock DCP, its best configuration | dcp_multilevel | results file |"
    assert rows[2] == (
        "| save, one process (BERT-large, 1.47 GB fp32, fsync) | 1.20 GB/s (stock-t2) | "
        f"**3.00 GB/s** (ours-t1; 2.5x) | [`save_load.json`](benchmarks/results/save_load.json) "
        f"{cite} |"
    )
    assert rows[3].startswith(
        "| load right after the save (a restart on the same node) | 3.50 GB/s (stock-t1) | "
        "**8.75 GB/s** (ours-t2; 2.5x) |"
    )
    assert rows[4].startswith(
        "| busiest rank's bytes, 1,024 data-parallel ranks (BERT-large + AdamW) | "
        "29.0x the mean | **1.007x** the mean |"
    )
    assert "| 1.0 ms (`DefaultStager`, async staging, reused); default staging 1.20 s | " in text
    assert "**2.0 ms** with `StagingConfig(overlap=True)` (2.00x stock's best)" in text
    assert (
        "| 7.00 s: `dcp.save` with `FsspecWriter` straight to S3 | **0.35 s** (20.0x less): "
        "local level, then drained to S3 |" in text
    )
    assert "restored from **partner copies in 3.0 s** (4.0x faster), **parity in 4.0 s** " in text
    assert "(../benchmarks/results/nodeloss.json)" in docs.read_text()
    assert f"`save_load.json`: `{doc['command']}` at {doc['commit'][:10]}" in docs.read_text()
    # Fresh figures, tables as the files give them.
    capsys.readouterr()
    assert _run(results, readme, docs, "--check") == 0, capsys.readouterr().err


def test_a_real_benchmark_run_makes_its_row(paths):
    results, readme, docs = paths
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_planner.py"),
            "--max-ranks",
            "4",
            "--min-ranks",
            "4",
            "--skip-e2e",
            "--repeat",
            "1",
            "--results",
            str(results / "planner.json"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    doc = json.loads((results / "planner.json").read_text())
    assert doc["command"].startswith("python benchmarks/bench_planner.py --max-ranks 4")
    assert doc["commit"] == _git("rev-parse", "HEAD") and doc["alternated"] == ["stock", "ours"]
    assert set(doc["machine"]) >= {"cores", "cpu", "ram_gib", "python", "torch"}
    assert _run(results, readme, docs) == 0
    (row,) = [r for r in readme.read_text().splitlines() if "busiest rank" in r]
    assert row.startswith("| busiest rank's bytes, 4 data-parallel ranks (BERT-large + AdamW) | ")
    ours = doc["figures"]["ranks4.ours.balance"]["median"]
    assert f"| **{ours:.3f}x** the mean | [`planner.json`](benchmarks/results/planner.json) " in row


def test_check_fails_on_a_table_edited_by_hand(paths, capsys):
    results, readme, docs = paths
    assert _run(results, readme, docs) == 0
    readme.write_text(readme.read_text().replace("**3.00 GB/s**", "**3.10 GB/s**"))
    capsys.readouterr()
    assert _run(results, readme, docs, "--check") == 1
    assert capsys.readouterr().err == (
        f"tables --check: {readme}: its table differs from the results files: run `make tables`\n"
    )


def test_check_fails_on_stale_figures(paths, capsys):
    results, readme, docs = paths
    last = _git("log", "-1", "--format=%H", "--", "dcp_multilevel/")
    before = _git("rev-parse", f"{last}^")
    changed = _git("diff", "--name-only", before, "HEAD", "--", "dcp_multilevel/").split()
    write_results(results, "codecs", commit=before)
    write_results(results, "manager", commit="0" * 40)
    write_results(results, "async", dirty_code=["dcp_multilevel/plugin/writer.py"])
    assert _run(results, readme, docs) == 0
    capsys.readouterr()
    assert _run(results, readme, docs, "--check") == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tables --check: {results / 'codecs.json'}: measured at {before[:10]}; dcp_multilevel/ "
        f"changed since ({len(changed)} file{'s' * (len(changed) != 1)}, e.g. {changed[0]}): "
        "rerun `make figures`",
        f"tables --check: {results / 'async.json'}: measured with uncommitted changes in 1 file "
        "of dcp_multilevel/ (e.g. dcp_multilevel/plugin/writer.py): commit, then rerun it",
        f"tables --check: {results / 'manager.json'}: commit 0000000000 is not in this "
        "repository's history",
    ]


def test_no_markers_no_write(paths, capsys):
    results, readme, docs = paths
    readme.write_text("# README without the markers\n")
    assert _run(results, readme, docs) == 2
    assert capsys.readouterr().err == (
        f"tables: {readme} needs one line {tables.BEGIN} and, after it, one line {tables.END} "
        "where the table of figures goes (nothing is written without them)\n"
    )
    assert readme.read_text() == "# README without the markers\n"
    assert docs.read_text() == PROSE.format(MARKERS)


def test_a_missing_results_file_says_how_to_make_it(paths, capsys):
    results, readme, docs = paths
    (results / "nodeloss.json").unlink()
    assert _run(results, readme, docs) == 2
    assert capsys.readouterr().err == (
        f"tables: {results / 'nodeloss.json'} is missing: run `make figures` (or its benchmark) "
        "first\n"
    )

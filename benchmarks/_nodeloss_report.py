"""``bench_nodeloss.py``'s tables and goal lines, from every rank's records.
See that script's docstring for what is measured."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Measure this checkout's dcp_multilevel whatever is installed; tests/_dist.py runs the ranks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _remotes  # noqa: F401 - registers throttled:// with fsspec (in every rank too)
from _measure import GB, median, spread
from _nodeloss_jobs import DECODE_OURS, DECODE_ZFEC, ENCODE_OURS, ENCODE_ZFEC, WORLD, Config
from _report import fmt, goal_line, markdown_table, times
from dcp_multilevel.levels.erasure_code import CHUNK

BLOCKED_GOAL = 1.10  # blocked with the level / without <= this (noise band)
RESTORE_GOAL = 3.0  # restore from the remote / with the level >= this
PADDING_GOAL = 0.01  # erasure padding / checkpoint bytes < this
ENCODE_GOAL = 0.95  # ours / zfec encode GB/s >= this (noise band)

# --------------------------------------------------------------------------- report


def _max_by(records: list[dict], key: Any) -> dict[tuple, float]:
    """(config, round, save index) -> the largest ``key(rank's save)`` over ranks."""
    out: dict[tuple, float] = {}
    for r in records:
        for i, s in enumerate(r["saves"]):
            k = (r["config"], r["round"], i)
            v = key(s)
            if v is not None:
                out[k] = max(out.get(k, v), v)
    return out


def _sum_by(records: list[dict], key: Any) -> dict[tuple, float]:
    """(config, round, save index) -> the sum of ``key(rank's save)`` over ranks."""
    out: dict[tuple, float] = {}
    for r in records:
        for i, s in enumerate(r["saves"]):
            k = (r["config"], r["round"], i)
            out[k] = out.get(k, 0.0) + key(s)
    return out


def _of(table: dict[tuple, float], config: str, first: bool = False) -> list[float]:
    """The samples of ``config``, without each manager's first save unless ``first``."""
    return [v for (c, _, i), v in sorted(table.items()) if c == config and (first or i > 0)]


@dataclass
class Summary:
    config: Config
    blocked: list[float]
    l1: list[float]
    tail: list[float]
    stored: dict[str, list[float]]  # level -> bytes per save (sum over ranks)
    sent: dict[str, list[float]]
    drain_s: dict[str, list[float]]  # level -> slowest rank's drain seconds
    load: list[float]  # load_latest with no node lost, slowest rank, per round
    restore: list[float]  # load_latest after losing a node, slowest rank, per round
    restore_part: list[float]  # RestoreReport.seconds (copies and rebuilds), slowest rank
    exact: list[str]
    disk: list[dict[str, Any]]
    received: dict[str, int]  # the lost node's lowest rank, last round
    # The slowest rank's seconds in each phase of the restore (see load_phases), per round.
    phases: dict[str, list[float]] = field(default_factory=dict)


def summarize(records: list[dict], cfg: Config, lose_node: int) -> Summary:
    mine = [r for r in records if r["config"] == cfg.name]
    levels = ["remote"] + ([cfg.kind] if cfg.kind else [])

    def per_level(field_: str, agg: Any) -> dict[str, list[float]]:
        return {
            lv: _of(agg(mine, lambda s, lv=lv: s["drains"].get(lv, {}).get(field_, 0)), cfg.name)
            for lv in levels
        }

    stored = per_level("stored", _sum_by)  # every rank reports its own share
    restores: dict[int, list[dict]] = {}
    for r in mine:
        restores.setdefault(r["round"], []).append(r)

    def slowest(phase: str, key: str) -> list[float]:
        return [max(r[phase][key] for r in rs) for _, rs in sorted(restores.items())]

    phases: dict[str, list[float]] = {}
    for _, rs in sorted(restores.items()):
        worst = max(rs, key=lambda r: r["restore"]["load_s"])["restore"].get("phases", {})
        for k, v in worst.items():
            phases.setdefault(k, []).append(v)

    lost_rank = lose_node * (WORLD // cfg.nodes)
    last = max(restores) if restores else 0
    received = next(
        (r["restore"]["received"] for r in restores.get(last, []) if r["rank"] == lost_rank), {}
    )
    exact = {r[phase]["exact"] for r in mine for phase in ("load", "restore")}
    return Summary(
        cfg,
        blocked=_of(_max_by(mine, lambda s: s["call_s"]), cfg.name),
        l1=_of(_max_by(mine, lambda s: s["l1_s"]), cfg.name),
        tail=_of(_max_by(mine, lambda s: s["tail_s"]), cfg.name),
        stored=stored,
        sent=per_level("sent", _sum_by),
        drain_s=per_level("seconds", _max_by),
        load=slowest("load", "load_s"),
        restore=slowest("restore", "load_s"),
        restore_part=slowest("restore", "restore_s"),
        exact=sorted(exact),
        disk=[r["disk"] for r in mine if "disk" in r],
        received=received,
        phases=phases,
    )


def short(source: str) -> str:
    """A restore source without its path: ``partner (node 0)``, ``L1 (node 2)``."""
    url, _, where = source.partition(" (")
    kind, sep, _ = url.partition(":")
    name = kind if sep and kind in ("partner", "erasure") else "L1" if "/l1" in url else url
    return f"{name} ({where}" if where else name


def gb(x: float, digits: int = 3) -> str:
    return fmt(x / GB, digits)


def paired(coder: dict[str, list[float]], what: str) -> float:
    """Median over rounds of ours / zfec GB/s for ``what`` (``encode`` or ``decode``)."""
    ours, lib = (ENCODE_OURS, ENCODE_ZFEC) if what == "encode" else (DECODE_OURS, DECODE_ZFEC)
    return median(a / b for a, b in zip(coder[ours], coder[lib], strict=True))


def ranks_tables(sums: dict[str, Summary], args: argparse.Namespace, state_bytes: int) -> list[str]:
    """The saves table and the restore table."""
    counted = args.saves - 1
    out = [
        f"### Saves (medians over {args.repeat} rounds x {counted} saves; spread in brackets)",
        "",
    ]
    headers = (
        "config | blocked s (save call) | vs remote only | L1 commit s | node-local level: "
        "stored GB / sent GB per save | its drain s | remote: uploaded GB per save | "
        "remote drain s | drain tail after the step s"
    )
    rows = []
    for s in sums.values():
        base = sums.get(s.config.baseline or "")
        kind = s.config.kind
        rows.append(
            [
                s.config.label,
                f"{fmt(median(s.blocked), 3)} [{spread(s.blocked, 3)}]",
                times(median(s.blocked) / median(base.blocked)) if base else "-",
                fmt(median(s.l1), 3),
                f"{gb(median(s.stored[kind]))} / {gb(median(s.sent[kind]))}" if kind else "-",
                f"{fmt(median(s.drain_s[kind]))} [{spread(s.drain_s[kind])}]" if kind else "-",
                gb(median(s.stored["remote"])),
                f"{fmt(median(s.drain_s['remote']))} [{spread(s.drain_s['remote'])}]",
                fmt(median(s.tail)),
            ]
        )
    out += [
        markdown_table(headers, rows),
        "",
        f"Checkpoint: {gb(state_bytes)} GB per save ("
        + (
            "the replicated state, each rank writing its balanced share"
            if args.state == "replicated"
            else "the sharded state, each rank writing its own shard"
            + (" and a share of the step counts" if args.state == "fsdp" else "")
        )
        + "). Stored = new bytes on the level's disks (partner copies, parity "
        "blocks; the node's own files are hard links), sent = bytes a rank sent to other "
        "ranks, both summed over ranks; drain s = the slowest rank's.",
        "",
        f"### Restore after losing node {args.lose_node} (load_latest of a new job's manager, "
        f"slowest rank, page cache evicted; medians over {args.repeat} rounds)",
        "",
    ]
    headers = (
        "config | restore s | of which copies / rebuilds s | slowest rank: plan / bring / "
        "read s | remote only / this | load, no node lost s | loaded state | "
        "the lost node got its files from"
    )
    rows = []
    for s in sums.values():
        base = sums.get(s.config.baseline or "")
        got = ", ".join(f"{short(k)}: {v} files" for k, v in sorted(s.received.items()))
        rows.append(
            [
                s.config.label,
                f"{fmt(median(s.restore))} [{spread(s.restore)}]",
                fmt(median(s.restore_part)) if s.config.kind else "-",
                " / ".join(fmt(median(s.phases.get(k, [0.0]))) for k in ("plan", "bring", "read")),
                times(median(base.restore) / median(s.restore)) if base else "-",
                f"{fmt(median(s.load))} [{spread(s.load)}]",
                "; ".join(s.exact),
                got or "the remote (read per file by the loading ranks)",
            ]
        )
    return [*out, markdown_table(headers, rows), ""]


def erasure_storage(sums: dict[str, Summary], goals: list[str]) -> list[str]:
    """The erasure level's bytes on disk (and its goal line, appended to ``goals``)."""
    out: list[str] = []
    for s in sums.values():
        if s.config.kind != "erasure" or s.config.whole_files or not s.disk:
            continue  # (the whole-files variant saves the very same way)
        k, m = s.config.options["data"], s.config.options["parity"]
        disk = s.disk[-1]
        data, parity = disk["data"], disk["parity"]
        padding = parity - m * data / k
        rows = [
            [
                g,
                " + ".join(f"{x:,}" for x in d["members"]),
                f"{d['stripe']:,}",
                f"{d['stripe'] * d['parity']:,}",
            ]
            for g, d in sorted(disk["groups"].items())
        ]
        out += [
            f"### Erasure storage on disk (RS({k}+{m}), last save of the last round)",
            "",
            markdown_table("group | member bytes | stripe (padded member) | parity bytes", rows),
            "",
            f"Checkpoint data {data:,} B, parity {parity:,} B: stored / data = "
            f"{(data + parity) / data:.4f} (exactly (k+m)/k = {(k + m) / k:.4f} before padding); "
            f"padding {padding:,.0f} B = {100 * padding / data:.2f} % of the checkpoint. "
            f"Other new files on the level (group descriptions, placement, manifests): "
            f"{disk['new'] - parity:,} B.",
            "",
        ]
        # Exactly (k+m)/k plus padding: the parity on disk is the groups' padded stripes
        # and nothing else.
        stripes = sum(d["stripe"] * d["parity"] for d in disk["groups"].values())
        goals.append(
            goal_line(
                parity == stripes and padding / data < PADDING_GOAL,
                "erasure storage (k+m)/k plus padding < 1 %",
                f"{(data + parity) / data:.4f} = {(k + m) / k:.4f} + {padding / data:.4f} padding "
                f"({100 * padding / data:.2f} %); parity on disk {parity:,} B, the groups' padded "
                f"stripes {stripes:,} B",
            )
        )
    return out


def report(
    sums: dict[str, Summary],
    coder: dict[str, list[float]],
    args: argparse.Namespace,
    state_bytes: int,
) -> tuple[str, list[str]]:
    """The tables (markdown) and the goal lines."""
    out: list[str] = []
    goals: list[str] = []
    if sums:
        out += ranks_tables(sums, args, state_bytes)
    out += erasure_storage(sums, goals)
    ks = f"RS({args.code_k}+{args.code_m})"
    out += [
        f"### The coder, one core ({ks}, {args.code_mb} MiB of the state's bytes, "
        f"{CHUNK >> 20} MiB chunks, medians of {args.code_repeat})",
        "",
        markdown_table(
            "entry | GB/s of member bytes | spread",
            [[name, fmt(median(v)), spread(v)] for name, v in coder.items()],
        ),
        "",
        f"Ours / zfec, paired by round (each round runs every entry once, so a ratio compares "
        f"measurements seconds apart): encode {times(paired(coder, 'encode'))}, decode "
        f"{times(paired(coder, 'decode'))} (medians over the rounds).",
        "",
    ]
    for s in sums.values():
        base = sums.get(s.config.baseline or "")
        if not base:
            continue
        ratio = median(s.blocked) / median(base.blocked)
        goals.append(
            goal_line(
                ratio <= BLOCKED_GOAL,
                f"{s.config.name}: blocked per save unchanged (<= 1.10x)",
                f"{fmt(median(s.blocked), 3)} s vs {fmt(median(base.blocked), 3)} s "
                f"({times(ratio)})",
            )
        )
        ratio = median(base.restore) / median(s.restore)
        goals.append(
            goal_line(
                ratio >= RESTORE_GOAL,
                f"{s.config.name}: restore >= 3x faster than remote only",
                f"{fmt(median(s.restore))} s vs {fmt(median(base.restore))} s ({times(ratio)})",
            )
        )
    ours, lib = median(coder[ENCODE_OURS]), median(coder[ENCODE_ZFEC])
    ratio = paired(coder, "encode")
    goals.append(
        goal_line(
            ratio >= ENCODE_GOAL,
            "encode >= zfec on the same bytes (within 5 %)",
            f"ours / zfec {times(ratio)} (median of the per-round ratios); medians "
            f"{fmt(ours)} vs {fmt(lib)} GB/s per core",
        )
    )
    if sums:
        failed = [e for s in sums.values() for e in s.exact if e != "bit-exact"]
        goals.append(goal_line(not failed, "every load bit-exact", "; ".join(failed) or "yes"))
    return "\n".join(out), goals

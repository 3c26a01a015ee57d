"""Delta checkpoints saved, loaded and drained for real, against full ones.

Per data set and gap (steps between two saves), a chain of ``--chain``
checkpoints (the first a keyframe) is saved three ways, alternating in every
round: **full** (bytegroup, every checkpoint whole), **keyframe** (each delta
against the chain's first checkpoint) and **previous** (each against the one
before). Each save is a real ``dcp.save`` through ``MultiLevelWriter`` (fsync
on, a fresh directory under ``--root``), each load a ``dcp.load`` of the
chain's newest checkpoint. Bytes are the checkpoint's files; "delta / full" is
the mean over the chain's deltas of their bytes over the full save of the same
state. Then the drain: a ``CheckpointManager`` whose first level is a plain
directory and whose second is the throttled remote (200 MB/s, as in
``bench_manager.py``) with bytegroup, with and without ``keyframe_every``:
each drain's seconds (``DrainResult.seconds``) for the chain's deltas (and,
for the delta modes, again with the same deltas on the first level, which the
drain then copies as they are), and a
``dcp.load`` of the newest checkpoint from the remote (through the throttle).

Data sets (``bench_delta.py`` makes them): ``minilm-w`` the real
all-MiniLM-L6-v2 weights under AdamW (lr 2e-5, synthetic gradients), fp32 and
bf16; ``minilm-ft`` the same weights fine-tuned for real (``_minilm.py``: the
encoder, sentence pairs of real text, sentence-transformers' loss, AdamW lr
2e-5; ~1.3 s per step here, so use short gaps), fp32 and bf16; ``demo`` the
demo MLP trained for real, weights and AdamW state (fp32).

    python benchmarks/bench_delta_io.py [--repeat 3] [--chain 4] [--gaps 1,10,100] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from _measure import median, rounds, spread, timed
from _remotes import ThrottledFileSystem  # noqa: F401 - registers throttled://
from _report import REPO, command, goal_line, markdown_table, print_header
from bench_delta import _part, demo_states, minilm_states
from dcp_multilevel import (
    CheckpointManager,
    Compression,
    Level,
    MultiLevelReader,
    MultiLevelWriter,
)

MODES = ("full", "keyframe", "previous", "raw-keyframe")
warnings.filterwarnings("ignore", message=".*assuming the intent is to")
#: Every save's and level's codec by default (``--threads`` sets its coding threads).
BYTEGROUP = Compression("bytegroup")


def data_sets(gaps: list[int], chain: int, sets: list[str]) -> dict[str, dict[int, list[dict]]]:
    """name -> gap -> the chain's states (``chain`` states ``gap`` steps apart)."""
    steps = max(gaps) * (chain - 1)
    wanted = {g: [g * i for i in range(chain)] for g in gaps}
    every = set().union(*wanted.values())
    out: dict[str, dict[int, list[dict]]] = {}

    def fp32_and_bf16(name: str, states: dict[int, dict]) -> None:
        out[f"{name} fp32"] = {g: [states[i] for i in idx] for g, idx in wanted.items()}
        out[f"{name} bf16"] = {
            g: [{k: v.to(torch.bfloat16) for k, v in states[i].items()} for i in idx]
            for g, idx in wanted.items()
        }

    if "minilm" in sets:
        states = {i: _part(s, "model.") for i, s in enumerate(minilm_states(steps)) if i in every}
        fp32_and_bf16("minilm-w", states)
    if "minilm-ft" in sets:
        from _minilm import finetune_states

        fp32_and_bf16(
            "minilm-ft", {i: s for i, s in enumerate(finetune_states(steps)) if i in every}
        )
    if "demo" in sets:
        states = {i: s for i, s in enumerate(demo_states(steps)) if i in every}
        out["demo all fp32"] = {g: [states[i] for i in idx] for g, idx in wanted.items()}
    return out


def _bytes(path: Path) -> int:
    return sum(json.loads((path / "manifest.json").read_text())["files"].values())


def save_chain(
    root: Path, chain: list[dict], mode: str, codec: Compression = BYTEGROUP
) -> tuple[list[float], list[int], float]:
    """Save ``chain`` below ``root`` as ``mode`` with ``codec``: (seconds per save, bytes
    per save, seconds to load the newest)."""
    seconds, sizes = [], []
    for i, state in enumerate(chain):
        ref = None
        if mode != "full" and i > 0:
            ref = root / ("step-0" if mode != "previous" else f"step-{i - 1}")
        # raw-keyframe: the keyframe stored uncoded, so deltas need no decoding of it
        this = None if mode == "raw-keyframe" and i == 0 else codec
        writer = MultiLevelWriter(root / f"step-{i}", codec=this, reference=ref)
        t, _ = timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))  # noqa: B023
        seconds.append(t)
        sizes.append(_bytes(root / f"step-{i}"))
    out = {k: torch.empty_like(v) for k, v in chain[-1].items()}
    newest = root / f"step-{len(chain) - 1}"
    load, _ = timed(lambda: dcp.load(out, storage_reader=MultiLevelReader(newest), no_dist=True))
    assert all(
        torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) for k, v in chain[-1].items()
    ), "load is not bit-exact"
    return seconds, sizes, load


def drain_chain(
    root: Path,
    chain: list[dict],
    mode: str,
    mbps: float,
    first_deltas: bool = False,
    codec: Compression = BYTEGROUP,
) -> tuple[list[float], float, list[float]]:
    """Drain seconds of each checkpoint of ``chain`` to the throttled remote (``mode``:
    full, or the remote level's ``delta_against``), seconds to load the newest
    back from there (the level that holds the deltas in the documented example), and
    seconds each ``mgr.save`` blocked (the first level's save; the drain runs after).
    ``first_deltas``: the first level stores the same deltas (the drain then copies
    them as they are, instead of coding them)."""
    kw = {} if mode == "full" else {"keyframe_every": len(chain), "delta_against": mode}
    remote = Level(f"throttled://{root}/remote", codec=codec, storage_options={"mbps": mbps}, **kw)
    first = Level(
        str(root / "l1"), keep=len(chain), **({"codec": codec, **kw} if first_deltas else {})
    )
    mgr = CheckpointManager([first, remote], drain_policy="wait")
    blocked = []
    for i, state in enumerate(chain):
        t, _ = timed(lambda: mgr.save(state, step=i))  # noqa: B023
        blocked.append(t)
        mgr.wait()
    seconds = [r.seconds for r in mgr.drain_results if r.committed]
    mgr.close()
    out = {k: torch.empty_like(v) for k, v in chain[-1].items()}
    reader = MultiLevelReader(
        f"throttled://{root}/remote/step-{len(chain) - 1}", storage_options={"mbps": mbps}
    )
    load, _ = timed(lambda: dcp.load(out, storage_reader=reader, no_dist=True))
    assert all(
        torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) for k, v in chain[-1].items()
    ), "remote load is not bit-exact"
    return seconds, load, blocked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="rounds over the three modes; 3")
    p.add_argument("--chain", type=int, default=4, help="checkpoints per chain; 4")
    p.add_argument("--gaps", default="1,10,100", help="steps between saves; 1,10,100")
    p.add_argument(
        "--sets", default="minilm,demo", help="any of minilm, minilm-ft, demo; minilm,demo"
    )
    p.add_argument("--root", type=Path, default=None, help="where to save (default: a temp dir)")
    p.add_argument("--remote-mbps", type=float, default=200.0, help="throttled remote; 200")
    p.add_argument(
        "--threads",
        type=int,
        default=BYTEGROUP.threads,
        help=f"coding threads per writer and drain; {BYTEGROUP.threads}",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    codec = Compression("bytegroup", threads=args.threads)
    gaps = [int(g) for g in args.gaps.split(",")]
    print_header(__file__, REPO)
    base = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=args.root))
    rows: list[dict] = []
    try:
        sets = data_sets(gaps, args.chain, args.sets.split(","))
        for name, by_gap in sets.items():
            for gap, chain in by_gap.items():
                got: dict[str, dict[str, list]] = {
                    m: {
                        "save": [],
                        "load": [],
                        "drain": [],
                        "remote_load": [],
                        "sizes": [],
                        "drain_verbatim": [],
                        "blocked": [],
                        "blocked_verbatim": [],
                    }
                    for m in MODES
                }
                for rep, mode in rounds(MODES, args.repeat):
                    root = base / f"{rep}-{mode}"
                    secs, sizes, load = save_chain(root, chain, mode, codec)
                    got[mode]["save"] += secs[1:]  # the deltas (the keyframe is a full save)
                    got[mode]["load"].append(load)
                    got[mode]["sizes"] = sizes
                    if gap == gaps[0] and mode != "raw-keyframe":
                        drains, remote_load, blocked = drain_chain(
                            root, chain, mode, args.remote_mbps, codec=codec
                        )
                        got[mode]["drain"] += drains[1:]
                        got[mode]["blocked"] += blocked[1:]
                        got[mode]["remote_load"].append(remote_load)
                        if mode != "full":  # the same deltas on the first level too
                            drains, _, blocked = drain_chain(
                                root / "verbatim", chain, mode, args.remote_mbps, True, codec
                            )
                            got[mode]["drain_verbatim"] += drains[1:]
                            got[mode]["blocked_verbatim"] += blocked[1:]
                    shutil.rmtree(root)
                full = got["full"]["sizes"]
                for mode in MODES:
                    g = got[mode]
                    ratio = sum(g["sizes"][1:]) / sum(full[1:])
                    rows.append(
                        {
                            "set": name,
                            "gap": gap,
                            "mode": mode,
                            "delta_over_full": ratio,
                            "stored_over_raw": sum(g["sizes"][1:])
                            / (len(chain) - 1)
                            / sum(t.numel() * t.element_size() for t in chain[0].values()),
                            "save_s": g["save"],
                            "load_s": g["load"],
                            "drain_s": g["drain"],
                            "remote_load_s": g["remote_load"],
                            "drain_verbatim_s": g["drain_verbatim"],
                            "blocked_s": g["blocked"],
                            "blocked_verbatim_s": g["blocked_verbatim"],
                        }
                    )
                print(f"  {name} gap {gap} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"\n### Chains of {args.chain} (a keyframe, then deltas), medians over the deltas\n")
    print(
        markdown_table(
            [
                "set",
                "gap",
                "mode",
                "stored / raw",
                "delta / full",
                "save s (spread)",
                "load newest s (spread)",
                "drain s (spread)",
                "load newest from remote s (spread)",
                "drain s, first level with the same deltas (spread)",
            ],
            [
                [
                    r["set"],
                    r["gap"],
                    r["mode"],
                    f"{r['stored_over_raw']:.3f}",
                    f"{r['delta_over_full']:.3f}",
                    f"{median(r['save_s']):.3f} ({spread(r['save_s'], 3)})",
                    f"{median(r['load_s']):.3f} ({spread(r['load_s'], 3)})",
                    f"{median(r['drain_s']):.3f} ({spread(r['drain_s'], 3)})"
                    if r["drain_s"]
                    else "-",
                    f"{median(r['remote_load_s']):.3f} ({spread(r['remote_load_s'], 3)})"
                    if r["remote_load_s"]
                    else "-",
                    f"{median(r['drain_verbatim_s']):.3f} ({spread(r['drain_verbatim_s'], 3)})"
                    if r["drain_verbatim_s"]
                    else "-",
                ]
                for r in rows
            ],
        )
    )
    print(
        "\n### A manager's save() with a first level and the remote (gap 1), blocked "
        "seconds per delta step\n"
    )
    print(
        markdown_table(
            [
                "set",
                "mode",
                "deltas on the remote level only (spread)",
                "deltas on both levels (spread)",
            ],
            [
                [
                    r["set"],
                    r["mode"],
                    f"{median(r['blocked_s']):.3f} ({spread(r['blocked_s'], 3)})",
                    f"{median(r['blocked_verbatim_s']):.3f} ({spread(r['blocked_verbatim_s'], 3)})"
                    if r["blocked_verbatim_s"]
                    else "-",
                ]
                for r in rows
                if r["blocked_s"]
            ],
        )
    )
    print("\n### Goals (gap 1)\n")
    for r in rows:
        if r["gap"] != gaps[0] or r["mode"] == "full":
            continue
        full = next(
            f for f in rows if f["set"] == r["set"] and f["gap"] == r["gap"] and f["mode"] == "full"
        )
        target = 0.15 if "bf16" in r["set"] else 0.45
        print(
            goal_line(
                r["delta_over_full"] <= target,
                f"{r['set']} {r['mode']} bytes",
                f"{r['delta_over_full']:.3f} of full (goal <= {target})",
            )
        )
        save = median(r["save_s"]) / median(full["save_s"])
        print(
            goal_line(
                save <= 1.0, f"{r['set']} {r['mode']} save time", f"{save:.2f}x full (goal <= 1)"
            )
        )
        if r["blocked_s"]:  # the documented example: deltas on the remote level, coded by the drain
            save = median(r["blocked_s"]) / median(full["blocked_s"])
            print(
                goal_line(
                    save <= 1.1,
                    f"{r['set']} {r['mode']} save time, deltas on the "
                    "remote level only (manager save() blocked)",
                    f"{save:.2f}x full (goal <= 1, within a 10 % noise band)",
                )
            )
        load = median(r["load_s"]) / median(full["load_s"])
        print(
            goal_line(
                load <= 1.5,
                f"{r['set']} {r['mode']} restore newest (local disk)",
                f"{load:.2f}x full (goal <= 1.5)",
            )
        )
        if r["remote_load_s"]:
            load = median(r["remote_load_s"]) / median(full["remote_load_s"])
            print(
                goal_line(
                    load <= 1.5,
                    f"{r['set']} {r['mode']} restore newest (remote)",
                    f"{load:.2f}x full (goal <= 1.5)",
                )
            )
        if r["drain_s"]:
            drain = median(r["drain_s"]) / median(full["drain_s"])
            ok = drain <= r["delta_over_full"] * 1.2 + 0.05
            detail = f"{drain:.2f}x full for {r['delta_over_full']:.2f}x the bytes"
            print(goal_line(ok, f"{r['set']} {r['mode']} drain", detail))
        if r["drain_verbatim_s"]:
            drain = median(r["drain_verbatim_s"]) / median(full["drain_s"])
            ok = drain <= r["delta_over_full"] * 1.2 + 0.05
            detail = (
                f"{drain:.2f}x full for {r['delta_over_full']:.2f}x the bytes (the first "
                "level stores the same deltas: copied as they are)"
            )
            print(goal_line(ok, f"{r['set']} {r['mode']} drain, deltas on both levels", detail))
    if args.json:
        args.json.write_text(json.dumps({"command": command(__file__), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

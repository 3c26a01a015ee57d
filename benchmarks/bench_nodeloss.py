"""Levels between nodes (issue 14): what partner copies and erasure parity cost per save,
and how fast they bring back a lost node, against a remote-only setup.

Four real ranks (spawned processes, gloo; ``tests/_dist.run_ranks``) on one
machine hold the same replicated state: BERT-large shapes with ``--scale`` of
the 24 encoder layers (3 by default: every tensor of the full model but 21
encoder layers; the embeddings and the untied MLM decoder alone are 0.26 GB)
plus AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, random values with a fixed
seed): 1.23 GB at the default scale. Simulated nodes are directories
(``DCP_ML_NODE`` per rank, ``{node}`` in the level paths); losing a node is
deleting its directory. Configurations, each its own set of levels:

* ``remote-2n``: ``[L1 n{node}/l1, remote]`` on 2 nodes (2 ranks each);
* ``partner-2n``: ``[L1, partner: replicas=2, remote]`` on 2 nodes;
* ``remote-4n``: ``[L1, remote]`` on 4 nodes (1 rank each);
* ``erasure-4n``: ``[L1, erasure: data=2 parity=1, remote]`` on 4 nodes (an
  erasure group and its parity need ``data + parity`` nodes: 2 groups of 2,
  each group's parity on a node of the other group).

Each remote-only configuration is the baseline of the node-local one in the
same topology. The remote is ``throttled:///<dir>`` (``_remotes.py``; in
/dev/shm by default): each simulated node reaches it through a link of its
own, ``--remote-mbps`` (200) MB/s per direction shared by the node's ranks.
Node-to-node transfers (the partner and erasure drains, restores) go over
gloo on loopback, unthrottled: the network between nodes is taken to be far
faster than the link to the remote. L1 and the node-local levels share the
scratch directory (``--root``, the disk; node-local levels hard-link the
first level's files, so they need the same file system). On a machine with
one disk every simulated node writes to it: this VM writes new files at about
400 MB/s, 100 MB/s per node of 4, half of each node's link to the remote,
where real nodes each have their own NVMe; ``--root /dev/shm/...`` gives the
nodes storage faster than their remote link (docs/benchmarks-log.md,
"Restore scheduling"; the nodes' files then live in memory, beside the ranks'). The node-local
levels keep 2 checkpoints, the remote 1, and L1 every save of a round (no L1
retention: with two ranks per node it races, each rank deleting the node's
same step directory).

The ranks run every configuration in turn, in an order rotated every round
(``--repeat`` rounds): the machine is noisy, so configurations alternate and
the tables show medians with their spread. The saves of a configuration, and
each restore, run in a process group of their own, as a new job would (two
managers in one process group would read each other's drain keys in its c10d
store: ``new_job``). Per configuration and round:

1. **Saves**: ``--saves`` times: nudge every tensor (so saves differ), all
   ranks start ``mgr.save`` together (``CheckpointManager(levels,
   drain_policy="wait")``); *blocked* = the ``save`` call, slowest rank; then
   a training step (``--step-seconds`` of sleep: four ranks share two cores,
   so no rank computes; the drains run meanwhile); then ``mgr.wait()``. Each
   manager's first save carries one-time costs (DCP's plan cache, first use of
   the gloo groups) and is left out of the medians. Per level and save:
   ``DrainResult.bytes_stored`` (new bytes this rank put on the level) and
   ``bytes_sent`` (bytes sent to
   other ranks) summed over ranks, drain seconds of the slowest rank. After
   the last save, the bytes on disk: the node-local level's files that are
   not hard links to L1 (partner copies; erasure parity blocks).
2. **Load, no node lost** (for reference): every file evicted from the page
   cache, a new job's manager on every rank calls ``load_latest`` into zeroed
   tensors; the slowest rank's ``load_latest``. The state is replicated, so
   every rank reads every byte: with a node-local L1 each node lacks the files
   the other nodes wrote, and a load brings them into its L1 first (from the
   node-local level or other nodes' L1 over gloo), or reads them from the
   remote (remote only). The tree is put back as it was after the saves
   (a hard-link snapshot) before:
3. **Restore after losing a node**: node ``--lose-node``'s directory (its L1,
   its node-local part, its spool) is deleted, the rest evicted, and the same
   timed ``load_latest`` (*restore*). With a node-local level, the lost
   node's files come from partner copies or erasure rebuilds over gloo;
   without, from the remote. Every rank checks that what it loaded (in 2 and
   3) is bit-exact.

Then, in this process on one thread (``torch.set_num_threads(1)``), the
coder on ``--code-mb`` MiB of the same state's bytes (split into ``data``
members, 4 MiB chunks, the entries alternating, medians of
``--code-repeat``): ``ErasureCode.encode_chunk`` / ``decode_chunk`` (what the
level's drain and rebuild call) against the library's own
``zfec.Encoder.encode`` / ``zfec.Decoder.decode`` on the same pieces, and
the drain's per-chunk work (encode plus an xxh3 checksum per parity chunk).
GB/s count member bytes per second on one core; ours / zfec is the median
of the per-round ratios (measurements seconds apart: this machine's speed
drifts by 1.5x within a minute).

``--state sharded`` gives each rank its own shard instead of the whole state
(every tensor flattened and cut in 4, rank ``r`` holding piece ``r`` under
``rank<r>.<name>``; the same bytes in all, a quarter per rank): each rank
saves and loads only its own file, so a load with no node lost copies
nothing, and a restore brings only the lost node's files. The restore table
gives the slowest rank's seconds in each phase (plan, bring, read), and
``--profile DIR`` writes a cProfile of each restore per rank.

``--state fsdp`` is the sharded state plus what sharded training also
saves: a value every rank holds, here AdamW's step count per parameter (a
0-dim tensor, as FSDP's optimizer state dicts hold it), which the balanced
planner spreads over the ranks' files. Every rank reads all of them, so
every node needs a few bytes of every other node's file. The configuration
``erasure-4n-whole`` is ``erasure-4n`` with restores that copy such files
whole (``restore_plan.PART_SHARE = 0`` in its ranks: the restore as it was
before partial copies), to compare in the same run.

Goals (issue 14): blocked time per save unchanged by adding the level
(within 10 %, this machine's noise); restore after one node loss at least 3x
faster than from the remote alone; erasure storage exactly (k+m)/k of the
checkpoint plus padding under 1 % of it; encode throughput at least that of
zfec itself on the same bytes (within 5 %).

    python benchmarks/bench_nodeloss.py --json /tmp/nodeloss.json   # ~9 min
    python benchmarks/bench_nodeloss.py --quick                     # tiny state, one round
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

# Measure this checkout's dcp_multilevel whatever is installed; tests/_dist.py runs the ranks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _remotes  # noqa: F401 - registers throttled:// with fsspec (in every rank too)
from _cli import add_json, add_seed, args_record, names, parser, quiet_dcp_warnings
from _data import (
    assert_state_equal,
    bert_adamw_state,
    bert_config,
    shard_state,
    zeros_like_state,
)
from _disk import evict_tree, remove_tree, scratch_dir, tree_files
from _measure import GB, median, rotated, rounds, spread
from _report import REPO, fmt, goal_line, machine_info, markdown_table, times
from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.format import checksum_of
from dcp_multilevel.levels.erasure_code import CHUNK, ErasureCode
from dcp_multilevel.restore import plan as restore_plan
from dcp_multilevel.restore.plan import PART_SHARE
from tests._dist import run_ranks

WORLD = 4
STATES = ("replicated", "sharded", "fsdp")
BLOCKED_GOAL = 1.10  # blocked with the level / without <= this (noise band)
RESTORE_GOAL = 3.0  # restore from the remote / with the level >= this
PADDING_GOAL = 0.01  # erasure padding / checkpoint bytes < this
ENCODE_GOAL = 0.95  # ours / zfec encode GB/s >= this (noise band)
ENCODE_OURS, ENCODE_ZFEC = "ours encode_chunk", "zfec Encoder.encode"
DECODE_OURS = "ours decode_chunk (one member lost)"
DECODE_ZFEC = "zfec Decoder.decode (one member lost)"


@dataclass(frozen=True)
class Config:
    name: str
    nodes: int
    kind: str | None  # the node-local level's kind, None: remote only
    options: dict[str, int] = field(default_factory=dict)
    baseline: str | None = None  # the remote-only config of the same topology
    whole_files: bool = False  # restores copy whole files, never parts (before partial copies)

    @property
    def label(self) -> str:
        what = f"{self.kind} " + " ".join(f"{k}={v}" for k, v in self.options.items())
        where = f"{self.nodes} nodes x {WORLD // self.nodes}"
        whole = ", whole files" if self.whole_files else ""
        return f"{what if self.kind else 'remote only'} ({where}{whole})"


CONFIGS = {
    c.name: c
    for c in (
        Config("remote-2n", 2, None),
        Config("partner-2n", 2, "partner", {"replicas": 2}, baseline="remote-2n"),
        Config("remote-4n", 4, None),
        Config("erasure-4n", 4, "erasure", {"data": 2, "parity": 1}, baseline="remote-4n"),
        Config(
            "erasure-4n-whole",
            4,
            "erasure",
            {"data": 2, "parity": 1},
            baseline="remote-4n",
            whole_files=True,
        ),
    )
}

#: The configurations run unless ``--configs`` names others.
DEFAULT_CONFIGS = ("remote-2n", "partner-2n", "remote-4n", "erasure-4n")


# --------------------------------------------------------------------------- on every rank


def levels_for(cfg: Config, base: Path, remote: str, node: int, args: dict) -> list[Level]:
    """L1 on the node's directory, the node-local level if any, the throttled remote."""
    remote_options = {
        "mbps": args["remote_mbps"],
        "link_dir": str(base / "links" / f"n{node}"),  # shared by this node's ranks
        "spool_dir": str(base / f"n{node}" / "spool"),
    }
    # L1 keeps every save of a round: with several ranks per node, first-level retention
    # has each of them delete the same step directory at once, and the race fails save().
    levels = [Level(f"{base}/n{{node}}/l1", keep=args["saves"])]
    if cfg.kind is not None:
        levels.append(Level(f"{cfg.kind}:{base}/n{{node}}/{cfg.kind}", keep=2, **cfg.options))
    levels.append(Level(remote, keep=1, storage_options=remote_options))
    return levels


def nudge(state: dict[str, torch.Tensor]) -> None:
    """A tiny in-place update of every tensor (the same on every rank when replicated)."""
    with torch.no_grad():
        for t in state.values():
            t.view(-1)[:256].add_(1e-3)


def level_name(url: str, cfg: Config) -> str:
    return "remote" if url.startswith("throttled") else str(cfg.kind)


def disk_bytes(cfg: Config, base: Path, step: int) -> dict[str, Any]:
    """What the last save occupies on disk, from the files (rank 0, before the loss)."""
    nodes = [base / f"n{n}" for n in range(cfg.nodes)]
    data = [p for n in nodes for p in tree_files(n / "l1" / f"step-{step}" / "data")]
    out: dict[str, Any] = {"data": sum(p.stat().st_size for p in data)}
    if cfg.kind is None:
        return out
    parts = [n / cfg.kind / f"step-{step}" for n in nodes]
    files = [p for part in parts for p in tree_files(part)]
    # New bytes: files that are not hard links to the first level's.
    out["new"] = sum(p.stat().st_size for p in files if p.stat().st_nlink == 1)
    out["linked"] = sum(p.stat().st_size for p in files if p.stat().st_nlink > 1)
    if cfg.kind == "erasure":
        out["parity"] = sum(
            p.stat().st_size for p in files if p.parent.name == "parity" and p.suffix == ".bin"
        )
        groups = {}
        for p in files:
            if p.name.startswith("group-") and p.suffix == ".json":
                desc = json.loads(p.read_text())
                sizes = [sum(s for _, s in m["files"]) for m in desc["members"]]
                groups[desc["group"]] = {
                    "members": sizes,
                    "stripe": desc["stripe"],
                    "data": desc["data"],
                    "parity": desc["parity"],
                }
        out["groups"] = groups
    return out


def new_job(rank: int, name: str, args: dict) -> None:
    """Replace the process group by a new one with a c10d store of its own (a new job).

    Two CheckpointManagers in one process group reuse each other's drain keys in
    its c10d store (the drain ids restart per manager) and read stale values, so
    each configuration's saves, and each restore, start a job of their own, as a
    restart after a node loss would.
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    store = dist.FileStore(str(Path(args["root"]) / "jobs" / name), WORLD)
    timeout = timedelta(seconds=args["timeout"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)


def run_config(
    rank: int, cfg: Config, rep: int, state: dict, dest: dict, args: dict
) -> dict[str, Any]:
    """One configuration, one round, on this rank: saves, then a restore after a node loss."""
    import torch.distributed as dist

    per_node = WORLD // cfg.nodes
    node = rank // per_node
    os.environ["DCP_ML_NODE"] = str(node)
    # The library's threshold for copying parts of a file; 0: always whole files.
    restore_plan.PART_SHARE = 0.0 if cfg.whole_files else PART_SHARE
    base = Path(args["root"]) / f"{cfg.name}-r{rep}"
    remote = f"throttled://{args['remote_dir']}/{cfg.name}-r{rep}"
    levels = levels_for(cfg, base, remote, node, args)
    record: dict[str, Any] = {"config": cfg.name, "round": rep, "rank": rank, "node": node}
    new_job(rank, f"{cfg.name}-r{rep}-saves", args)
    mgr = CheckpointManager(levels, drain_policy="wait")
    saves = []
    for step in range(1, args["saves"] + 1):
        nudge(state)
        dist.barrier()
        t0 = time.perf_counter()
        metrics = mgr.save(state, step=step)
        call = time.perf_counter() - t0
        time.sleep(args["step_seconds"])
        t1 = time.perf_counter()
        mgr.wait()
        tail = time.perf_counter() - t1
        drains = {}
        for r in mgr.drain_results:
            if r.step == step:
                drains[level_name(r.level, cfg)] = {
                    "stored": r.bytes_stored, "sent": r.details.get("bytes_sent", 0),
                    "linked": r.details.get("bytes_linked", 0), "seconds": r.seconds,
                    "lag": r.lag_seconds, "committed": r.committed, "skipped": r.skipped,
                }  # fmt: skip
        saves.append({"step": step, "call_s": call, "l1_s": metrics.blocked_seconds,
                      "waited_s": metrics.waited_seconds, "l1_bytes": metrics.bytes_written,
                      "tail_s": tail, "drains": drains})  # fmt: skip
    mgr.close()
    record["saves"] = saves
    snap = Path(f"{base}-snap")
    if rank == 0:
        record["disk"] = disk_bytes(cfg, base, args["saves"])
        # A load brings every file each node lacks into its L1: keep the tree as it was
        # after the saves (hard links: the stores never rewrite a file in place).
        shutil.copytree(base, snap, copy_function=os.link)
        evict_tree(base)
    record["load"] = timed_load(rank, f"{cfg.name}-r{rep}-load", levels, state, dest, args)
    if rank == 0:
        remove_tree(base)
        snap.rename(base)
        remove_tree(base / f"n{args['lose_node']}")  # the node is lost with its disk
        evict_tree(base)  # the survivors' files: read from the disk, not the page cache
    record["restore"] = timed_load(rank, f"{cfg.name}-r{rep}-restore", levels, state, dest, args)
    dist.barrier()
    if rank == 0:
        remove_tree(base)
        shutil.rmtree(f"{args['remote_dir']}/{cfg.name}-r{rep}", ignore_errors=True)
    dist.barrier()
    return record


def load_phases(records: list[dict[str, Any]]) -> dict[str, float]:
    """The phases of the load a manager reported (its ``"load"`` metrics record):
    ``plan``: agreeing on the step and planning the restore (listings, manifest,
    the load planner's dry run, inventories, collectives); ``bring``: the copies,
    links and rebuilds; ``read``: ``dcp.load`` through the levels."""
    (load,) = [r for r in records if r["kind"] == "load"]
    return {k[: -len("_seconds")]: v for k, v in load.items() if k.endswith("_seconds")}


def timed_load(
    rank: int, job: str, levels: list[Level], state: dict, dest: dict, args: dict
) -> dict[str, Any]:
    """A new job's ``load_latest`` into zeroed tensors: seconds, where from, bit-exact?"""
    import torch.distributed as dist

    dist.barrier()  # rank 0's file work is done
    new_job(rank, job, args)
    records: list[dict[str, Any]] = []
    mgr = CheckpointManager(levels, on_metrics=records.append)
    for t in dest.values():
        t.zero_()
    dist.barrier()
    profile = None
    if args["profile"] and job.endswith("-restore"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    step = mgr.load_latest(dest)
    load_s = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
        profile.dump_stats(str(Path(args["profile"]) / f"{job}-rank{rank}.prof"))
    mgr.close()
    try:
        if step != args["saves"]:
            raise AssertionError(f"load_latest returned step {step}, expected {args['saves']}")
        assert_state_equal(state, dest)
        exact = "bit-exact"
    except AssertionError as e:
        exact = f"FAILED: {e}"
    report = mgr.last_restore
    return {
        "load_s": load_s, "restore_s": report.seconds if report else 0.0, "exact": exact,
        "received": dict(report.received) if report else {},
        "sources": dict(mgr.last_load_sources), "phases": load_phases(records),
    }  # fmt: skip


def rank_main(rank: int, world: int, args: dict) -> list[dict[str, Any]]:
    """Every configuration, ``repeat`` rounds, on this rank (run by ``run_ranks``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Without a node-local level, every load reads the files other nodes wrote from the
    # remote, and the reader warns once per file and rank: expected here.
    logging.getLogger("dcp_multilevel.reader").setLevel(logging.ERROR)
    quiet_dcp_warnings()
    cfg = bert_config(args["scale"], tiny=args["quick"])
    state = bert_adamw_state(cfg, seed=args["seed"])
    if args["state"] in ("sharded", "fsdp"):
        steps = [name for name in state if name.startswith("model.")]
        state = shard_state(state, rank, world)  # the full state is dropped here
        if args["state"] == "fsdp":  # AdamW's step count per parameter, on every rank
            state.update({f"optim.step.{n[6:]}": torch.tensor(1000.0) for n in steps})
    dest = zeros_like_state(state)
    configs = [CONFIGS[name] for name in args["configs"]]
    out = []
    for rep, config in rounds(configs, args["repeat"]):
        out.append(run_config(rank, config, rep, state, dest, args))
        if rank == 0:
            print(f"  round {rep + 1}: {config.name} done", flush=True)
    return out


# --------------------------------------------------------------------------- the coder


def code_members(nbytes: int, data: int, args: argparse.Namespace) -> list[memoryview]:
    """``data`` equal members of the first ``nbytes`` (whole chunks) of the benchmark state."""
    state = bert_adamw_state(bert_config(args.scale, tiny=args.quick), seed=args.seed)
    per = max(CHUNK, nbytes // data // CHUNK * CHUNK)
    pieces, have = [], 0
    for t in state.values():
        pieces.append(t.reshape(-1).view(torch.uint8))
        have += t.nbytes
        if have >= per * data:
            break
    flat = torch.cat(pieces)
    if len(flat) < per * data:  # a tiny state: repeat it
        flat = flat.repeat(-(-per * data // len(flat)))
    raw = flat[: per * data].numpy().tobytes()
    return [memoryview(raw)[i * per : (i + 1) * per] for i in range(data)]


def measure_coder(data: int, parity: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """GB/s (member bytes per second, one thread) of each coder entry, per repeat."""
    import zfec

    members = code_members(args.code_mb << 20, data, args)
    n = len(members[0]) // CHUNK
    chunks = [[m[i * CHUNK : (i + 1) * CHUNK] for m in members] for i in range(n)]
    code = ErasureCode(data, parity)
    wanted = tuple(range(data, data + parity))
    encoder, decoder = zfec.Encoder(data, data + parity), zfec.Decoder(data, data + parity)
    parities = [code.encode_chunk(pieces) for pieces in chunks]
    # A rebuild of member 0: the other members and the first parity block.
    blocks = (*range(1, data), data)
    survivors = [(*pieces[1:], par[0]) for pieces, par in zip(chunks, parities, strict=True)]
    expected = [bytes(p[0]) for p in chunks[:2]]

    def ours_encode() -> None:
        for pieces in chunks:
            code.encode_chunk(pieces)

    def zfec_encode() -> None:
        for pieces in chunks:
            encoder.encode(tuple(pieces), wanted)

    def ours_drain() -> None:
        for pieces in chunks:
            for p in code.encode_chunk(pieces):
                checksum_of(p)

    def ours_decode() -> None:
        for pieces in survivors:
            code.decode_chunk(pieces, blocks)

    def zfec_decode() -> None:
        for pieces in survivors:
            decoder.decode(tuple(pieces), blocks)

    for i, pieces in enumerate(survivors[:2]):
        if code.decode_chunk(pieces, blocks)[0] != expected[i]:
            raise AssertionError("decode_chunk did not give back member 0")
    entries = [
        (ENCODE_OURS, ours_encode), (ENCODE_ZFEC, zfec_encode),
        ("ours encode_chunk + xxh3 per parity chunk (drain)", ours_drain),
        (DECODE_OURS, ours_decode), (DECODE_ZFEC, zfec_decode),
    ]  # fmt: skip
    total = data * n * CHUNK
    out: dict[str, list[float]] = {name: [] for name, _ in entries}
    for _, (name, fn) in rounds(entries, args.code_repeat):
        t0 = time.perf_counter()
        fn()
        out[name].append(total / GB / (time.perf_counter() - t0))
    return out


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
    received = next((r["restore"]["received"] for r in restores.get(last, [])
                     if r["rank"] == lost_rank), {})  # fmt: skip
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


def ranks_tables(sums: dict[str, Summary], args: argparse.Namespace, state_bytes: int
                 ) -> list[str]:  # fmt: skip
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
        rows.append([
            s.config.label,
            f"{fmt(median(s.blocked), 3)} [{spread(s.blocked, 3)}]",
            times(median(s.blocked) / median(base.blocked)) if base else "-",
            fmt(median(s.l1), 3),
            f"{gb(median(s.stored[kind]))} / {gb(median(s.sent[kind]))}" if kind else "-",
            f"{fmt(median(s.drain_s[kind]))} [{spread(s.drain_s[kind])}]" if kind else "-",
            gb(median(s.stored["remote"])),
            f"{fmt(median(s.drain_s['remote']))} [{spread(s.drain_s['remote'])}]",
            fmt(median(s.tail)),
        ])  # fmt: skip
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
        rows.append([
            s.config.label, f"{fmt(median(s.restore))} [{spread(s.restore)}]",
            fmt(median(s.restore_part)) if s.config.kind else "-",
            " / ".join(fmt(median(s.phases.get(k, [0.0]))) for k in ("plan", "bring", "read")),
            times(median(base.restore) / median(s.restore)) if base else "-",
            f"{fmt(median(s.load))} [{spread(s.load)}]",
            "; ".join(s.exact), got or "the remote (read per file by the loading ranks)",
        ])  # fmt: skip
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
            [g, " + ".join(f"{x:,}" for x in d["members"]), f"{d['stripe']:,}",
             f"{d['stripe'] * d['parity']:,}"]
            for g, d in sorted(disk["groups"].items())
        ]  # fmt: skip
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
        goals.append(goal_line(
            parity == stripes and padding / data < PADDING_GOAL,
            "erasure storage (k+m)/k plus padding < 1 %",
            f"{(data + parity) / data:.4f} = {(k + m) / k:.4f} + {padding / data:.4f} padding "
            f"({100 * padding / data:.2f} %); parity on disk {parity:,} B, the groups' padded "
            f"stripes {stripes:,} B",
        ))  # fmt: skip
    return out


def report(sums: dict[str, Summary], coder: dict[str, list[float]], args: argparse.Namespace,
           state_bytes: int) -> tuple[str, list[str]]:  # fmt: skip
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
        goals.append(goal_line(
            ratio <= BLOCKED_GOAL, f"{s.config.name}: blocked per save unchanged (<= 1.10x)",
            f"{fmt(median(s.blocked), 3)} s vs {fmt(median(base.blocked), 3)} s "
            f"({times(ratio)})",
        ))  # fmt: skip
        ratio = median(base.restore) / median(s.restore)
        goals.append(goal_line(
            ratio >= RESTORE_GOAL, f"{s.config.name}: restore >= 3x faster than remote only",
            f"{fmt(median(s.restore))} s vs {fmt(median(base.restore))} s ({times(ratio)})",
        ))  # fmt: skip
    ours, lib = median(coder[ENCODE_OURS]), median(coder[ENCODE_ZFEC])
    ratio = paired(coder, "encode")
    goals.append(goal_line(
        ratio >= ENCODE_GOAL, "encode >= zfec on the same bytes (within 5 %)",
        f"ours / zfec {times(ratio)} (median of the per-round ratios); medians "
        f"{fmt(ours)} vs {fmt(lib)} GB/s per core",
    ))  # fmt: skip
    if sums:
        failed = [e for s in sums.values() for e in s.exact if e != "bit-exact"]
        goals.append(goal_line(not failed, "every load bit-exact", "; ".join(failed) or "yes"))
    return "\n".join(out), goals


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    # fmt: off
    p.add_argument("--scale", type=float, default=0.125,
                   help="fraction of the 24 BERT layers; 0.125 (3 layers: 1.23 GB with AdamW)")
    p.add_argument("--state", choices=STATES, default="replicated",
                   help="replicated: every rank holds (and loads) the whole state; sharded: "
                   "each rank a quarter of every tensor under keys of its own "
                   "(rank<r>.<name>), saved and loaded by it alone; fsdp: sharded plus "
                   "AdamW's step count per parameter on every rank; replicated")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"subset of: {', '.join(CONFIGS)}; '' for the coder alone; "
                   f"default: {','.join(DEFAULT_CONFIGS)}")
    p.add_argument("--repeat", type=int, default=3, help="rounds over the configs; 3")
    p.add_argument("--saves", type=int, default=3,
                   help="saves per config and round (the first is not counted); 3")
    p.add_argument("--step-seconds", type=float, default=2.0,
                   help="training step (sleep) after each save; 2.0")
    p.add_argument("--lose-node", type=int, default=1, help="the node lost before the restore; 1")
    p.add_argument("--remote-mbps", type=float, default=200.0,
                   help="each node's link to the throttled remote, MB/s per direction; 200")
    p.add_argument("--root", type=Path, default=None,
                   help="scratch directory for L1 and the node-local levels (default: a new "
                   "temporary directory under bench_out/, removed afterwards)")
    p.add_argument("--remote-dir", type=Path, default=None,
                   help="where the throttled remote keeps its objects (default: a new "
                   "directory in /dev/shm if there is one, else under --root)")
    p.add_argument("--code-mb", type=int, default=256, help="MiB coded per coder entry; 256")
    p.add_argument("--code-repeat", type=int, default=9, help="coder measurements (median); 9")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the ranks' whole run (and their collective timeout)")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a cProfile of every restore's load_latest, per rank, into "
                   "this directory (<config>-r<round>-restore-rank<r>.prof; pstats reads "
                   "them); adds a little time to the restores")
    add_seed(p)
    add_json(p)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny BERT, one round, 2 saves, 0.3 s steps, 16 MiB coded")
    # fmt: on
    args = p.parse_args(argv)
    args.configs = names(p, args.configs, list(CONFIGS), "config")
    if args.quick:
        args.repeat, args.saves, args.step_seconds = 1, 2, 0.3
        args.code_mb, args.code_repeat = 16, 3
    if args.repeat < 1 or args.saves < 2 or args.scale <= 0 or args.remote_mbps <= 0:
        p.error("--repeat must be >= 1, --saves >= 2, --scale and --remote-mbps > 0")
    nodes = {CONFIGS[c].nodes for c in args.configs} or {WORLD}
    if not 0 <= args.lose_node < min(nodes):
        p.error(f"--lose-node must name a node of every config (0 to {min(nodes) - 1})")
    erasure = CONFIGS["erasure-4n"].options
    args.code_k, args.code_m = erasure["data"], erasure["parity"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    quiet_dcp_warnings()
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    cfg = bert_config(args.scale, tiny=args.quick)
    shm = Path("/dev/shm")
    shm_ok = args.remote_dir is None and shm.is_dir() and os.access(shm, os.W_OK)
    with contextlib.ExitStack() as stack:
        (REPO / "bench_out").mkdir(exist_ok=True)
        root = stack.enter_context(
            scratch_dir(args.root, "bench-nodeloss-", parent=REPO / "bench_out")
        )
        info = machine_info(root)
        (root / "jobs").mkdir(exist_ok=True)  # the c10d stores of new_job
        remote_dir = args.remote_dir or root / "remote"
        if shm_ok:
            remote_dir = stack.enter_context(scratch_dir(None, "bench-nodeloss-remote-",
                                                         parent=shm))  # fmt: skip
        order = [c for r in range(args.repeat) for c in rotated(args.configs, r)]
        print(f"{WORLD} ranks, {cfg.num_hidden_layers} BERT layers + AdamW; order: {order}",
              flush=True)  # fmt: skip
        payload = {
            "root": str(root), "remote_dir": str(remote_dir), "scale": args.scale,
            "quick": args.quick, "seed": args.seed, "configs": args.configs,
            "repeat": args.repeat, "saves": args.saves, "step_seconds": args.step_seconds,
            "lose_node": args.lose_node, "remote_mbps": args.remote_mbps,
            "timeout": args.timeout, "state": args.state,
            "profile": str(args.profile) if args.profile else None,
        }  # fmt: skip
        t0 = time.perf_counter()
        per_rank = run_ranks(rank_main, WORLD, payload, timeout=args.timeout) if order else []
        ranks_s = time.perf_counter() - t0
    load_ranks = os.getloadavg()
    records = [r for rank in per_rank for r in rank]

    torch.set_num_threads(1)
    coder = measure_coder(args.code_k, args.code_m, args)
    load_after = os.getloadavg()

    state_bytes = sum(
        s["l1_bytes"]
        for r in records
        for s in r["saves"]
        if r["config"] == args.configs[0] and r["round"] == 0 and s["step"] == 1
    )
    sums = {c: summarize(records, CONFIGS[c], args.lose_node) for c in args.configs}
    body, goals = report(sums, coder, args, state_bytes)
    print()
    print("## Node loss: partner and erasure levels against the remote alone")
    print()
    for k, v in info.items():
        print(f"- {k}: {v}")
    held = (
        f"replicated on {WORLD} ranks" if args.state == "replicated" else
        f"sharded over {WORLD} ranks (each a 1/{WORLD} of every tensor, keys of its own)"
        + (", plus AdamW's step count per parameter (0-dim, on every rank)"
           if args.state == "fsdp" else "")
    )  # fmt: skip
    print(
        f"- state: BertForPreTraining shapes, {cfg.num_hidden_layers} of 24 encoder layers, "
        f"+ AdamW exp_avg and exp_avg_sq, fp32, {state_bytes / GB:.3f} GB, {held}"
        + (" (tiny config, --quick)" if args.quick else f" (--scale {args.scale})")
    )
    print(f"- remote: throttled, {args.remote_mbps:g} MB/s per node and direction, objects in "
          f"{remote_dir}; L1 and node-local levels in {root}")  # fmt: skip
    loads = [load_before, load_ranks, load_after]
    total = time.perf_counter() - t_start
    print(
        "- load average (1/5/15 min) before / after the ranks / after the coder: "
        + " | ".join(" / ".join(f"{x:.2f}" for x in la) for la in loads)
        + f"; ranks {ranks_s:.0f} s, total runtime {total:.0f} s"
    )
    print()
    print(body)
    print("### Goals")
    print()
    print("\n".join(goals))
    if args.json:
        args.json.write_text(json.dumps({
            "args": args_record(args),
            "machine": info, "load": {"before": load_before, "after_ranks": load_ranks,
                                      "after": load_after},
            "records": records, "coder": coder,
        }, indent=1))  # fmt: skip
    return 0 if all(e == "bit-exact" for s in sums.values() for e in s.exact) else 1


if __name__ == "__main__":
    raise SystemExit(main())

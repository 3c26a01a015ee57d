"""``bench_nodeloss.py``'s configurations and what every rank runs (and the coder's
one-core measurement): the jobs behind its tables. See that script's docstring."""

from __future__ import annotations

import argparse
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
from _cli import quiet_dcp_warnings
from _data import (
    assert_state_equal,
    bert_adamw_state,
    bert_config,
    shard_state,
    zeros_like_state,
)
from _disk import evict_tree, remove_tree, tree_files
from _measure import GB, rounds
from dcp_multilevel import CheckpointManager, Level
from dcp_multilevel.format import checksum_of
from dcp_multilevel.levels.erasure_code import CHUNK, ErasureCode

WORLD = 4
STATES = ("replicated", "sharded", "fsdp")
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
                    "stored": r.bytes_stored,
                    "sent": r.details.get("bytes_sent", 0),
                    "linked": r.details.get("bytes_linked", 0),
                    "seconds": r.seconds,
                    "lag": r.lag_seconds,
                    "committed": r.committed,
                    "skipped": r.skipped,
                }
        saves.append(
            {
                "step": step,
                "call_s": call,
                "l1_s": metrics.blocked_seconds,
                "waited_s": metrics.waited_seconds,
                "l1_bytes": metrics.bytes_written,
                "tail_s": tail,
                "drains": drains,
            }
        )
    mgr.close()
    record["saves"] = saves
    snap = Path(f"{base}-snap")
    if rank == 0:
        record["disk"] = disk_bytes(cfg, base, args["saves"])
        # A load brings every file each node lacks into its L1: keep the tree as it was
        # after the saves (hard links: the stores never rewrite a file in place).
        shutil.copytree(base, snap, copy_function=os.link)
        evict_tree(base)
    whole = cfg.whole_files
    record["load"] = timed_load(rank, f"{cfg.name}-r{rep}-load", levels, state, dest, args, whole)
    if rank == 0:
        remove_tree(base)
        snap.rename(base)
        remove_tree(base / f"n{args['lose_node']}")  # the node is lost with its disk
        evict_tree(base)  # the survivors' files: read from the disk, not the page cache
    record["restore"] = timed_load(
        rank, f"{cfg.name}-r{rep}-restore", levels, state, dest, args, whole
    )
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
    rank: int, job: str, levels: list[Level], state: dict, dest: dict, args: dict, whole: bool
) -> dict[str, Any]:
    """A new job's ``load_latest`` into zeroed tensors: seconds, where from, bit-exact?
    ``whole``: restores bring whole files (``restore_whole_files``)."""
    import torch.distributed as dist

    dist.barrier()  # rank 0's file work is done
    new_job(rank, job, args)
    records: list[dict[str, Any]] = []
    mgr = CheckpointManager(levels, on_metrics=records.append, restore_whole_files=whole)
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
        "load_s": load_s,
        "restore_s": report.seconds if report else 0.0,
        "exact": exact,
        "received": dict(report.received) if report else {},
        "sources": dict(mgr.last_load_sources),
        "phases": load_phases(records),
    }


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
        (ENCODE_OURS, ours_encode),
        (ENCODE_ZFEC, zfec_encode),
        ("ours encode_chunk + xxh3 per parity chunk (drain)", ours_drain),
        (DECODE_OURS, ours_decode),
        (DECODE_ZFEC, zfec_decode),
    ]
    total = data * n * CHUNK
    out: dict[str, list[float]] = {name: [] for name, _ in entries}
    for _, (name, fn) in rounds(entries, args.code_repeat):
        t0 = time.perf_counter()
        fn()
        out[name].append(total / GB / (time.perf_counter() - t0))
    return out

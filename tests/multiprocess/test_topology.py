"""Topology: which node each rank is on, copies always on other nodes, ``{node}`` paths."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _required import require
from conftest import assert_bit_equal
from hypothesis import given
from hypothesis import strategies as st

from dcp_multilevel import CheckpointManager, ConfigError, Level
from dcp_multilevel.levels.topology import Topology, expand_node, node_from_env


@pytest.mark.parametrize(
    ("env", "node"),
    [
        ({}, 0),
        ({"RANK": "5", "LOCAL_WORLD_SIZE": "2"}, 2),
        ({"NODE_RANK": "3", "RANK": "5", "LOCAL_WORLD_SIZE": "2"}, 3),
        ({"GROUP_RANK": "1", "NODE_RANK": "3"}, 1),
        ({"DCP_ML_NODE": "7", "GROUP_RANK": "1"}, 7),
        ({"DCP_ML_NODE": "", "GROUP_RANK": "4"}, 4),
        ({"NODE_RANK": "2"}, 2),
        ({"GROUP_RANK": "1", "RANK": "7", "LOCAL_WORLD_SIZE": "2"}, 1),
        (
            {
                "DCP_ML_NODE": "0",
                "GROUP_RANK": "1",
                "NODE_RANK": "2",
                "RANK": "7",
                "LOCAL_WORLD_SIZE": "2",
            },
            0,
        ),
        ({"RANK": "7"}, 0),
    ],
)
def test_node_from_env_precedence(env, node):
    assert node_from_env(env) == node


def test_node_from_the_process_environment(monkeypatch):
    for name in ("DCP_ML_NODE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "3")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_from_env() == 3
    monkeypatch.delenv("NODE_RANK")
    assert node_from_env() == 2
    monkeypatch.setenv("DCP_ML_NODE", "5")
    assert node_from_env() == 5


#: The rule of node_from_env, as every place that documents a default topology states it.
_NODE_RULE = re.compile(
    r"`DCP_ML_NODE`.{0,40}, else (torchrun's )?`GROUP_RANK`, else `NODE_RANK`, else "
    r"`RANK // LOCAL_WORLD_SIZE`, else node 0"
)


#: A node rule that falls back on the host name (never what the code does).
_HOST_NAME_RULE = re.compile(r"DCP_ML_NODE[^.|]{0,120}host name")


def _documented_topology(where: str) -> str:
    """The text of ``where``: a file below the repository, or a class's docstring."""
    if where.endswith(".md"):
        return (Path(__file__).resolve().parents[2] / where).read_text()
    if where == "MultiLevelAccelerator":
        accelerate = require("dcp_multilevel.integrations.accelerate")
        return accelerate.MultiLevelAccelerator.__doc__ or ""
    import dcp_multilevel

    return getattr(dcp_multilevel, where).__doc__ or ""


@pytest.mark.parametrize(
    "where",
    [
        "docs/levels.md",
        "docs/writer-reader.md",
        "docs/integrations.md",
        "CheckpointManager",
        "MultiLevelReader",
        "MultiLevelAccelerator",
    ],
)
def test_every_default_topology_is_documented_by_the_one_rule(where):
    flat = " ".join(_documented_topology(where).replace("``", "`").split())
    assert _NODE_RULE.search(flat), where
    assert not _HOST_NAME_RULE.search(flat), where


def test_a_bad_node_variable_is_named():
    with pytest.raises(ConfigError) as info:
        node_from_env({"DCP_ML_NODE": "a"})
    assert str(info.value) == (
        "environment variable DCP_ML_NODE='a' must be a non-negative integer (the index of "
        "this process's node)"
    )


def test_uniform_and_queries():
    topo = Topology.uniform(6, 2)
    assert topo.nodes == (0, 0, 1, 1, 2, 2)
    assert topo.node_ids == (0, 1, 2) and topo.ranks_on(1) == (2, 3)
    assert [topo.local_index(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert topo.partners(1, replicas=2) == (3,)
    assert topo.partners(5, replicas=3) == (1, 3)  # wraps around the ring of nodes
    assert topo.partners(0, replicas=2, jump=2) == (4,)
    assert topo.holders(3, replicas=2) == (1,)


def test_a_copy_on_the_same_node_is_refused():
    with pytest.raises(ConfigError) as info:
        Topology.uniform(4, 4).partners(0, replicas=2)
    assert str(info.value) == (
        "replicas=2 needs 2 nodes (each copy on another node than its source; a copy on the "
        "same node is lost with it), but the ranks are on 1 node(s) [0]. Lower replicas, or "
        "run on more nodes (set DCP_ML_NODE per process to simulate nodes on one machine)."
    )
    with pytest.raises(ConfigError) as info:
        Topology.uniform(8, 2).partners(0, replicas=3, jump=2)
    assert str(info.value) == (
        "jump=2 places copies on the same node as their source or as each other with 4 nodes "
        "and replicas=3 (node offsets [0, 2, 0]); choose a jump coprime with 4, or one with "
        "(replicas - 1) * jump < 4"
    )


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=16),
    st.integers(1, 4),
    st.integers(1, 5),
)
def test_partners_are_distinct_ranks_on_other_nodes(nodes, replicas, jump):
    topo = Topology(tuple(nodes))
    count = len(topo.node_ids)
    offsets = {(i * jump) % count for i in range(replicas)}
    if replicas > count or len(offsets) < replicas:
        with pytest.raises(ConfigError):
            topo.partners(0, replicas, jump)
        return
    for rank in range(topo.world_size):
        partners = topo.partners(rank, replicas, jump)
        assert len(partners) == replicas - 1
        homes = [topo.nodes[p] for p in partners]
        assert topo.nodes[rank] not in homes
        assert len(set(homes)) == len(homes)  # no two copies on one node
        for p in partners:
            assert rank in topo.holders(p, replicas, jump)


def test_expand_node_replaces_only_the_placeholder():
    assert expand_node("/nvme/{node}/run", 3) == "/nvme/3/run"
    assert expand_node("/nvme/{other}/run", 3) == "/nvme/{other}/run"


def _state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(128, 128, generator=g), "step": v}


def _node_paths_job(rank: int, world: int, root: str) -> str:
    import os

    os.environ["DCP_ML_NODE"] = str(10 + rank)  # node labels need not start at 0
    levels = [Level(f"{root}/node{{node}}/l1"), Level(f"{root}/remote")]
    mgr = CheckpointManager(levels, drain_policy="wait")
    assert mgr.topology == Topology((10, 11))
    mgr.save(_state(1), step=1)
    mgr.wait()
    mgr.close()
    return mgr.levels[0].url


@pytest.mark.multiprocess
def test_node_paths_give_each_simulated_node_its_own_first_level(tmp_path):
    urls = run_ranks(_node_paths_job, 2, str(tmp_path), timeout=180)
    assert urls == [f"{tmp_path}/node10/l1", f"{tmp_path}/node11/l1"]
    for rank in range(2):
        files = [p.name for p in (Path(urls[rank]) / "step-1" / "data").iterdir()]
        assert files and all(name.startswith(f"{rank}-") for name in files)
    # Only rank 0's node holds the first level's manifest; the remote holds everything.
    assert (Path(urls[0]) / "step-1" / "manifest.json").exists()
    assert not (Path(urls[1]) / "step-1" / "manifest.json").exists()
    loaded = {"w": torch.zeros(128, 128), "step": -1}
    single = CheckpointManager([Level(f"{tmp_path}/remote")])
    assert single.load_latest(loaded) == 1
    assert_bit_equal(loaded["w"], _state(1)["w"], "w")


def test_a_topology_for_another_world_size_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        CheckpointManager([Level(str(tmp_path))], topology=Topology.uniform(4, 2))
    assert str(info.value) == "the topology names 4 ranks, the process group has 1"

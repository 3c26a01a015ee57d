"""A level kind from outside the package is one file plus an entry point.

``mirror3:`` keeps every rank's files on its own node and the next
``copies - 1`` along the ring of nodes (an option of its own:
``Level("mirror3:...", options={"copies": 3})``), so any two lost nodes
leave a copy. It lives in a
module of its own, installed as a fake third-party distribution that
registers it in the ``dcp_multilevel.levels`` entry-point group; nothing
under ``dcp_multilevel/`` names it. It passes the shipped level suite
(drains, retention, a restore after a lost node) and survives two lost
nodes.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import dcp_multilevel
from dcp_multilevel import Level
from dcp_multilevel.errors import ConfigError
from dcp_multilevel.levels import LEVEL_KINDS, driver_for
from dcp_multilevel.testing import LevelTests, run_ranks
from dcp_multilevel.testing.levels import STEPS, _load_job, _save_job

pytestmark = pytest.mark.multiprocess

#: Where the fake distribution is, for the ranks' processes (sent with the environment).
PLUGIN_ENV = "DCP_ML_TEST_MIRROR3_PATH"

MIRROR3 = textwrap.dedent(
    '''
    """mirror3: each rank's files on its node and the next two nodes (a plugin module)."""

    from dcp_multilevel.errors import ConfigError, DrainError
    from dcp_multilevel.format import rank_files
    from dcp_multilevel.levels.node_level import NodeLevel
    from dcp_multilevel.levels.wire import recv_file, send_file


    class Mirror3Level(NodeLevel):
        kind = "mirror3"
        options = ("copies",)  # Level("mirror3:...", options={"copies": 3})

        def __init__(self, level):
            super().__init__(level)
            self.copies = level.options.get("copies", 3)
            if not isinstance(self.copies, int) or self.copies < 2:
                raise ConfigError(f"level {level.url!r}: copies must be an integer >= 2")

        def check_topology(self, topology):
            super().check_topology(topology)
            for rank in range(topology.world_size):
                topology.partners(rank, self.copies, 1)  # ConfigError: too few nodes

        def exchange(self, job, manifest, target, link):
            sent = received = 0
            for src in range(self.topology.world_size):
                for dst in self.topology.partners(src, self.copies, 1):
                    for file in rank_files(manifest.files, src):
                        size = manifest.files[file]
                        if src == link.rank:
                            if not send_file(job.source, file, dst, self.group):
                                raise DrainError(f"{file} is damaged on rank {src}'s first level")
                            sent += size
                        elif dst == link.rank:
                            if not recv_file(target.store, file, size, src, self.group):
                                raise DrainError(f"{file} arrived damaged from rank {src}")
                            received += size
            return {"bytes_stored": received, "bytes_sent": sent}
    '''
)


@pytest.fixture(scope="module", autouse=True)
def mirror3_distribution(tmp_path_factory):
    """Install ``mirror3`` as a third-party distribution (here and in every rank)."""
    root = tmp_path_factory.mktemp("mirror3-plugin")
    (root / "mirror3_level.py").write_text(MIRROR3)
    info = root / "mirror3_level-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mirror3-level\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dcp_multilevel.levels]\nmirror3 = mirror3_level:Mirror3Level\n"
    )
    os.environ[PLUGIN_ENV] = str(root)
    Mirror3Tests.setup_rank()
    yield root
    sys.path.remove(str(root))
    del os.environ[PLUGIN_ENV]
    LEVEL_KINDS.refresh()


class Mirror3Tests(LevelTests):
    world, ranks_per_node = 3, 1

    @classmethod
    def level(cls, root):
        return Level(f"mirror3:{root}/n{{node}}/mirror3", options={"copies": 3})

    @classmethod
    def setup_rank(cls) -> None:
        # The rank's process was forked before the test installed the plugin.
        path = os.environ[PLUGIN_ENV]
        if path not in sys.path:
            sys.path.insert(0, path)
        LEVEL_KINDS.refresh()


class TestMirror3(Mirror3Tests):
    """The shipped suite, on a kind that the package has never heard of."""

    def test_it_was_found_through_its_entry_point(self):
        cls = LEVEL_KINDS.get("mirror3")
        assert cls.__module__ == "mirror3_level" and "mirror3" in LEVEL_KINDS.names()
        package = Path(dcp_multilevel.__file__).parent
        assert not any("mirror3" in p.read_text() for p in package.rglob("*.py"))

    def test_its_options_are_its_own(self):
        assert driver_for(Level("mirror3:/m", options={"copies": 4})).copies == 4
        with pytest.raises(
            ConfigError,
            match=r"sets \['replicas'\]; a mirror3 level takes "
            r"\['copies'\]",
        ):
            driver_for(Level("mirror3:/m", options={"replicas": 2}))
        with pytest.raises(ConfigError, match="copies must be an integer >= 2"):
            driver_for(Level("mirror3:/m", options={"copies": 1}))
        with pytest.raises(ConfigError, match=r"sets \['replicas'\] twice"):
            Level("partner:/p", replicas=2, options={"replicas": 2})

    def test_two_lost_nodes_still_restore_the_newest_step(self, tmp_path):
        root = str(tmp_path)
        out = run_ranks(_save_job, self.world, type(self), root, timeout=self.timeout_s)
        assert all(seen["newest"] == [(True, None)] for seen in out), out
        shutil.rmtree(tmp_path / "n0")
        shutil.rmtree(tmp_path / "n2")
        loaded = run_ranks(_load_job, self.world, type(self), root, timeout=self.timeout_s)
        assert loaded == [(STEPS[-1], True)] * self.world, loaded

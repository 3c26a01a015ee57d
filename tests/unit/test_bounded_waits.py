"""No wait of the levels is without a bound (``DCP_ML_TIMEOUT_S``): a save stuck on
a thread, then ``dcp_multilevel.wait()`` and the interpreter's exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import _faulty_fs  # noqa: F401 - registers faulty://
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_multilevel import MultiLevelWriter
from dcp_multilevel.checkpoint import StoredCheckpoint
from dcp_multilevel.checkpoint.copy import copy_file_verbatim
from dcp_multilevel.codecs.pipeline import Backlog
from dcp_multilevel.errors import ConfigError, WaitTimeoutError, timeout_s
from dcp_multilevel.stores.remote import RemoteStore

_STUCK_SAVE = textwrap.dedent(
    """
    import sys, threading, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    import dcp_multilevel
    from dcp_multilevel import Level, MultiLevelWriter
    from dcp_multilevel.errors import WaitTimeoutError

    never = threading.Event()
    class Stuck(DefaultSavePlanner):
        def resolve_data(self, item):
            never.wait()  # a save that never ends (a hung disk, a lost peer)

    levels = [Level(sys.argv[1] + "/l1"), Level(sys.argv[1] + "/l2")]
    writer = MultiLevelWriter("step-7", levels=levels)
    threading.Thread(target=dcp.save, args=({"w": torch.ones(4)},),
                     kwargs={"storage_writer": writer, "planner": Stuck()}, daemon=True).start()
    while writer.ticket is None:
        pass
    try:
        dcp_multilevel.wait()
    except WaitTimeoutError as e:
        print(str(e))
    """
)


def test_a_wait_for_a_save_that_never_ends_expires_naming_the_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _STUCK_SAVE, str(tmp_path)],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "DCP_ML_TIMEOUT_S": "1.5"},
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith(
        "rank 0 waited 1.5 s for the outcome of step 7 (save 0 of the levels, "
    ), line
    assert line.endswith(
        "in vain: a save that neither committed nor failed on every rank (a rank stopped "
        "in it?). Raise the bound (DCP_ML_TIMEOUT_S) if saves take longer"
    ), line
    # At exit, the same wait expires again, logged with what was left (then the
    # interpreter ends: the test's own timeout would fail it otherwise).
    assert "dcp_multilevel: at exit, Runtime(" in proc.stderr, proc.stderr
    assert "(left: ['step 7 (no outcome yet from its save)'])" in proc.stderr, proc.stderr


@pytest.mark.parametrize("text", ["0", "-3", "soon", "inf"])
def test_a_bound_that_is_no_positive_number_is_refused(monkeypatch, text):
    monkeypatch.setenv("DCP_ML_TIMEOUT_S", text)
    with pytest.raises(ConfigError) as e:
        timeout_s()
    assert str(e.value) == (
        f"environment variable DCP_ML_TIMEOUT_S={text!r} must be a positive number of seconds "
        "(the bound of every wait of the levels)"
    )


def test_the_bound_defaults_to_an_hour_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv("DCP_ML_TIMEOUT_S", raising=False)
    assert timeout_s() == 3600.0
    monkeypatch.setenv("DCP_ML_TIMEOUT_S", "90")
    assert timeout_s() == 90.0


def test_a_coding_thread_that_never_returns_is_a_bounded_wait(monkeypatch):
    monkeypatch.setenv("DCP_ML_TIMEOUT_S", "0.3")
    started, release = threading.Event(), threading.Event()

    def stuck() -> None:  # a codec call that never returns
        started.set()
        release.wait()

    with ThreadPoolExecutor(1) as pool:
        backlog = Backlog(pool)
        task = backlog.submit(stuck)
        assert started.wait(10)  # the gate: the pool thread runs it, the consumer cannot
        with pytest.raises(WaitTimeoutError) as info:
            backlog.result(task)
        release.set()
    assert str(info.value) == (
        "a coding thread has not finished its chunk after 0.3 s (DCP_ML_TIMEOUT_S); the "
        "codec's call never returned"
    )


def test_an_upload_that_never_ends_is_a_bounded_wait(tmp_path, monkeypatch):
    dcp.save({"w": torch.arange(64.0)}, storage_writer=MultiLevelWriter(tmp_path / "src"))
    source = StoredCheckpoint.at(tmp_path / "src")
    (file,) = source.manifest().files
    gate = tmp_path / "gate"  # never created while the copy waits: a stuck link
    target = RemoteStore(
        f"faulty://{tmp_path}/dst",
        target_protocol="file",
        target_options={"auto_mkdir": True},
        wait_for={"put_file": str(gate)},
        skip_instance_cache=True,
    )
    monkeypatch.setenv("DCP_ML_TIMEOUT_S", "0.5")
    with pytest.raises(WaitTimeoutError) as info:
        copy_file_verbatim(source, file, target)
    gate.touch()  # the upload left behind ends
    assert str(info.value) == (
        f"the upload of {file} to faulty://{tmp_path}/dst/{file} has not finished after "
        "0.5 s (DCP_ML_TIMEOUT_S)"
    )

"""The writer's and reader's arguments of the wrong type fail as they are built,
naming the class, the argument and what it takes."""

from __future__ import annotations

import pytest

from dcp_multilevel import MultiLevelReader, MultiLevelWriter
from dcp_multilevel.errors import ConfigError


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MultiLevelWriter(5),
            "MultiLevelWriter(path=...) takes a path or URL (str or os.PathLike), got 5 (int)",
        ),
        (
            lambda: MultiLevelWriter("ckpt", overwrite="yes"),
            "MultiLevelWriter(overwrite=...) takes True or False, got 'yes' (str)",
        ),
        (
            lambda: MultiLevelWriter("ckpt", sync_files=1),
            "MultiLevelWriter(sync_files=...) takes True or False, got 1 (int)",
        ),
        (
            lambda: MultiLevelWriter("ckpt", storage_options=[("key", "x")]),
            "MultiLevelWriter(storage_options=...) takes a dict of options, got [('key', 'x')] "
            "(list)",
        ),
        (
            lambda: MultiLevelWriter("step-1", levels="/nvme/run1"),
            "MultiLevelWriter(levels=...) needs a non-empty list of dcp_multilevel.Level(...) "
            "objects, got '/nvme/run1'",
        ),
        (
            lambda: MultiLevelReader(b"ckpt"),
            "MultiLevelReader(path=...) takes a path or URL (str or os.PathLike), got b'ckpt' "
            "(bytes)",
        ),
        (
            lambda: MultiLevelReader("latest", levels="/nvme/run1"),
            "MultiLevelReader(levels=...) needs a non-empty list of dcp_multilevel.Level(...) "
            "objects, got '/nvme/run1'",
        ),
        (
            lambda: MultiLevelReader("ckpt", allow_quarantined="no"),
            "MultiLevelReader(allow_quarantined=...) takes True or False, got 'no' (str)",
        ),
    ],
)
def test_an_argument_of_the_wrong_type_is_refused_by_name(build, message):
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value) == message


def test_arguments_of_the_right_types_are_taken(tmp_path):
    writer = MultiLevelWriter(tmp_path / "ckpt", overwrite=True, storage_options={})
    assert writer.path == str(tmp_path / "ckpt") and writer.overwrite

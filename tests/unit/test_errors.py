"""The error hierarchy: what crosses a process boundary intact."""

from __future__ import annotations

import pickle

from dcp_multilevel import errors


def test_every_error_survives_pickling_as_dcp_sends_it_between_ranks():
    made = [
        errors.CorruptCheckpointError("bad", checkpoint="/c", file="data/0-0.t.bin", fqn="w"),
        errors.ChecksumMismatchError("sum", checkpoint="/c"),
        errors.CheckpointNotFoundError("none", checkpoint="/c"),
        errors.CheckpointWriteError(
            "full", checkpoint="/c", file="data/1-0.t.bin", rank=1, level="/l"
        ),
        errors.RemoteStoreError("down", url="s3://b/k", operation="read", attempts=3),
        errors.ManifestError("odd"),
        errors.AsyncSaveError("earlier", checkpoint="/c"),
        errors.ConfigError("option"),
    ]
    for err in made:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert back.__dict__ == err.__dict__

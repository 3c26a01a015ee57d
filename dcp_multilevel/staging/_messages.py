"""What a :class:`~dcp_multilevel.staging.Stager`'s errors say: the save, the policy, what to do."""

from __future__ import annotations

from ..errors import AsyncSaveError
from ._failures import FailureRecord
from .config import StagingConfig

__all__ = ["busy_message", "never_began_message", "raise_failure"]


def raise_failure(failures: FailureRecord | None, checkpoint_id: str) -> None:
    """Raise the recorded background failure, once, as :class:`AsyncSaveError`.

    Raises:
        AsyncSaveError: a background step of an earlier async save failed.
    """
    text = failures.take() if failures is not None else None
    if text is not None:
        raise AsyncSaveError(
            f"the previous async save with this writer failed in the background ({text}); "
            "nothing of it was committed. Fix the cause and save again; this error is "
            "raised once.",
            checkpoint=checkpoint_id,
        )


def busy_message(checkpoint_id: str, what: str, cfg: StagingConfig) -> str:
    """An earlier save holds the buffers: ``what`` it did (or did not do) in time."""
    return (
        f"async save to {checkpoint_id}: an earlier save with this writer {what} (policy "
        f"in_flight={cfg.in_flight!r}, wait_timeout_s={cfg.wait_timeout_s}); at most one "
        "save is written and one queued per writer. Wait for the returned future before "
        'saving again, or use StagingConfig(in_flight="wait").'
    )


def never_began_message(checkpoint_id: str, cfg: StagingConfig) -> str:
    """An earlier save's background part never made its first writer call."""
    return (
        f"async save to {checkpoint_id}: an earlier async save with this writer did not "
        f"begin writing within wait_timeout_s={cfg.wait_timeout_s}: DCP's "
        "background thread failed before its first call to the writer (in PROCESS mode: "
        "DCP's daemon process did not start). That save's future holds the error; drop "
        "the future to free its buffers, then save again."
    )

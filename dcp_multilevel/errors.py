"""The one error hierarchy of dcp_multilevel.

Every error raised on purpose by this package derives from
:class:`DcpMultilevelError`, and each subclass also derives from the builtin it
refines, so ``except FileNotFoundError`` keeps working for callers who do not
know about us. Messages say what failed, where (checkpoint, level, file, item)
and what to do; the same facts are kept as attributes for programs.

Inside ``dcp.save`` / ``dcp.load``, DCP wraps exceptions into
``torch.distributed.checkpoint.api.CheckpointException`` (a ``BaseException``;
one entry per rank in ``.failures``, our message in its text). One exception:
in ``dcp.load``, DCP catches whatever ``read_metadata`` raises and raises its
own ``AssertionError`` carrying only our message, so a missing or invalid
manifest cannot be caught by type there; call ``MultiLevelReader(path)
.read_metadata()`` first to get the typed error.
"""

from __future__ import annotations

import os

__all__ = [
    "TIMEOUT_ENV",
    "AsyncSaveError",
    "BrokenChainError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "ChecksumMismatchError",
    "ConfigError",
    "ConvertError",
    "CorruptCheckpointError",
    "DcpMultilevelError",
    "DrainError",
    "ManifestDigestError",
    "ManifestError",
    "NotStockCheckpointError",
    "PlanningError",
    "RegistryError",
    "RemoteStoreError",
    "SaveInFlightError",
    "StagingFenceError",
    "TruncatedDataError",
    "UnsafeObjectError",
    "UnsupportedFormatVersionError",
    "UnsupportedStateError",
    "WaitTimeoutError",
    "timeout_s",
]


class DcpMultilevelError(Exception):
    """Base of every error this package raises on purpose.

    Errors pickle with their message and attributes: DCP sends a failed rank's
    exception to every rank (``CheckpointException.failures``), and keyword-only
    constructors would otherwise fail to unpickle there.
    """

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), str(self), dict(self.__dict__))


def _rebuild(cls: type[DcpMultilevelError], message: str, attrs: dict) -> DcpMultilevelError:
    err = cls.__new__(cls, message)
    err.args = (message,)
    err.__dict__.update(attrs)
    return err


class ConfigError(DcpMultilevelError, ValueError):
    """An option passed to a writer, reader, level or store is invalid."""


class ConvertError(DcpMultilevelError, ValueError):
    """A conversion (``dcp_multilevel.convert``) cannot be done: the source is not a
    checkpoint, the target already exists, or the target format cannot hold a value.

    Attributes:
        path: the source or target the message is about.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class NotStockCheckpointError(DcpMultilevelError, ValueError):
    """A stock DCP reader opened one of our checkpoints (raised by its ``.metadata`` hint,
    ``format/stock_hint.py``)."""


class PlanningError(DcpMultilevelError, ValueError):
    """A save plan cannot be built (inconsistent inputs, unequal replicas)."""


class RegistryError(DcpMultilevelError, LookupError):
    """A plugin (store, codec) is unknown, not installed, or registered twice."""


class RemoteStoreError(DcpMultilevelError, OSError):
    """A remote-store operation kept failing with transient errors until retries ran out,
    or failed because its endpoint cannot be reached at all (the connection refused,
    the host name unknown), which is not retried.

    The last underlying error is chained as ``__cause__``.

    Attributes:
        url: the object or prefix the operation was about.
        operation: ``"upload"``, ``"read"``, ``"stat"``, ``"list"`` or ``"remove"``.
        attempts: how many times it was tried.
    """

    def __init__(self, message: str, *, url: str, operation: str, attempts: int) -> None:
        # OSError.__init__ with one argument keeps ``str(err) == message``.
        super().__init__(message)
        self.url = url
        self.operation = operation
        self.attempts = attempts


class CheckpointNotFoundError(DcpMultilevelError, FileNotFoundError):
    """No committed checkpoint (no manifest) at the given location."""

    def __init__(self, message: str, *, checkpoint: str) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class CheckpointWriteError(DcpMultilevelError, OSError):
    """A rank could not write a file of the checkpoint it saves (a path below a regular
    file, no permission, a full disk); the store's error is chained as ``__cause__``,
    and its ``errno`` is this error's.

    Attributes:
        checkpoint: the checkpoint's URL.
        file: the file, relative to the checkpoint.
        rank: the rank that wrote it.
        level: with levels, the first level's URL (where the save is written); else None.
    """

    def __init__(
        self, message: str, *, checkpoint: str, file: str, rank: int, level: str | None = None
    ) -> None:
        # OSError.__init__ with one argument keeps ``str(err) == message``.
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file
        self.rank = rank
        self.level = level


class CheckpointExistsError(DcpMultilevelError, FileExistsError, RuntimeError):
    """A committed checkpoint already exists where a new one would be written.

    Also a ``RuntimeError``, and its message starts with "Checkpoint already
    exists", as stock ``FileSystemWriter``'s does: callers match either.
    """

    def __init__(self, message: str, *, checkpoint: str) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class ManifestError(DcpMultilevelError, ValueError):
    """A manifest is malformed, inconsistent or hostile (bad paths, bad ranges)."""

    def __init__(self, message: str, *, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class ManifestDigestError(ManifestError):
    """A manifest's bytes do not match the digest it carries: it was modified or damaged."""


class UnsupportedFormatVersionError(ManifestError):
    """The manifest was written in a format version this release cannot read."""


class CorruptCheckpointError(DcpMultilevelError, OSError):
    """Stored bytes do not match what the manifest promises."""

    def __init__(
        self,
        message: str,
        *,
        checkpoint: str,
        file: str | None = None,
        fqn: str | None = None,
    ) -> None:
        # OSError.__init__ with one argument keeps ``str(err) == message``.
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file
        self.fqn = fqn


class ChecksumMismatchError(CorruptCheckpointError):
    """An item's bytes hash to a different value than the manifest records."""


class TruncatedDataError(CorruptCheckpointError):
    """A data file is shorter than the manifest says (or ends mid-item)."""


class BrokenChainError(CorruptCheckpointError):
    """A delta item's reference cannot serve it: the reference checkpoint is missing,
    is another save, or holds other bytes than the delta was coded against.

    ``chain`` lists the checkpoints from the delta to the one that failed.
    """

    def __init__(
        self,
        message: str,
        *,
        checkpoint: str,
        chain: tuple[str, ...] = (),
        file: str | None = None,
        fqn: str | None = None,
    ) -> None:
        super().__init__(message, checkpoint=checkpoint, file=file, fqn=fqn)
        self.chain = chain


class UnsupportedStateError(DcpMultilevelError, TypeError):
    """A state_dict value cannot be stored (e.g. an unsupported dtype)."""


class UnsafeObjectError(DcpMultilevelError, ValueError):
    """A non-tensor object in a checkpoint is refused by ``weights_only=True`` loading."""


class DrainError(DcpMultilevelError, RuntimeError):
    """Copying a committed checkpoint to a higher level failed; the source is untouched."""


class WaitTimeoutError(DcpMultilevelError, TimeoutError):
    """A bounded wait expired: the message names what it waited for (the step, the
    level, the rank, the file) and the bound (:func:`timeout_s`; ``docs/levels.md``,
    "Bounded waits")."""


#: The environment variable that bounds every wait on another thread, process or rank,
#: in seconds (``docs/levels.md``, "Bounded waits"); 3600 when unset.
TIMEOUT_ENV = "DCP_ML_TIMEOUT_S"


def timeout_s() -> float:
    """The bound of every wait on another thread, process or rank: ``DCP_ML_TIMEOUT_S``,
    else 3600 s. Beside the error its expiry raises (:class:`WaitTimeoutError`), so that
    every folder reads the one bound.

    Raises:
        ConfigError: the variable holds no positive number.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return 3600.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"environment variable {TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} must be a positive "
            "number of seconds (the bound of every wait of the levels)"
        )
    return value


class AsyncSaveError(DcpMultilevelError, RuntimeError):
    """An earlier ``dcp.async_save`` of this writer failed in the background.

    Raised by the next ``async_save`` with the same writer (the returned future
    raised the original error already); nothing of the failed save was committed.
    The original error's text is in the message.
    """

    def __init__(self, message: str, *, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class SaveInFlightError(DcpMultilevelError, RuntimeError):
    """A new async save found the writer busy, under the ``in_flight="raise"`` policy
    (or the wait for a free buffer set timed out under ``"wait"``)."""


class StagingFenceError(DcpMultilevelError, RuntimeError):
    """The state changed while an overlapped async save was still copying it (before
    its ``staging_completion``), found by ``StagingConfig(check_fence=True)``."""

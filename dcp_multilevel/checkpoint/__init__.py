"""Stored checkpoints: one object for one checkpoint in one store, and its verified items.

- ``stored.py``: :class:`StoredCheckpoint`: manifest, commit, delete, data
  files, sweep, verified item reads; what the writer, reader, drains and
  manager use for every checkpoint they touch.
- ``root.py``: :class:`CheckpointRoot`: the ``step-<N>`` checkpoints below one root.
- ``items.py``: :func:`read_item` / :func:`read_stored`: the one verified
  read of a stored item, shared by loads and drains.
- ``destinations.py``: where a loaded item's bytes land and how the reader
  hands verified bytes to DCP's ``LoadPlanner`` (non-tensor objects vetted
  with ``weights_only`` loading).
- ``sources.py``: the writer's side of it: what a saved item's bytes are
  (``io.BytesIO`` values as their bytes, other values only if they load back
  with ``weights_only``, tensors checked against the plan).
- ``pinned.py``: page-locked host scratch for both, from torch's caching host
  allocator, counted and handed back (after a load; when a writer closes).
- ``save_reference.py``: :class:`SaveReference`: the committed sibling a delta
  save codes against, as the writer checks, reads and records it.
- ``verify.py``: :func:`verify_checkpoint`: every item of a checkpoint read
  back verified and decoded, every bad one reported (the CLI's ``verify``).
- ``fallback.py``: reading one checkpoint from a chain of copies (the reader's
  record of which copy failed for which item, and the errors it raises).

Nothing here knows about levels, drains or torch.distributed.
"""

from .items import ItemRef, blocks_of, read_item, read_stored
from .root import CheckpointRoot
from .stored import StoredCheckpoint, decoded_manifest, new_save_id
from .verify import ItemProblem, VerifyResult, verify_checkpoint, verify_file

__all__ = [
    "CheckpointRoot",
    "ItemProblem",
    "ItemRef",
    "StoredCheckpoint",
    "VerifyResult",
    "blocks_of",
    "decoded_manifest",
    "new_save_id",
    "read_item",
    "read_stored",
    "verify_checkpoint",
    "verify_file",
]

"""What a saved item's bytes are: the writer's counterpart of ``destinations.py``.

The writer asks, per write item of a save plan:

- :func:`object_record` for a non-tensor item: an ``io.BytesIO`` value of the
  state is stored as its bytes (``format/objects.py``: a prefix and the
  bytes, never unpickled on load); any other value as the ``torch.save``
  bytes DCP's planner resolved, once they are known to load back with
  ``weights_only=True`` (a checkpoint must load back).
- :func:`tensor_of` for a tensor item: the contiguous CPU tensor to store,
  checked against the plan.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.serialization import get_safe_globals

from ..errors import UnsupportedStateError
from ..format.objects import bytesio_record, load_object
from ..format.tensor_bytes import value_tensor
from .pinned import host_scratch

__all__ = ["object_record", "tensor_of"]


def object_record(planner: SavePlanner, item: WriteItem, lock: threading.Lock) -> memoryview:
    """The bytes to store for the non-tensor item ``item``.

    ``lock`` serializes the planner calls (``torch.save`` in ``resolve_data``
    is not reentrant-safe for every object).

    Raises:
        UnsupportedStateError: the planner returned no ``io.BytesIO``, or the
            value would not load back with ``weights_only=True``.
    """
    fqn = item.index.fqn
    with lock:
        value = _state_value(planner, item)
        data = None if isinstance(value, io.BytesIO) else planner.resolve_data(item)
    if data is None:  # an io.BytesIO value: its bytes as they are (stock's contract)
        return memoryview(bytesio_record(value))
    if not isinstance(data, io.BytesIO):
        raise UnsupportedStateError(
            f"planner returned {type(data).__name__} for bytes item {fqn!r}; expected io.BytesIO"
        )
    view = data.getbuffer()
    # The same bytes, under the same allowlist, load back alike: an optimizer's
    # param_groups, saved every time, are loaded once (torch.load takes the GIL
    # from training for each).
    key = (xxhash.xxh3_128_hexdigest(view), len(view), tuple(get_safe_globals()))
    if key in _LOADS_BACK:
        return view
    _, refused = load_object(view)
    if refused is not None:
        raise UnsupportedStateError(
            f"value {fqn!r} cannot be saved: loading it back with weights_only=True would "
            f"fail ({refused}). Store it as plain Python data (str, int, float, list, dict, "
            "tensor), or allowlist its type with torch.serialization.add_safe_globals([...]) "
            "in the saving and the loading process."
        )
    if len(_LOADS_BACK) >= _LOADS_BACK_MAX:
        _LOADS_BACK.clear()
    _LOADS_BACK.add(key)
    return view


#: Keys of object records known to load back with ``weights_only=True`` (bounded).
_LOADS_BACK: set[tuple[Any, ...]] = set()
_LOADS_BACK_MAX = 4096


def _state_value(planner: SavePlanner, item: WriteItem) -> Any:
    """The state's own value of a bytes item, where the planner can say (DCP's
    ``DefaultSavePlanner.lookup_object``); None where it cannot."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return None
    try:
        return lookup(item.index)
    except (KeyError, ValueError, IndexError):
        return None


def tensor_of(item: WriteItem, data: Any) -> torch.Tensor:
    """The contiguous CPU tensor to store for ``item`` (``data``: what the planner
    resolved), checked against the plan.

    Raises:
        UnsupportedStateError: not a tensor, not strided (sparse), or not the
            plan's dtype and shape.
    """
    fqn = item.index.fqn
    if not isinstance(data, torch.Tensor):
        raise UnsupportedStateError(
            f"planner returned {type(data).__name__} for tensor item {fqn!r}; expected a tensor"
        )
    td = item.tensor_data
    t = data
    if t.layout != torch.strided:  # (stock DCP cannot save them either)
        raise UnsupportedStateError(
            f"tensor item {fqn!r} is a {t.layout} tensor; DCP saves strided tensors only: "
            "store it dense (t.to_dense()), or its indices and values as tensors of their own"
        )
    if t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes):
        cause = (
            "a planner that changes dtype or shape in resolve_data must change its plan to match"
        )
        if tuple(t.shape) == tuple(td.chunk.sizes):
            # DCP's plan caching compares plans without their dtypes.
            cause += (
                ". After a change of only a dtype, DCP's plan caching "
                "(DefaultSavePlanner(enable_plan_caching=True)) replays the last save's "
                "plan: use BalancedSavePlanner, which plans again, or a new planner"
            )
        raise UnsupportedStateError(
            f"planner returned a {tuple(t.shape)} {t.dtype} tensor for {fqn!r}, but the plan "
            f"says {tuple(td.chunk.sizes)} {td.properties.dtype}; {cause}"
        )
    if t.device.type == "cuda":
        # Through page-locked memory (the caching host allocator reuses it across
        # items and saves; the writer's close() hands it back): a DMA copy at full
        # speed, not a pageable one. (No autograd history for the copy; a conjugate
        # or negative view's memory is not its values: resolved on the device.)
        # On the calling thread's current stream, which the caller orders after
        # the work that wrote the tensor (checkpoint/streams.py); the tensor is
        # held here until the copy is done, so its memory is not reused before.
        stream = torch.cuda.current_stream(t.device)
        t = t.detach().resolve_conj().resolve_neg()
        host = host_scratch(t.shape, t.dtype, pinned=True)
        if t.dtype == torch.bool:
            # As bytes: a strided bool's copy runs a bool kernel, which rewrites
            # bytes other than 0 and 1 (a contiguous one's is a memcpy).
            host.view(torch.uint8).copy_(t.view(torch.uint8), non_blocking=True)
        else:
            host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()  # this copy only: other threads may queue on the stream
        return host
    # A copy only where needed: strided views store their projection.
    return value_tensor(t)

"""Delta chains on one level: which checkpoint the next save is coded against, and
which checkpoints the kept ones need (pure: no I/O).

A level with ``keyframe_every=N`` (``docs/delta.md``) stores every N-th
checkpoint whole (a keyframe) and the others as deltas against an earlier
checkpoint on the same level: the last keyframe (``delta_against="keyframe"``)
or the level's previous checkpoint (``"previous"``). The manager keeps, per
level, the history of what it stored there in save order, ``(step,
reference step or None)``, the same on every rank; these rules turn it into
the next save's reference. A reference that turns out to be missing or
damaged when the save reads it makes that save whole (the writer and the
drain check), so the history only steers, it never has to be right.

Retention keeps every checkpoint a kept one needs: :func:`needed` closes a
set of steps under "is the reference of".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["needed", "next_reference"]


def next_reference(
    history: Sequence[tuple[int, int | None]],
    keyframe_every: int | None,
    against: str = "keyframe",
    present: Iterable[int] | None = None,
) -> int | None:
    """The step the next save on the level is coded against, or None (a keyframe).

    ``history``: ``(step, reference)`` of the level's checkpoints in save order
    (reference None: a keyframe). ``present``: the steps still on the level
    (None: all of the history); a chain through a missing step starts over.
    """
    if keyframe_every is None or keyframe_every <= 1 or not history:
        return None
    alive = {s for s, _ in history} if present is None else set(present)
    keyframes = [i for i, (s, ref) in enumerate(history) if ref is None]
    if not keyframes or history[keyframes[-1]][0] not in alive:
        return None
    last = keyframes[-1]
    if len(history) - last >= keyframe_every:  # the keyframe and N - 1 deltas: a new one
        return None
    if against == "keyframe":
        return history[last][0]
    # "previous": the newest, if its whole chain back to the keyframe is still there.
    refs = dict(history)
    step: int | None = history[-1][0]
    while step is not None:
        if step not in alive:
            return None
        step = refs.get(step)
    return history[-1][0]


def needed(keep: Iterable[int], refs: Mapping[int, int | None]) -> set[int]:
    """``keep`` and every step one of them needs: its reference, that one's, and so on.

    ``refs``: each step's reference (None or absent: stored whole).
    """
    out: set[int] = set()
    todo = list(keep)
    while todo:
        step = todo.pop()
        if step in out:
            continue
        out.add(step)
        ref = refs.get(step)
        if ref is not None:
            todo.append(ref)
    return out

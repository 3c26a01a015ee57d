"""Async-save staging, owned by :class:`~dcp_multilevel.MultiLevelWriter`.

``dcp.async_save(sd, storage_writer=W)`` stages through ``W`` because ``W``
is a DCP ``AsyncStager``; ``W`` holds a :class:`Stager` and calls it
explicitly (order of calls and threads: :mod:`.stager`)::

    training thread     W.stage / W.synchronize_staging / W.close
                        -> Stager.stage / .synchronize / .close
    background thread   W.reset, W.storage_meta   -> Stager.claim
                        W.write_data, W.finish    -> with Stager.background(...) as save

Modules: :mod:`.config` (:class:`StagingConfig`), :mod:`.stager` (the
stager and its state in the training process: in-flight policy, budget waves,
failure reporting and its errors' words),
:mod:`.background` (:class:`BackgroundSave`, what a background step sees of it),
:mod:`.buffers` (the host buffer pool, its sets page-locked at their exact size;
:func:`registered_bytes` counts them), :mod:`.copies` (the copy into it, now or
behind the fence), :mod:`.live` (the over-budget handshake), and the private
``_tickets``, ``_priority`` and ``_steps`` (optimizer steps wait
for the fence) it uses, and :mod:`.device` (a copy of
the state on its GPU, for the fence).
"""

from .background import BackgroundSave
from .buffers import registered_bytes
from .config import StagingConfig
from .stager import Stager

__all__ = ["BackgroundSave", "Stager", "StagingConfig", "registered_bytes"]

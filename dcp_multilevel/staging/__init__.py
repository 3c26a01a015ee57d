"""Async-save staging, owned by :class:`~dcp_multilevel.MultiLevelWriter`.

``dcp.async_save(sd, storage_writer=W)`` stages through ``W`` because ``W``
is a DCP ``AsyncStager``; ``W`` holds a :class:`Stager` and calls it
explicitly (order of calls and threads: :mod:`.stager`)::

    training thread     W.stage / W.synchronize_staging / W.close
                        -> Stager.stage / .synchronize / .close
    background thread   W.reset, W.storage_meta   -> Stager.claim
                        W.write_data, W.finish    -> with Stager.background(...) as save

Modules: :mod:`.config` (:class:`StagingConfig`), :mod:`.stager` (the
stager: tickets, in-flight policy, budget waves, failure reporting),
:mod:`.buffers` (the host buffer pool and the copy into it), and the private
``_tickets``, ``_failures`` and ``_priority`` it uses.
"""

from .config import StagingConfig
from .stager import BackgroundSave, Stager

__all__ = ["BackgroundSave", "Stager", "StagingConfig"]

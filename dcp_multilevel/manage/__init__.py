"""The checkpoint manager and the parts it composes, each owning one thing.

- ``manager.py``: :class:`~dcp_multilevel.CheckpointManager`, composing the parts below.
- ``ladder.py``: the levels, checked; their drivers bound; the topology.
- ``saving.py``: a save onto the first level, and the step it is coded against.
- ``drains.py``: which drains a save starts (rank 0's decision for every
  rank), resumes after a restart, repeats after a restore.
- ``holdings.py``: what each level holds (one lock), and the retention that follows.
- ``retention.py``: :class:`RetentionRules`, the pure rules (``dcp-multilevel gc`` runs them too).
- ``chains.py``: each delta level's history; ``keyframes.py``: its pure rules.
- ``cadence.py``: when :meth:`~dcp_multilevel.CheckpointManager.step` saves.
- ``metrics.py``: save and drain records, and where they go.
"""

"""The rank harness, shipped as ``dcp_multilevel.testing.ranks`` (tests import it from here too)."""

from dcp_multilevel.testing.ranks import RankError, RankTimeoutError, run_ranks

__all__ = ["RankError", "RankTimeoutError", "run_ranks"]

"""A user type that a test allowlists for weights_only loading
(tests/multiprocess/test_dcp_contract.py).

In a module of its own so DCP's PROCESS daemon can import it by name.
"""

from __future__ import annotations


class RunInfo:
    """Plain attributes, no custom reduce: what weights_only loads once allowlisted."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunInfo) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((self.name, self.seed))

"""The warnings ``dcp_multilevel`` logs, kept for a test to assert on (in a rank's
process too, where pytest's ``caplog`` does not reach)."""

from __future__ import annotations

import logging

__all__ = ["Warnings"]


class Warnings(logging.Handler):
    """The package's warnings, from :meth:`attach` (or the ``with`` block) on."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def attach(self) -> Warnings:
        logging.getLogger("dcp_multilevel").addHandler(self)
        return self

    def __enter__(self) -> Warnings:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("dcp_multilevel").removeHandler(self)

"""A logging handler that keeps the messages of warnings and errors, for rank code that reports what was logged."""

from __future__ import annotations

import logging


class WarningRecords(logging.Handler):
    """Keeps ``record.getMessage()`` of every record at WARNING or above, in order."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

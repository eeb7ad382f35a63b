"""The console shows one line per failure; the full traceback stays in the run's log.

A failed task used to print its traceback on the console two or three times
(the task engine, the flow engine, the CLI), ~100 lines for one fault. The
console handler now prints each record's message, which names the exception,
and a pointer to the log that keeps the traceback: Prefect's API log handler
(the task run's and flow run's logs in the UI) sees the record whole.
"""

from __future__ import annotations

import logging

HINT = "  [traceback in the run's log in the Prefect UI]"


class OneLineExceptions(logging.Formatter):
    """Wraps a console formatter: records are formatted without their traceback."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        bare = logging.makeLogRecord(record.__dict__)  # the API handler keeps the original
        bare.exc_info, bare.exc_text, bare.stack_info = None, None, None
        return self.inner.format(bare) + HINT


def one_line_failures() -> None:
    """Make every console handler of the root logger print failures as one line (idempotent)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler.formatter, OneLineExceptions
        ):
            handler.setFormatter(OneLineExceptions(handler.formatter or logging.Formatter()))

"""A failure is one line on the console, and whole (traceback included) in the
log Prefect keeps for the run (its API log handler sees the same record)."""

from __future__ import annotations

import io
import logging

from flows.console import HINT, OneLineExceptions, one_line_failures


def test_console_prints_one_line_while_the_run_log_keeps_the_traceback():
    kept: list[logging.LogRecord] = []

    class RunLog(logging.Handler):  # stands where Prefect's APILogHandler stands
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)
            self.format(record)  # formats (and caches) the traceback, as the API handler does

    stream = io.StringIO()
    console = logging.StreamHandler(stream)
    console.setFormatter(OneLineExceptions(logging.Formatter("%(levelname)s %(message)s")))
    logger = logging.getLogger("test_console.task_runs")
    logger.propagate = False
    logger.handlers = [RunLog(), console]
    try:
        raise RuntimeError("engine 0 refused v3")
    except RuntimeError:
        logger.exception("Task run failed with exception: RuntimeError('engine 0 refused v3')")
    out = stream.getvalue().splitlines()
    assert out == [
        f"ERROR Task run failed with exception: RuntimeError('engine 0 refused v3'){HINT}"
    ]
    assert kept[0].exc_info is not None and "Traceback" in kept[0].exc_text


def test_the_root_console_handler_is_wrapped_once():
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    try:
        one_line_failures()
        one_line_failures()
        assert isinstance(handler.formatter, OneLineExceptions)
        assert not isinstance(handler.formatter.inner, OneLineExceptions)
    finally:
        root.removeHandler(handler)

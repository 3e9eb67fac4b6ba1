"""The library's `logging` records into Triton's log, through `pb.Logger`.

A Python model runs in a stub process where nobody configures `logging`: without this, the library's
warnings while a model loads (an engine that falls back, a graph exported on first use) would reach
stderr with no model name, and its info lines not at all.

    with library_logs_to_triton(pb_utils, self.name):
        flow, hift = build_token2wav(...)

Scoped to a block, so that nothing stays attached to the library's loggers: in a test process that
loads model files under the fake pb_utils (tests/pb_fake.py), a lasting handler would log every later
record twice.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

LIBRARY_LOGGER = "cosyvoice_triton"


class TritonLogHandler(logging.Handler):
    """Formats a record as `<model>: <logger>: <message>` and hands it to `pb.Logger` at its level."""

    def __init__(self, pb, model: str):
        super().__init__(logging.INFO)
        self.pb = pb
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{self.model}: {record.name}: {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.levelno >= logging.ERROR:
                self.pb.Logger.log_error(text)
            elif record.levelno >= logging.WARNING:
                self.pb.Logger.log_warn(text)
            else:
                self.pb.Logger.log_info(text)
        except Exception:  # noqa: BLE001 - logging must never break the model
            self.handleError(record)


@contextmanager
def library_logs_to_triton(pb, model: str) -> Iterator[TritonLogHandler]:
    """While the block runs, the library's records of level INFO and above go to Triton's log."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    handler = TritonLogHandler(pb, model)
    level = logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

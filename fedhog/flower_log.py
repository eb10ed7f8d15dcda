"""Flower's logger (``flwr``, which fedhog's ServerApp logs through too) at the level fedhog chooses.

Importing Flower sets that logger to DEBUG. fedhog's entry points import
Flower late (``import fedhog.cli`` loads no Flower), so a level set before the
first import would be undone by it: :func:`flower_log_level` imports Flower's
logger module first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


def flower_logger() -> logging.Logger:
    """The ``flwr`` logger, after Flower's import has configured it."""
    import flwr.common.logger  # noqa: F401 -- sets the logger's level and handlers

    return logging.getLogger("flwr")


@contextmanager
def flower_log_level(level: int) -> Iterator[logging.Logger]:
    """Flower's logger at ``level`` inside the block (its level before, after)."""
    logger = flower_logger()
    before = logger.level
    logger.setLevel(level)
    try:
        yield logger
    finally:
        logger.setLevel(before)

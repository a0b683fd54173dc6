"""The op registry's logger and ``TEFL_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from .env import choice

LOGGER_NAME = "te_fl_attention.registry"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger(LOGGER_NAME)


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """Apply ``TEFL_LOG_LEVEL`` to the package logger ``te_fl_attention`` (the registry's, the
    plugin's and each new attention decision's at INFO) and the registry logger; a stderr
    handler on ``te_fl_attention`` if nothing logs yet."""
    env = os.environ if environ is None else environ
    raw = env.get("TEFL_LOG_LEVEL", "")
    if not raw.strip():
        return
    name = choice("TEFL_LOG_LEVEL", raw, (n.lower() for n in LOG_LEVELS)).upper()
    logger.setLevel(name)
    package = logging.getLogger("te_fl_attention")
    package.setLevel(name)
    if not logger.handlers and not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        package.addHandler(handler)

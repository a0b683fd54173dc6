"""Helpers shared by the probe-cache tests (keys, results, a log collector)."""

from __future__ import annotations

import hashlib
import logging

from te_fl_attention.cache import CacheKey
from te_fl_attention.reasons import ProbeResult, Reason

FP = hashlib.sha256(b"device").hexdigest()
VK = hashlib.sha256(b"versions").hexdigest()


def key(i: int, backend: str = "fused", fp: str = FP, vk: str = VK) -> CacheKey:
    """A well-formed key numbered ``i``."""
    return CacheKey(hashlib.sha256(str(i).encode()).hexdigest(), backend, fp, vk)


def result(i: int, backend: str = "fused") -> ProbeResult:
    """A result that differs per ``i`` (supported, or refused with a reason)."""
    if i % 3 == 0:
        return ProbeResult(
            backend,
            False,
            (Reason("head_dim.too_large", f"head_dim {i} > 256", observed=i, limit=256),),
            elapsed_ms=i / 7,
        )
    return ProbeResult(backend, True, evidence=f"rules #{i}", elapsed_ms=i / 3)


class Records(logging.Handler):
    """Collects the cache logger's records (usable where pytest's caplog is not)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]

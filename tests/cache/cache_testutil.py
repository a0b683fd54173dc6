"""Helpers shared by the probe-cache tests (keys, results, a log collector, the CLI in a child)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from te_fl_attention.cache import CacheKey
from te_fl_attention.reasons import ProbeResult, Reason

ROOT = Path(__file__).resolve().parents[2]
_CLI = "import sys; from te_fl_attention.cli import main; sys.exit(main(sys.argv[1:]))"

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


def run_cli(args: list[str], env: dict[str, str], timeout: float = 60
            ) -> subprocess.CompletedProcess:  # fmt: skip
    """``te-fl-attn ARGS`` in a child process with ``env`` added (the checkout on its path)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", _CLI, *args], env=full, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip

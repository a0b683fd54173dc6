"""Helpers shared by the probe-cache tests (keys, results, a log collector, the CLI in a child)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from te_fl_attention.cache import CacheKey
from te_fl_attention.cache.compact import HOLES
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


def full_result(i: int, backend: str = "fused") -> ProbeResult:
    """:func:`result` with more ``elapsed_ms`` values than a compact row holds: a store keeps it
    as a full row (its JSON text in ``result``, as in schema 1)."""
    flavours = tuple(ProbeResult("fa2", True, elapsed_ms=j / 4) for j in range(HOLES))
    return dataclasses.replace(result(i, backend), variants=flavours)


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


#: ``explain`` of an fp32 config on h100: the rule stage refuses fused (cuDNN takes fp16/bf16).
FP32_EXPLAIN = ["explain", "--dtype", "fp32", "--seqlen", "256", "--num-heads", "8", "--device",
                "h100", "--json"]  # fmt: skip


def export_fp32_pack(new_job: Any, capsys: Any, out: Path) -> None:
    """In a fresh job on ``a.sqlite``: explain :data:`FP32_EXPLAIN`, export its rows as a pack."""
    from te_fl_attention import cli

    new_job("a.sqlite")
    assert cli.main(FP32_EXPLAIN) == 0
    capsys.readouterr()
    assert cli.main(["cache", "export", "--format", "sqlite", str(out)]) == 0


def import_and_assert_fused_refused(new_job: Any, capsys: Any, out: Path,
                                    imported: Any = None) -> None:  # fmt: skip
    """Import the (forged) pack ``out`` into a fresh job's ``b.sqlite`` (``imported(path)``
    checks it then), and show that ``explain`` and ``select()`` still refuse fused for the fp32
    config, its four rows served from the cache."""
    from te_fl_attention import FusedAttnConfig, Policy, cli, selector

    new_job("b.sqlite")
    assert cli.main(["cache", "import", str(out)]) == 0
    assert "imported 4" in capsys.readouterr().out
    if imported is not None:
        imported()
    new_job()
    assert cli.main(FP32_EXPLAIN) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["chosen"] != "fused"
    fused = next(r for r in got["results"] if r["backend"] == "fused")
    assert not fused["supported"] and fused["reasons"][0]["code"] == "fused.dtype"
    new_job()
    fp32 = FusedAttnConfig(dtype="fp32", max_seqlen_q=256, num_heads=8)
    d = selector.select(fp32, "h100", Policy())
    assert d.chosen != "fused" and selector.default_selector().stats["cache_hits"] == 4

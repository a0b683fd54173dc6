"""Helpers for the CLI tests: the te-fl-attn CLI run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "te_fl_attention.cli", *args],
                          capture_output=True, text=True, env={**base, **(env or {})},
                          timeout=120)  # fmt: skip


def bad_input(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout[-400:], p.stderr[-400:])
    assert "Traceback" not in p.stderr
    return p.stderr

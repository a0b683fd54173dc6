"""Helpers for the fleet tests: child-process environments and multi-rank launches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python process: this checkout importable, quiet, unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_ranks(args_for, world: int, timeout: float, env: dict[str, str] | None = None
              ) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Start ``world`` Python processes (``args_for(rank)`` after ``python``), wait for all of
    them; kill them all and fail if they outlast ``timeout`` (a deadlock fails, never hangs)."""
    procs = [subprocess.Popen([sys.executable, *args_for(r)], env=env or child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail(f"ranks did not finish within {timeout:.0f} s (deadlock?)")
    for r, done in enumerate(outs):
        assert done.returncode == 0, f"rank {r} failed:\n{done.stdout[-4000:]}"
    return outs

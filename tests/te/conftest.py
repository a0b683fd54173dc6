"""Fixtures for the real-TE tests: run a script in a fresh Python process that imports TE 2.20.2
through its own loader (:mod:`te_boot`, stub extension :mod:`stub_tex`).

TE's import-time state (the lru_cached ``load_framework_extension``, ``sys.modules`` aliases,
the ``dot_product_attention`` plugin block) cannot be reset in-process, so each scenario runs in
its own interpreter and reports back one JSON object on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Variables a scenario must not inherit (it sets what it needs).
_CLEARED = ("NVTE_PLUGIN", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
            "TE_FL_ATTN_FORCE", "TE_FL_ATTN_PREFER", "TE_FL_PER_OP", "TE_FL_PREFER",
            "TE_FL_STRICT", "TE_FL_PLUGIN_MODULES", "TRITON_INTERPRET", "TE_FL_ATTN_DEVICE")

PRELUDE = """
import json, os, sys, warnings
sys.path[:0] = [{here!r}, {root!r}]
def report(**kw):
    print(json.dumps(kw, default=str))
"""


def run_script(*parts: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """Run the script ``parts`` (each dedented) in a fresh interpreter; returns its JSON
    report (the last stdout line that is a JSON object)."""
    full_env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    full_env.update({"TE_FL_ATTN_CUDNN_PROBE": "0", "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    code = PRELUDE.format(here=str(HERE), root=str(ROOT)) + "\n".join(
        textwrap.dedent(part) for part in parts)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=str(ROOT))  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario failed (rc={proc.returncode}):\nstdout:\n"
                             f"{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


@pytest.fixture
def te_script() -> Callable[..., Any]:
    """``te_script(*parts, env=None)``: run a TE scenario in a subprocess, get its report."""
    return run_script

"""Spill guard for the Triton kernel (issue 10, deliverable 3): one kept tile compiled ahead of
time for sm90 with Triton's own compiler and bundled ptxas (no GPU), its spill bytes checked
against the target. The full table is ``benchmarks/bench_kernel_resources.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_kernel_resources.py"


def _ptxas_runs() -> bool:
    try:
        path = triton.knobs.nvidia.ptxas.path
        return subprocess.run([path, "--version"], capture_output=True, timeout=60).returncode == 0
    except Exception:  # noqa: BLE001 - no bundled ptxas, or it cannot run here
        return False


def test_kept_dkdv_tile_for_sm90_d128_bf16_spills_within_target(tmp_path):
    if not _ptxas_runs():
        pytest.skip("Triton's bundled ptxas cannot run on this machine")
    from te_fl_attention.kernels import triton_flash as tf

    # the largest kept dK/dV tile at D=128 (the one closest to the target when measured)
    cfg = max(tf.configs("dkdv", "bf16", 128, 128), key=lambda c: c.block_m * c.block_n)
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--kernels", "dkdv", "--dims", "128", "--dtypes", "bf16",
         "--archs", "90", "--variants", "causal_gqa", "--config", cfg.name, "--kept-only",
         "--jobs", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "kernel_resources configs=1 spilling=0 " + \
        f"max_spill_bytes={json.loads(out.read_text())['max_spill_bytes']}"
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == cfg.name and row["arch"] == 90 and row["registers"] > 0
    assert row["spill_bytes"] <= tf.SPILL_TARGET["dkdv"], row

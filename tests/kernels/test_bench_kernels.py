"""benchmarks/bench_kernels.py on a machine without CUDA: one clear line, exit 0, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU would run the benchmark")
def test_bench_kernels_skips_cleanly_without_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TE_FL_TEST_FAKE_GPU"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "bench_kernels: skipped: no CUDA GPU (torch.cuda.is_available() is False)"
    ]
    assert json.loads((tmp_path / "bench_kernels.json").read_text())["skipped"]


def test_bench_kernels_cases_and_summary():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_kernels as bk
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert (bk.SEQLENS, bk.DIMS) == ((1024, 4096, 8192), (64, 128))
    cases = [{"fwd": {"ratio": r}, "fwdbwd": {"ratio": r / 2}} for r in (0.5, 1.0, float("nan"))]
    assert bk.summary(cases) == ("bench_kernels cases=3 fwd_ratio_min=0.50x fwd_ratio_median="
                                 "0.75x fwdbwd_ratio_min=0.25x fwdbwd_ratio_median=0.38x "
                                 "(best SDPA time / Triton time)")  # fmt: skip

"""benchmarks/bench_measured.py: its core (measured-mode regret) on a fake GPU with tiny configs,
its JSON and summary line, and the clean skip on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_fl_attention import FusedAttnConfig, Selector, measure
from te_fl_attention.kernels import run as runner
from te_fl_attention.probes.flash.probe import FlashAttnProbe
from te_fl_attention.probes.fused.probe import CudnnProbe
from te_fl_attention.probes.triton import TritonFlashProbe
from te_fl_attention.probes.unfused import UnfusedProbe

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_measured.py"
INTERP = not torch.cuda.is_available() and runner.use_interpreter()
TINY = [FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16, dtype="bf16",
                        is_training=False),
        FusedAttnConfig(max_seqlen_q=16, num_heads=4, num_gqa_groups=2, head_dim_qk=32,
                        dtype="bf16", attn_mask_type="causal")]  # fmt: skip


def _bench():
    spec = importlib.util.spec_from_file_location("bench_measured", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gpu_bench(fake_gpu, fake_flash, monkeypatch):
    """The benchmark on a fake H100 with flash-attn 2.8.3 (the double), SDPA's math standing in
    for its cuDNN kernel; the probes stop after their rules (no tiny-run worker)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    real = torch.nn.functional.scaled_dot_product_attention

    def math(*a, **kw):
        with sdpa_kernel(SDPBackend.MATH):
            return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", math)
    monkeypatch.setattr(measure, "REPEATS", {"cuda": (1, 3), "cpu": (1, 3)})  # the interpreter
    mod = _bench()
    probes = (CudnnProbe(graph=False), FlashAttnProbe(run=False), TritonFlashProbe(run=False),
              UnfusedProbe())  # fmt: skip
    monkeypatch.setattr(mod, "Selector", lambda cache: Selector(probes, cache=cache))
    return mod


def test_regret_on_a_fake_gpu(gpu_bench):
    result = gpu_bench.regret(TINY)
    s, rows = result["summary"], result["rows"]
    assert s["configs"] == 2 and len(rows) == 2 and s["timed"] == 2 and s["untimed"] == 0
    for row, c in zip(rows, TINY, strict=True):
        assert row["metric"] == ("fwd_bwd" if c.is_training else "fwd")
        assert {"fused", "fa2", "unfused"} <= set(row["timings_ms"])
        assert row["rule_choice"] == "fused"  # TE's priority on sm90
        assert row["measured_choice"] == row["fastest"] and row["measured_vs_best"] == 0.0
        t = row["timings_ms"]
        assert row["rule_vs_measured"] == pytest.approx(t["fused"] / t[row["fastest"]] - 1)
    none = gpu_bench.regret(TINY, budget_s=0.0)["summary"]  # the budget is spent at once
    assert none["skipped"] == 2 and none["configs"] == 0 and none["timed"] == 0
    line = gpu_bench.summary_line("NVIDIA H100 80GB HBM3", s)
    assert line.startswith("measured_regret gpu=NVIDIA_H100_80GB_HBM3 configs=2 timed=2 ")
    assert "measured_vs_best_max=0.0%" in line and "untimed=0" in line


def test_main_prints_one_line_and_writes_json(gpu_bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_bench, "configs", lambda: TINY)
    assert gpu_bench.main(["--limit", "1", "--out", str(tmp_path) + "/"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("measured_regret gpu=") and "configs=1" in line
    data = json.loads((tmp_path / "bench_measured.json").read_text())
    assert data["summary"]["configs"] == 1 and len(data["rows"]) == 1 and data["gpu"]


def test_skips_cleanly_without_cuda():
    if torch.cuda.is_available():  # pragma: no cover - about a machine without a GPU
        pytest.skip("machine has a GPU")
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == (
        "measured_regret skipped: needs a CUDA GPU (torch.cuda.is_available() is False)")
    assert len(configs := _bench().configs()) == 30 and len(set(configs)) == 30

"""The te-fl-attn CLI, run as a real subprocess (the console script's module)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "te_fl_attention.cli", *args],
                          capture_output=True, text=True, env={**base, **(env or {})},
                          timeout=120)  # fmt: skip


def test_explain_llama_h100_table():
    p = run("explain", "--preset", "llama3-8b", "--device", "h100")
    assert p.returncode == 0, p.stderr
    for name in ("FusedAttention", "FlashAttention", "TritonFlashAttention",
                 "UnfusedDotProductAttention"):  # fmt: skip
        assert name in p.stdout
    assert "chosen: FusedAttention" in p.stdout


def test_explain_json_a100_flash():
    p = run("explain", "--preset", "llama3-8b", "--device", "a100", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["chosen"] == "flash" and data["flash_variant"] == "fa2"
    assert {r["backend"] for r in data["results"]} == {"fused", "flash", "triton", "unfused"}


def test_explain_local_cpu_unfused():
    p = run("explain", "--preset", "llama3-8b", "--device", "local", "--json")
    data = json.loads(p.stdout)
    if data["device"]["sm"] is not None:  # pragma: no cover
        pytest.skip("machine has a GPU")
    assert p.returncode == 0 and data["chosen"] == "unfused"


def test_exit_codes_bad_input_and_no_backend(tmp_path):
    p = run("explain", "--num-heads", "12", "--num-gqa-groups", "5")
    assert p.returncode == 2 and "num_heads=12 is not divisible by num_gqa_groups=5" in p.stderr
    p = run("explain", "--dtype", "fp32", "--device", "t4", env={"NVTE_UNFUSED_ATTN": "0"})
    assert p.returncode == 3 and "no backend supports" in p.stdout
    p = run("explain", "--device", "h999")
    assert p.returncode == 2 and "device='h999'" in p.stderr


def test_config_file_and_flags_override(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_heads": 8, "head_dim_qk": 64, "attn_mask_type": "causal"}))
    p = run("explain", "--config", str(cfg), "--seqlen", "1024", "--window-size", "128,0",
            "--device", "h100", "--json")  # fmt: skip
    data = json.loads(p.stdout)
    assert data["config"]["num_heads"] == 8 and data["config"]["window_size"] == [128, 0]
    assert data["config"]["max_seqlen_kv"] == 1024


def test_device_command():
    p = run("device", "h200:cudnn=9.10.2", "--json")
    data = json.loads(p.stdout)
    assert data["sm"] == 90 and data["cudnn"] == "9.10.2" and data["memory_gib"] == 141.0
    p = run("device", "--list")
    assert "b200" in p.stdout and p.returncode == 0

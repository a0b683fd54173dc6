"""``scripts/gpu_acceptance.sh``: its dry run (what CI runs), its refusal without a GPU, and a
real run of some of its steps on CPU through the hardware seam (``tests/fakegpu``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakegpu import FakeGPU

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.sh"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)  # fmt: skip


def test_dry_run_lists_every_step_within_eight_minutes() -> None:
    p = _run("--dry-run")
    assert p.returncode == 0, p.stderr
    steps = re.findall(r"^step (\S+)\s+budget=\s*(\d+)s", p.stdout, re.M)
    names = [n for n, _ in steps]
    assert names == ["install", "explain_local", "pytest_gpu", "cudnn_agreement", "te_decisions",
                     "graph_diff", "te_dpa", "bench_kernels", "bench_measured",
                     "flash_tiny"]  # fmt: skip
    total = sum(int(b) for _, b in steps)
    assert total <= 480 and f"budget_s={total}" in p.stdout
    for script in re.findall(r"\$PY ((?:scripts|benchmarks)/\S+\.py)", p.stdout):
        assert (ROOT / script).is_file(), script


@pytest.mark.parametrize("script", ["scripts/gpu/cudnn_agreement.py", "scripts/gpu/te_decisions.py",
                                    "scripts/gpu/graph_diff.py", "scripts/gpu/te_dpa.py",
                                    "scripts/gpu/flash_tiny.py", "benchmarks/bench_kernels.py",
                                    "benchmarks/bench_measured.py"])
def test_every_step_script_parses_its_arguments(script: str) -> None:
    p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--out" in p.stdout


def test_without_a_gpu_nothing_runs_and_it_says_why() -> None:
    p = _run("--out", "/nonexistent/never-written")
    assert p.returncode == 2
    assert "no CUDA GPU" in p.stderr and not Path("/nonexistent/never-written").exists()


def test_steps_run_through_the_seam_and_write_one_json(tmp_path: Path) -> None:
    """install, explain_local and flash_tiny for real on a (presented) H100 with the flash-attn
    test double: each prints its step line; the JSON holds each step's summary and results."""
    env = FakeGPU("h100").child_env(flash=True)
    env["PYTHON"] = sys.executable
    p = _run("--only", "install,explain_local,flash_tiny", "--out", str(tmp_path), env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = dict(re.findall(r"^gpu_acceptance step=(\S+) rc=0 .*summary=\"(.*)\"$", p.stdout,
                            re.M))  # fmt: skip
    assert set(lines) == {"install", "explain_local", "flash_tiny"}
    assert "gpu=NVIDIA_H100_80GB_HBM3" in lines["install"]
    assert lines["explain_local"] == "chosen: FusedAttention"
    assert lines["flash_tiny"].startswith("flash_tiny fa2=5/5")
    assert "gpu_acceptance steps=3 passed=3 skipped=0 failed=0" in p.stdout
    data = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    steps = {s["step"]: s for s in data["steps"]}
    assert steps["flash_tiny"]["results"]["flash_tiny.json"]["device"] == "NVIDIA H100 80GB HBM3"
    assert all(s["seconds"] <= s["budget"] for s in data["steps"])

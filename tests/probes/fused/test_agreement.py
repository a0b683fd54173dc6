"""``scripts/gpu/cudnn_agreement.py`` (real handle vs deviceless descriptor) on CPU.

The comparison is a pure function of cuDNN's answers (tested with made-up answers); the whole
script runs in a child process that sees an H100 through ``tests/fakegpu`` with a fake cuDNN
handle over the real deviceless planner (see ``test_local.py`` for why a child).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fakegpu import FakeGPU

from te_fl_attention.probes.fused import worker as cudnn_worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cudnn") is None, reason="needs the [cudnn] extra (CI installs it)"
)
ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "scripts" / "gpu"
sys.path.insert(0, str(SCRIPTS))

import cudnn_agreement as agreement  # noqa: E402


def answer(supported=True, decided=True, plans=None, code=None, mode="deviceless", **kw):
    return {"supported": supported, "decided": decided, "code": code, "mode": mode,
            "plans": {"fwd": ["eng9"]} if plans is None else plans, "graph": kw.get("graph"),
            "step": kw.get("step"), "summary": kw.get("summary")}  # fmt: skip


def test_compare_row_counts_verdicts_and_plans_apart():
    real = answer(mode="device")
    same = agreement.compare_row("base", {"head_dim_qk": 64}, real, answer(), answer())
    assert same["agree"] and same["plans_same"] and same["real_mode"] == "device"
    other_plans = agreement.compare_row("base", {}, real, answer(),
                                        answer(plans={"fwd": ["eng8"]}))  # fmt: skip
    assert other_plans["agree"] and other_plans["plans_differ"] == ["catalog"]
    refused = answer(False, graph="bwd", step="check_support", summary="No valid engine")
    dis = agreement.compare_row("mla", {"head_dim_qk": 192}, real, refused, None)
    assert not dis["agree"] and dis["verdicts"] == {"real": "supported", "captured": "refused"}
    undecided = agreement.compare_row(
        "fp8", {}, answer(False, False, code="cudnn.unsupported_by_probe"),
        answer(False, False, code="cudnn.unsupported_by_probe"), None)  # fmt: skip
    assert undecided["agree"] and undecided["verdicts"]["real"] == "undecided:" \
        "cudnn.unsupported_by_probe"  # fmt: skip
    lines = agreement.report_lines([same, other_plans, dis, undecided])
    assert lines[-1] == "cudnn_agreement configs=4 agree=3 disagree=1"
    assert lines[-2] == "cudnn_plans configs=4 same=3 differ=1"
    assert lines[0].startswith('disagree mla {"head_dim_qk":192}: real=supported; '
                               "captured=refused at bwd.check_support (No valid engine)")
    assert any(ln.startswith("plans base real=") and "catalog=" in ln for ln in lines)


def test_catalog_twin_by_name_then_by_shape():
    from fakegpu import descriptor

    assert agreement.catalog_twin(descriptor("h200"))[0] == "h200"
    renamed = {**descriptor("h200"), "deviceName": "NVIDIA H200 NVL-ish"}
    assert agreement.catalog_twin(renamed)[0] == "h200"  # sm90, 132 SMs, nearest memory
    assert agreement.catalog_twin({**renamed, "multiProcessorCount": 7}) == (None, None)
    with pytest.raises(agreement.SetupError):
        agreement.catalog_twin(renamed, "nope")


def test_dry_run_lists_at_least_40_configs(capsys):
    assert agreement.main(["--dry-run", "--out", "/nonexistent"]) == 0
    out = capsys.readouterr().out.splitlines()
    n = int(out[0].split("dry-run: ")[1].split()[0])
    assert n >= 40 and len(out) == n + 1
    families = {ln.split(":")[0].strip() for ln in out[1:]}
    assert {"thd", "bias", "dropout", "mla", "window", "gqa", "kv_cache", "fp8",
            "deterministic", "softmax"} <= families  # fmt: skip


def test_no_gpu_is_a_setup_error(capsys):
    assert agreement.main(["--limit", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_worker_without_a_real_driver_is_a_setup_error(fake_gpu, monkeypatch, capsys):
    """The (stub-driver) worker plans deviceless even when asked for a real handle: the
    comparison would compare the descriptor with itself, so it refuses to run."""
    from te_fl_attention.workers import WorkerPool

    pool = WorkerPool(lambda device: cudnn_worker.CudnnWorker(device=device))
    monkeypatch.setattr(cudnn_worker, "_POOL", pool)
    assert agreement.main(["--family", "mla", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    pool.close_all()
    assert "did not plan with a real handle (mode=deviceless" in err and "stub" in err


CHILD = r"""
import json, sys
import pytest
import fakegpu
sys.path.insert(0, sys.argv[1])
import cudnn_agreement
from te_fl_attention.probes.fused import graph as fused_graph

gpu = sys.modules["te_fl_fake_gpu_installed"].gpu
mp = pytest.MonkeyPatch()
fakegpu.fake_cudnn_handle(mp, gpu)
args = ["--in-process", "--family", "mla", "--family", "thd", "--out", sys.argv[2]]
stub_rc = cudnn_agreement.main(args)  # the stub driver: no real handle, a setup error
fused_graph.backend_status()["driver"] = "real"  # what a machine with a GPU driver reports
rc = cudnn_agreement.main(args)
print("RESULT " + json.dumps({"stub_rc": stub_rc, "rc": rc}))
"""


def test_agreement_runs_in_process_through_the_seam(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(SCRIPTS), str(tmp_path)],
                       env=FakeGPU("h100").child_env(), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    assert json.loads(lines[-1][7:]) == {"stub_rc": 2, "rc": 0}
    data = json.loads((tmp_path / "cudnn_agreement.json").read_text())
    n = len([1 for f, _ in agreement.select(["mla", "thd"], None)])
    assert data["configs"] == n == 7 and data["gpu"] == "NVIDIA H100 80GB HBM3"
    assert data["catalog"] == "h100" and data["captured"]["_captured"] == "cuda-bindings"
    # the fake handle plans with the same device properties: everything agrees
    assert (data["agree"], data["disagree"], data["plans_differ"]) == (n, 0, 0)
    assert {r["real_mode"] for r in data["rows"]} == {"device"}
    for row in data["rows"]:
        assert row["answers"]["captured"]["mode"] == row["answers"]["catalog"]["mode"] \
            == "deviceless"  # fmt: skip
    assert p.stdout.splitlines()[-2] == f"cudnn_agreement configs={n} agree={n} disagree=0"

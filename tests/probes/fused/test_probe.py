"""FusedAttention decided by cuDNN: graph_build verdicts, plans, rule drift, predictions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.device import profile
from te_fl_attention.presets import preset
from te_fl_attention.probes import default_probes
from te_fl_attention.probes.fused import probe as fused_probe

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cudnn") is None, reason="needs the [cudnn] extra (CI installs it)"
)
PROBE = fused_probe.CudnnProbe(graph=True)


def probe(device: str, **kw):
    return PROBE.probe(FusedAttnConfig(**kw), profile(device))


def test_llama_h100_decided_by_graph_build_with_plans():
    d = Selector(default_probes()).decide(FusedAttnConfig(**preset("llama3-8b")), "h100",
                                          Policy())  # fmt: skip
    fused = d.result("fused")
    assert d.chosen == "fused" and fused.stage == "graph_build"
    assert fused.detail["plans"]["fwd"] and fused.detail["plans"]["bwd"]
    assert fused.evidence.startswith("cudnn 9.") and "deviceless" in fused.evidence


def test_refusal_quotes_cudnn():
    r = probe("h100", head_dim_qk=63, num_heads=8)
    assert not r.supported and r.stage == "graph_build"
    assert r.reasons[0].code == "cudnn.not_supported"
    assert "hidden_dim should be multiple of 8" in r.reasons[0].message
    assert r.reasons[0].observed == "fwd.validate"


def test_backward_graph_refusal_on_ampere_d256():
    r = probe("a100", head_dim_qk=256)
    assert not r.supported and "bwd" in r.reasons[0].observed
    assert probe("a100", head_dim_qk=256, is_training=False).supported  # forward-only builds


@pytest.mark.parametrize(
    "device, kw, rule_code",
    [
        ("h100", dict(attn_mask_type="causal", window_size=(128, 0), max_seqlen_q=256,
                      max_seqlen_kv=512), "cudnn_table.window_top_left_cross"),
    ],
)  # fmt: skip
def test_rule_drift_recorded_and_cudnn_wins(device, kw, rule_code):
    r = probe(device, **kw)
    assert r.supported and r.stage == "graph_build"
    assert r.detail["rule_drift"] == {"rules": "refused", "cudnn": "accepted",
                                      "rule_codes": [rule_code]}  # fmt: skip
    d = Selector(default_probes()).decide(FusedAttnConfig(**kw), device, Policy())
    assert d.detail["rule_drift"]["fused"]["cudnn"] == "accepted"


def test_blackwell_dropout_with_bias_refused_by_tes_graph():
    # TE 2.20.2's backward graph carries dBias for this [1, h, s, s] bias (requires_grad or
    # not), which cuDNN refuses with dropout on sm100. (Before the probe built TE's graph it had
    # no dBias here, cuDNN accepted it and this was recorded as rule drift.)
    r = probe("b200", dropout=0.1, bias_type="post_scale_bias", max_seqlen_q=256)
    assert not r.supported and r.stage == "graph_build"
    assert r.reasons[0].code == "cudnn.not_supported"
    assert r.reasons[0].observed == "bwd.create_execution_plans"
    assert "With dropout, this engine only supports fprop inference" in r.reasons[0].message


def test_python_side_rules_stay_binding():
    r = probe("h100", dtype="fp32", is_training=False)  # cuDNN would build it; TE never asks
    assert not r.supported and r.stage == "rule" and r.reasons[0].code == "fused.dtype"


def test_other_cudnn_version_is_predicted():
    r = probe("h100:cudnn=9.10.2")
    assert r.stage == "rule" and r.detail["predicted"]
    assert "cannot answer for cuDNN 9.10.2" in r.detail["graph_note"]


def test_without_cudnn_frontend_the_table_stands(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(fused_probe.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cudnn" else real(name, *a))  # fmt: skip
    r = probe("h100")
    assert r.supported and r.stage == "rule" and r.detail["predicted"]
    assert "not installed" in r.detail["graph_note"]


def test_explain_cli_shows_graph_stage_and_cudnn_message():
    p = subprocess.run([sys.executable, "-m", "te_fl_attention.cli", "explain", "--device", "h100",
                        "--head-dim-qk", "63", "--num-heads", "8", "--json"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    data = json.loads(p.stdout)
    fused = next(r for r in data["results"] if r["backend"] == "fused")
    assert fused["stage"] == "graph_build" and not fused["supported"]
    assert "hidden_dim should be multiple of 8" in fused["reasons"][0]["message"]


# ------------------------------------------------------------------------------------- GPU only
GPU_CONFIGS = [
    dict(head_dim_qk=d, attn_mask_type=m, is_training=t)
    for d in (64, 128, 256) for m in ("no_mask", "causal") for t in (True, False)
] + [
    dict(head_dim_qk=192, head_dim_v=128, attn_mask_type="causal"),
    dict(num_gqa_groups=2, attn_mask_type="causal"),
    dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal"),
    dict(attn_mask_type="causal_bottom_right", max_seqlen_q=128, max_seqlen_kv=512),
    dict(attn_mask_type="causal", window_size=(64, 0)),
    dict(dropout=0.1),
    dict(bias_type="post_scale_bias"),
    dict(softmax_type="learnable"),
]  # fmt: skip


@pytest.mark.gpu
def test_real_handle_agrees_with_deviceless_on_this_gpu():
    """On the local GPU, cuDNN's verdict with a real handle equals its deviceless verdict for
    the descriptor captured from that GPU, and for its catalog twin's typed descriptor when the
    catalog has one (``h200`` on an H200). Plan lists are printed, not asserted. **Never ran on
    a GPU** (none was lent while writing it); ``scripts/gpu/cudnn_agreement.py`` is the
    acceptance run's larger version of this check."""
    from te_fl_attention.descriptors import (
        CATALOG_NAMES,
        _load_text,
        capture_local_descriptor,
        current_ordinal,
        descriptor_sm,
    )
    from te_fl_attention.probes.fused.worker import get_worker

    ordinal = current_ordinal()
    captured = capture_local_descriptor(ordinal)
    sm = descriptor_sm(captured)
    typed = [json.loads(_load_text(n)) for n in CATALOG_NAMES]
    twin = next((d for d in typed if d["deviceName"] == captured["deviceName"]), None)
    worker = get_worker(ordinal)
    rows, mismatches = [], []
    for kw in GPU_CONFIGS:
        cfg = FusedAttnConfig(**kw).to_dict()
        real = worker.probe(cfg, captured, sm, timeout_s=300, use_real_gpu=True)
        assert real["mode"] == "device", real  # a real handle planned, not the descriptor
        others = {"captured": worker.probe(cfg, captured, sm, timeout_s=300)}
        if twin is not None:
            others["catalog"] = worker.probe(cfg, twin, descriptor_sm(twin), timeout_s=300)
        for which, r in others.items():
            assert r["mode"] == "deviceless", r
            if (r["decided"], r["supported"]) != (real["decided"], real["supported"]):
                mismatches.append((kw, which, real["summary"], r["summary"]))
        rows.append({"config": kw, "real": real["supported"], "real_plans": real["plans"],
                     **{w: (r["supported"], r["plans"]) for w, r in others.items()}})
    print(json.dumps({"gpu": captured["deviceName"], "twin": twin and twin["_catalog"],
                      "rows": rows}, indent=1, default=str))  # fmt: skip
    assert mismatches == []

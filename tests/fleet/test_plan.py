"""plan() (fleet/plan.py): configs x device types, verified vs predicted, JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fleet_testutil import FP32, LLAMA, SWA, real_gpu

from te_fl_attention import Selector
from te_fl_attention.cache import CacheKey, ProbeCache
from te_fl_attention.cache.keys import versions_key
from te_fl_attention.device import profile
from te_fl_attention.fleet import PREDICTED, VERIFIED, plan
from te_fl_attention.probes import default_probes


def test_matrix_and_summary(sel):
    p = plan({"llama": LLAMA, "fp32": FP32}, ["a100", "h100", "t4"], selector=sel)
    assert p.table() == [
        ["config", "a100", "h100", "t4"],
        ["llama", "FlashAttention 2 (predicted)", "FusedAttention (predicted)",
         "UnfusedDotProductAttention (predicted)"],
        ["fp32", "TritonFlashAttention (predicted)", "TritonFlashAttention (predicted)",
         "UnfusedDotProductAttention (predicted)"],
    ]  # fmt: skip
    t4 = p.cell("llama", "t4")
    assert dict(t4.refusals())["fused"] == (
        "FusedAttention needs compute capability >= sm80 (found sm75)")
    summary = p.summary()
    assert "on t4 2 configs fall back to unfused: llama, fp32" in summary
    assert "on a100, h100 1 config runs our Triton kernel: fp32" in summary
    assert summary[-1].startswith("0 of 6 answers verified")


def _store_real_rows(cache, sel, config, real, *, past_rule=True):
    """What a real GPU machine leaves in a shared cache: its own device JSON and stack."""
    raw, _ = sel.probe_all(config, profile("h100"))
    vk = versions_key(real, probe_env={"node": "gpu-7"})
    rows = []
    for r in raw:
        if r.backend == "fused" and past_rule:
            r = dataclasses.replace(r, stage="graph_build", evidence="cudnn 9.10.2 graph (real)")
        rows.append((CacheKey(config.key(), r.backend, real.fingerprint(), vk), r,
                     config.to_dict(), real.to_dict()))
    cache.put_many(rows)


def test_verified_from_rows_a_real_gpu_left_in_the_cache(tmp_path):
    cache = ProbeCache(tmp_path / "p.sqlite")
    sel = Selector(default_probes(graph=False), cache=cache)
    _store_real_rows(cache, Selector(default_probes(graph=False)), LLAMA,
                     real_gpu(cudnn="9.10.2"))
    _store_real_rows(cache, Selector(default_probes(graph=False)), FP32, real_gpu(),
                     past_rule=False)  # rules only: not proof
    probes = sel.stats["probes"]
    p = plan({"llama": LLAMA, "fp32": FP32}, ["h100", "h200", "h100:cudnn=9.10.2",
                                              "h100:cudnn=9.8.0"], selector=sel)
    status = {k: c.status for k, c in p.cells.items()}
    assert status == {
        ("llama", "h100"): VERIFIED, ("llama", "h200"): PREDICTED,
        ("llama", "h100:cudnn=9.10.2"): VERIFIED, ("llama", "h100:cudnn=9.8.0"): PREDICTED,
        ("fp32", "h100"): PREDICTED, ("fp32", "h200"): PREDICTED,
        ("fp32", "h100:cudnn=9.10.2"): PREDICTED, ("fp32", "h100:cudnn=9.8.0"): PREDICTED,
    }  # fmt: skip
    cell = p.cell("llama", "h100")
    assert cell.evidence.startswith("probed on NVIDIA H100 80GB HBM3 (cuDNN 9.10.2)")
    assert cell.decision.device.name == "NVIDIA H100 80GB HBM3" and cell.chosen == "fused"
    # the verified cell was replayed, not probed: only the 6 predicted cells probed
    assert sel.stats["probes"] - probes == 6 * 4
    assert "2 of 8 answers verified" in p.summary()[-1]
    cache.close()


def test_to_dict_is_json(sel):
    p = plan({"swa": SWA}, ["h100", "b200"], selector=sel)
    d = json.loads(json.dumps(p.to_dict()))
    assert [c["device"] for c in d["cells"]] == ["h100", "b200"]
    cell = d["cells"][0]
    assert cell["status"] == "predicted" and cell["chosen"] == "fused"
    assert {r["backend"] for r in cell["refusals"]} == {"flash", "triton"}
    assert d["uniform"][0]["chosen"] == "fused"
    assert d["devices"][0]["device"]["sm"] == 90


def test_plan_rejects_empty_input(sel):
    with pytest.raises(ValueError):
        plan([], ["h100"], selector=sel)
    with pytest.raises(ValueError):
        plan([LLAMA], ["h900"], selector=sel)

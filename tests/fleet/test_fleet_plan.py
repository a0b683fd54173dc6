"""plan(): configs x device types, verified vs predicted, the uniform choice, JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.cache import CacheKey, ProbeCache
from te_fl_attention.cache.keys import versions_key
from te_fl_attention.device import CATALOG, profile
from te_fl_attention.fleet import (
    PREDICTED,
    VERIFIED,
    common_choice,
    device_type,
    plan,
    short_reason,
)
from te_fl_attention.presets import preset
from te_fl_attention.probes import default_probes

LLAMA = FusedAttnConfig(**preset("llama3-8b"))
SWA = FusedAttnConfig(**preset("gpt-oss-120b-swa"))
FP32 = FusedAttnConfig(dtype="fp32", num_heads=8)


@pytest.fixture
def sel():
    return Selector(default_probes(graph=False))


def real_gpu(name="NVIDIA H100 80GB HBM3", base="h100", memory=79.1, **versions):
    dev = profile(base).with_overrides(versions) if versions else profile(base)
    return dataclasses.replace(dev, name=name, source="local", memory_gib=memory)


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


def test_uniform_names_the_winner_and_why_the_others_lost(sel):
    u = plan([LLAMA], ["a100", "h100"], selector=sel).uniform()
    (name, choice), = u.items()
    assert name.startswith("32h/8kv d128")  # unnamed configs are described
    # fused is 3rd on sm80, flash is 2nd on sm90: flash's worst place wins
    assert (choice.chosen, choice.flash_variant) == ("flash", "fa2")
    assert choice.why[0].startswith("FlashAttention 2: supported on every device")
    assert any(w.startswith("FusedAttention: supported on every device but ranked lower")
               for w in choice.why)
    assert choice.per_device == {"a100": "FlashAttention 2", "h100": "FusedAttention"}


def test_uniform_needs_a_flash_flavour_common_to_every_device(sel):
    pol = Policy(fused=False, triton=False, unfused=False)
    devs = ["a100", "b200:fa2=none,fa4=4.0.0b36"]
    chosen, flavour, why = common_choice(
        {d: sel.decide(LLAMA, d, pol) for d in devs})
    assert chosen is None and flavour is None
    assert any("no flash-attn flavour is supported on every device (a100: fa2; "
               "b200:fa2=none,fa4=4.0.0b36: fa4)" in w for w in why)
    u = plan([LLAMA], devs, policy=pol, selector=sel).uniform()
    assert next(iter(u.values())).label == "no backend"


def test_short_reason_prefers_the_installed_flavour(sel):
    d = sel.decide(FP32, "a100", Policy(triton=False))
    want = "qkv_dtype = fp32 is not supported by FlashAttention 2"
    assert short_reason(d.result("flash")) == want
    d = sel.decide(LLAMA, "h100", Policy(flash=False))
    assert short_reason(d.result("flash")).startswith("disabled by NVTE_FLASH_ATTN=0")


def test_device_type_matches_real_gpus_to_the_catalog():
    assert device_type(real_gpu()) == "h100"
    assert device_type(real_gpu("NVIDIA H200", "h200", 139.8)) == "h200"
    assert device_type(dataclasses.replace(real_gpu(), sm_count=114, name="H100 PCIe")) == \
        "H100 PCIe"  # fmt: skip
    assert all(device_type(d) == n for n, d in CATALOG.items())


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

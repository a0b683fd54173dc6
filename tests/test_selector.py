"""Selector + policy end to end: the decisions the README promises, memo behaviour."""

from __future__ import annotations

import pytest

from te_fl_attention import FusedAttnConfig, NoBackendError, Policy, Selector, prefer
from te_fl_attention.device import profile
from te_fl_attention.presets import preset

LLAMA = FusedAttnConfig(**preset("llama3-8b"))


def decide(config, device, **policy):
    return Selector().decide(config, device, Policy(**policy))


def test_llama_h100_picks_fused_and_keeps_every_candidate():
    d = decide(LLAMA, "h100")
    assert d.chosen == "fused" and d.detail["fused_sub_backend"] == 1
    assert [r.backend for r in d.results] == ["fused", "flash", "triton", "unfused"]
    assert d.result("flash").supported  # rejected by priority, not by a rule: still recorded
    assert d.order[:2] == ("fused", "flash")


def test_llama_a100_picks_flash_attention_2():
    d = decide(LLAMA, "a100")
    assert d.chosen == "flash" and d.detail["flash_variant"] == "fa2"
    # without flash-attn, our Triton kernel is next in the flash tier (sm80: flash tier first)
    assert decide(LLAMA, "a100:fa2=none").chosen == "triton"
    assert decide(LLAMA, "a100:fa2=none", triton=False).chosen == "fused"


def test_llama_local_cpu_picks_unfused_with_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else Triton runs here, interpreted
    d = decide(LLAMA, profile("local"))
    if d.device.has_gpu:  # pragma: no cover - this test is about a machine without a GPU
        pytest.skip("machine has a GPU")
    assert d.chosen == "unfused"
    for name in ("fused", "flash", "triton"):
        assert any(r.code == "device.no_gpu" for r in d.result(name).reasons), name


def test_fa3_and_fa4_precedence():
    assert decide(LLAMA, "h100:fa3=3.0.0b1", fused=False).detail["flash_variant"] == "fa3"
    assert decide(LLAMA, "b200:fa4=4.0.0b36", fused=False).detail["flash_variant"] == "fa4"
    # preferring a flavour picks it when supported
    d = decide(LLAMA, "b200:fa4=4.0.0b36", fused=False, prefer=("fa2",))
    assert d.detail["flash_variant"] == "fa2"


def test_fa4_on_sm90_when_fa3_disabled():
    dev = "h100:fa3=3.0.0b1,fa4=4.0.0b36"
    assert decide(LLAMA, dev, fused=False).detail["flash_variant"] == "fa3"
    # TE drops FA4 "to prefer FA3" only while FA3 is enabled
    assert decide(LLAMA, dev, fused=False, fa3=False).detail["flash_variant"] == "fa4"


def test_env_switches_are_policy_reasons():
    d = Selector().decide(LLAMA, "h100", Policy.from_env({"NVTE_FUSED_ATTN": "0"}))
    assert d.chosen == "flash"
    assert d.result("fused").reasons[0].stage == "policy"
    d = Selector().decide(LLAMA, "h100", Policy.from_env({"NVTE_FUSED_ATTN": "0",
                                                          "NVTE_FLASH_ATTN": "0"}))  # fmt: skip
    assert d.chosen == "unfused"
    with pytest.raises(ValueError, match="NVTE_FLASH_ATTN='yes'"):
        Policy.from_env({"NVTE_FLASH_ATTN": "yes"})


def test_force_unsupported_raises_with_its_reasons():
    cfg = FusedAttnConfig(dtype="fp32")
    with pytest.raises(NoBackendError) as err:
        Selector().select(cfg, "h100", Policy(), force="fused")
    assert "fused.dtype" not in str(err.value)  # humans get sentences...
    assert "qkv_dtype = fp32" in str(err.value)
    assert err.value.decision.result("fused").reasons[0].code == "fused.dtype"  # ...code too


def test_unknown_backend_name_raises():
    with pytest.raises(ValueError, match="backend='flashinfer'"):
        Selector().decide(LLAMA, "h100", Policy(), force="flashinfer")
    with pytest.raises(ValueError, match="backend='xformers'"), prefer("xformers"):
        pass


def test_prefer_context_manager_changes_order():
    with prefer("unfused"):
        d = Selector().decide(LLAMA, "h100", Policy.from_env({}))
    assert d.chosen == "unfused" and d.order[0] == "unfused"
    assert Selector().decide(LLAMA, "h100", Policy.from_env({})).chosen == "fused"


def test_memo_hit_returns_same_decision():
    s = Selector()
    first = s.decide(LLAMA, "h100", Policy())
    again = s.decide(FusedAttnConfig(**preset("llama3-8b")), "h100", Policy())
    assert again is first and s.stats["memo_hits"] == 1 and s.stats["probes"] == 4
    s.decide(LLAMA, "h100", Policy(fused=False))  # a new policy reuses probe results
    assert s.stats["probes"] == 4


def test_no_backend_at_all():
    pol = Policy(unfused=False, triton=False)
    d = Selector().decide(FusedAttnConfig(dtype="fp32"), "h100", pol)
    assert d.chosen is None
    with pytest.raises(NoBackendError, match="no attention backend supports"):
        Selector().select(FusedAttnConfig(dtype="fp32"), "h100", pol)


def test_decision_json_round_trip_has_every_result():
    import json

    d = decide(LLAMA, "h100")
    data = json.loads(json.dumps(d.to_dict()))
    assert data["chosen"] == "fused" and len(data["results"]) == 4
    assert data["config_key"] == LLAMA.key()


class _Raises:
    """A probe with a bug: it raises instead of returning a verdict."""

    name = "fused"

    def rules(self, config, device):
        return []

    def probe(self, config, device):
        raise AttributeError("'NoneType' object has no attribute 'items'")


def test_a_probe_that_raises_is_that_candidates_refusal():
    from te_fl_attention.cache import MemoryCache
    from te_fl_attention.cli.render import render, summary
    from te_fl_attention.probes.flash.probe import FlashAttnProbe
    from te_fl_attention.probes.triton import TritonFlashProbe
    from te_fl_attention.probes.unfused import UnfusedProbe

    cache = MemoryCache()
    sel = Selector((_Raises(), FlashAttnProbe(), TritonFlashProbe(), UnfusedProbe()), cache=cache)
    d = sel.decide(LLAMA, "h100", Policy())
    fused = d.result("fused")
    assert not fused.supported and fused.stage == "probe"
    (why,) = fused.reasons
    assert why.code == "probe.error" and why.stage == "probe" and why.observed == "AttributeError"
    assert why.message == ("the FusedAttention probe raised AttributeError: 'NoneType' object "
                           "has no attribute 'items'")
    assert d.chosen == "flash"  # the others decide as usual
    assert len(cache) == 3  # the crash is not stored: the next job probes again
    assert "probe raised AttributeError" in summary(d)["refused"]["fused"]
    render(d, file=__import__("io").StringIO())


def test_a_raising_flash_probe_has_no_variants_and_is_refused():
    class RaisesFlash(_Raises):
        name = "flash"

    from te_fl_attention.probes.fused.probe import CudnnProbe
    from te_fl_attention.probes.triton import TritonFlashProbe
    from te_fl_attention.probes.unfused import UnfusedProbe

    probes = (CudnnProbe(graph=False), RaisesFlash(), TritonFlashProbe(), UnfusedProbe())
    d = Selector(probes).decide(LLAMA, "a100", Policy())
    flash = d.result("flash")
    assert d.chosen == "triton" and not flash.supported and flash.variants == ()
    assert flash.reasons[0].code == "probe.error" and "FlashAttention probe raised" in \
        flash.reasons[0].message  # fmt: skip

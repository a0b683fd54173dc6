"""decide(config, device, results, policy): a pure function of its inputs."""

from __future__ import annotations

import dataclasses

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.decide import decide
from te_fl_attention.device import profile
from te_fl_attention.probes import default_probes
from te_fl_attention.reasons import ProbeResult, Reason, combine_variants

CFG = FusedAttnConfig()
NO = (Reason("x.refused", "refused for the test", "rule"),)


def results(fused: bool = True, fa3: bool = True, triton: bool = True) -> list[ProbeResult]:
    flash = combine_variants("flash", (
        ProbeResult("fa4", False, NO), ProbeResult("fa3", fa3, () if fa3 else NO),
        ProbeResult("fa2", True, (), detail={"version": "2.8.3"})))  # fmt: skip
    return [ProbeResult("fused", fused, () if fused else NO, detail={"sub_backend": 1}), flash,
            ProbeResult("triton", triton, () if triton else NO), ProbeResult("unfused", True)]


def test_priority_per_device_from_the_registry():
    h100, a100 = profile("h100"), profile("a100")
    d = decide(CFG, h100, results(), Policy())
    assert (d.chosen, d.order) == ("fused", ("fused", "flash", "triton", "unfused"))
    assert d.detail["fused_sub_backend"] == 1
    d = decide(CFG, a100, results(), Policy())
    assert (d.chosen, d.flash_variant) == ("flash", "fa3")  # FA4 refused: FA3 > FA2
    assert d.order == ("flash", "triton", "fused", "unfused")


def test_policy_filters_and_forces():
    dev = profile("h100")
    d = decide(CFG, dev, results(), Policy(fused=False))
    assert d.chosen == "flash" and d.result("fused").reasons[0].code == "policy.fused_disabled"
    d = decide(CFG, dev, results(), Policy(force="fa2"))
    assert (d.chosen, d.flash_variant, d.order) == ("flash", "fa2", ("flash",))
    d = decide(CFG, dev, results(fused=False, triton=False), Policy(flash=False))
    assert d.chosen == "unfused"
    assert decide(CFG, dev, results(), Policy(force="triton", triton=False)).chosen is None


def test_same_inputs_same_decision_and_inputs_untouched():
    dev, raw = profile("h100"), results()
    before = [dataclasses.replace(r) for r in raw]
    first = decide(CFG, dev, raw, Policy(fused=False), source="recorded")
    again = decide(CFG, dev, raw, Policy(fused=False), source="recorded")
    assert first == again and first.source == "recorded"
    assert raw == before  # filtering made copies; the caller's results are unchanged


def test_the_selector_decides_with_the_same_function():
    sel = Selector(default_probes(graph=False))
    for spec in ("h100", "a100", "t4"):
        dev = profile(spec)
        got = sel.decide(CFG, dev, Policy())
        raw, _ = sel.probe_all(CFG, dev)
        assert got == decide(CFG, dev, raw, Policy(), source=got.source)

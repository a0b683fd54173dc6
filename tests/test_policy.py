"""From rule verdicts to a choice (policy.py): TE's final priority, the NVTE_* switches, force,
prefer, the FP8 emulation waiver."""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention import FusedAttnConfig, NoBackendError, Policy, Selector, prefer
from te_fl_attention.device import profile
from te_fl_attention.reasons import (
    FA4_PREFERS_FA3_CODE,
    FP8_EMULATION_CODE,
    ProbeResult,
    Reason,
    combine_variants,
)

C = FusedAttnConfig
NO_TRITON = Policy(triton=False)  # TE's own three candidates only


def decide(config, spec, policy=NO_TRITON, **kw):
    return Selector().decide(config, profile(spec), policy, **kw)


# ---------------------------------------------------------------------------- final priority
@pytest.mark.parametrize(
    "spec, chosen, variant",
    [
        ("h100", "fused", None),  # sm >= 90: FusedAttention first
        ("h200", "fused", None),
        ("b200", "fused", None),
        ("rtx5090", "fused", None),
        ("a100", "flash", "fa2"),  # below sm90: FlashAttention first
        ("l40s", "flash", "fa2"),
        ("rtx4090", "flash", "fa2"),
        ("t4", "unfused", None),  # below sm80: neither
    ],
)
def test_te_priority(spec, chosen, variant):
    d = decide(C(), spec)
    assert d.chosen == chosen
    assert d.detail.get("flash_variant") == variant
    sm = profile(spec).sm
    if sm >= 80:  # both fast backends support the plain config: priority alone decides
        assert d.result("fused").supported and d.result("flash").supported
    first = ("fused", "flash") if sm >= 90 else ("flash", "fused")
    assert tuple(b for b in d.order if b in first) == first
    assert d.order[-1] == "unfused"


def test_priority_falls_through_to_the_next_backend():
    assert decide(C(dtype="fp32"), "h100").chosen == "unfused"
    assert decide(C(bias_type="post_scale_bias"), "a100").chosen == "fused"
    assert decide(C(head_dim_qk=36), "h100").chosen == "unfused"  # cuDNN table and FA2 refuse
    d = decide(C(dropout=0.1), "b200:fa4=4.0.0b36", NO_TRITON.with_(fused=False))
    assert d.chosen == "flash" and d.detail["flash_variant"] == "fa2"  # FA4 refuses dropout


# ------------------------------------------------------------------------------ env switches
@pytest.mark.parametrize(
    "env, spec, config, chosen, variant, refused",
    [
        ({}, "h100", {}, "fused", None, None),
        ({"NVTE_FUSED_ATTN": "0"}, "h100", {}, "flash", "fa2", "fused"),
        ({"NVTE_FLASH_ATTN": "0"}, "a100", {}, "fused", None, "flash"),
        ({"NVTE_FLASH_ATTN_V2": "0"}, "a100", {}, "fused", None, "fa2"),
        ({"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"}, "h100", {}, "unfused", None, "fused"),
        ({"NVTE_UNFUSED_ATTN": "0"}, "h100", {"dtype": "fp32"}, None, None, "unfused"),
        ({"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN_V3": "0"}, "h100:fa3=3.0.0b1", {}, "flash",
         "fa2", "fa3"),
        ({"NVTE_FUSED_ATTN": "0"}, "h100:fa3=3.0.0b1", {}, "flash", "fa3", None),
        ({"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN_V4": "0"}, "b200:fa4=4.0.0b36", {}, "flash",
         "fa2", "fa4"),
        ({"NVTE_FUSED_ATTN": "0"}, "b200:fa4=4.0.0b36", {}, "flash", "fa4", None),
    ],
)  # fmt: skip
def test_env_switches(env, spec, config, chosen, variant, refused):
    policy = Policy.from_env({"TE_FL_ATTN_TRITON": "0", **env})
    d = decide(C(**config), spec, policy)
    assert d.chosen == chosen
    assert d.detail.get("flash_variant") == variant
    if refused is not None:
        r = d.result(refused)
        assert not r.supported
        assert r.reasons[0].stage == "policy"
        assert r.reasons[0].code == f"policy.{refused}_disabled"
        assert r.reasons[0].observed == "0" and r.reasons[0].limit == "1"


def test_flash_switch_disables_every_flavour_and_triton():
    p = Policy.from_env({"NVTE_FLASH_ATTN": "0"})
    assert (p.flash, p.fa2, p.fa3, p.fa4, p.triton) == (False,) * 5
    assert (p.fused, p.unfused, p.unfused_fp8_emulation) == (True, True, False)


def test_env_values_are_validated():
    with pytest.raises(ValueError, match="NVTE_FUSED_ATTN"):
        Policy.from_env({"NVTE_FUSED_ATTN": "off"})


# ------------------------------------------------------------------------------------- force
def test_force_an_unsupported_backend_raises_with_its_reasons():
    config = C(dtype="fp32")
    with pytest.raises(NoBackendError) as info:
        Selector().select(config, profile("h100"), NO_TRITON, force="fused")
    decision = info.value.decision
    assert decision.chosen is None and decision.order == ("fused",)
    reasons = decision.result("fused").reasons
    assert [r.code for r in reasons] == ["fused.dtype"]
    assert reasons[0].message in str(info.value)
    assert "FusedAttention" in str(info.value)


def test_force_a_flavour():
    d = decide(C(), "h100:fa3=3.0.0b1", force="fa2")
    assert d.chosen == "flash" and d.detail["flash_variant"] == "fa2"
    fa3 = d.result("fa3")
    assert not fa3.supported and fa3.reasons[0].code == "policy.not_forced"
    with pytest.raises(NoBackendError) as info:
        Selector().select(C(), profile("h100"), NO_TRITON, force="fa3")
    assert "fa3.not_installed" in {r.code for r in info.value.decision.result("fa3").reasons}


def test_force_a_supported_backend_overrides_priority():
    assert decide(C(), "h100", force="unfused").chosen == "unfused"
    assert decide(C(), "a100", force="cudnn").chosen == "fused"


@pytest.mark.parametrize("bad", ["bogus", "flash-attn-5", ""])
def test_unknown_backend_names_raise(bad):
    with pytest.raises(ValueError, match="is not known"):
        Policy(force=bad)
    with pytest.raises(ValueError, match="is not known"):
        Policy(prefer=(bad,))
    with pytest.raises(ValueError, match="is not known"):
        decide(C(), "h100", force=bad)
    with pytest.raises(ValueError, match="is not known"):
        with prefer(bad):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="is not known"):
        Policy.from_env({"TE_FL_ATTN_FORCE": bad or "?"})


# ------------------------------------------------------------------------------------ prefer
def test_prefer_triton_context_manager():
    assert Policy.from_env({}).prefer == ()
    with prefer("triton"):
        policy = Policy.from_env({})
        assert policy.prefer == ("triton",)
        d = Selector().decide(C(), profile("h100"), policy)
        assert d.order[0] == "triton"
        triton = d.result("triton")
        # triton when its rules (and kernel) accept, else TE's own order takes over
        assert d.chosen == ("triton" if triton.supported else "fused")
        with prefer("fa2"):
            assert Policy.from_env({}).prefer == ("fa2", "triton")
        assert Policy.from_env({}).prefer == ("triton",)
    assert Policy.from_env({}).prefer == ()


def test_prefer_falls_back_when_refused():
    with prefer("triton"):
        d = Selector().decide(C(dropout=0.1), profile("h100"), Policy.from_env({}))
    assert d.order[0] == "triton"
    assert "triton.dropout" in {r.code for r in d.result("triton").reasons}
    assert d.chosen == "fused"


def test_prefer_a_flavour_picks_it_when_supported():
    p = NO_TRITON.with_(fused=False, prefer=("fa2",))
    assert decide(C(), "b200:fa4=4.0.0b36", p).detail["flash_variant"] == "fa2"
    assert decide(C(), "b200:fa4=4.0.0b36", p.with_(prefer=())).detail["flash_variant"] == "fa4"


# ------------------------------------------------------------------------- FP8 emulation
def test_unfused_fp8_emulation_waives_the_fp8_reason():
    config = C(fp8=True)  # FP8 DPA on sm80: cuDNN's table and FA2 both refuse it
    d = decide(config, "a100")
    assert d.chosen is None
    assert [r.code for r in d.result("unfused").reasons] == ["fp8.unfused"]
    p = Policy.from_env({"NVTE_UnfusedDPA_Emulate_FP8": "1", "TE_FL_ATTN_TRITON": "0"})
    assert p.unfused_fp8_emulation
    d = decide(config, "a100", p)
    assert d.chosen == "unfused" and d.result("unfused").reasons == ()


def test_emulation_keeps_other_unfused_reasons():
    config = C(fp8=True, softmax_type="off-by-one")
    d = decide(config, "a100", NO_TRITON.with_(unfused_fp8_emulation=True))
    assert [r.code for r in d.result("unfused").reasons] == ["softmax.fp8"]
    assert not d.result("unfused").supported


@pytest.mark.parametrize("var", ["TE_FL_ATTN_TRITON", "TE_FL_ATTN_VERIFY", "TE_FL_ATTN_MEASURE"])
@pytest.mark.parametrize("raw", ["2", "-1", "1 ", "false", "maybe", "١", ""])
def test_policy_our_switches_are_strict(var, raw):
    with pytest.raises(ValueError) as err:
        Policy.from_env({var: raw})
    assert var in str(err.value) and ascii(raw) in str(err.value)
    assert "0 or 1" in str(err.value)


def test_policy_nvte_switches_as_te_parses_them():
    assert Policy.from_env({"NVTE_FUSED_ATTN": " 0"}).fused is False  # int(" 0") == 0
    assert Policy.from_env({"NVTE_FUSED_ATTN": "2"}).fused is True  # truthy, as in TE
    assert Policy.from_env({"NVTE_FLASH_ATTN": "0", "NVTE_FLASH_ATTN_V2": "abc"}).fa2 is False
    with pytest.raises(ValueError, match="NVTE_UNFUSED_ATTN='abc'.*TransformerEngine 2.20.2"):
        Policy.from_env({"NVTE_UNFUSED_ATTN": "abc"})
    # TE compares NVTE_UnfusedDPA_Emulate_FP8 with "1" (a string compare)
    assert Policy.from_env({"NVTE_UnfusedDPA_Emulate_FP8": "1"}).unfused_fp8_emulation
    assert not Policy.from_env({"NVTE_UnfusedDPA_Emulate_FP8": " 1"}).unfused_fp8_emulation


def test_force_unavailable_flavour_lists_its_own_reasons():
    d = Selector().decide(C(), profile("h100"), Policy(), force="fa3")
    assert d.chosen is None
    flash = d.result("flash")
    assert flash.reasons[0].code == "fa3.not_installed"
    with pytest.raises(NoBackendError) as err:
        Selector().select(C(), profile("h100"), Policy(), force="FA3")
    text = str(err.value)
    assert "force=fa3" in text
    assert "FlashAttention 3 (flash-attn-3) is not assumed installed" in text
    assert "FlashAttention 4 (flash-attn-4)" not in text  # not the forced one


# ---------------------------------------------------------------------------- fast paths
def _full(policy: Policy) -> Policy:
    """``policy`` with its pass-through shortcut off: filter() takes its full path."""
    full = copy.copy(policy)
    object.__setattr__(full, "_plain", False)
    return full


_UNITS = ("fused", "flash", "fa4", "fa3", "fa2", "triton", "unfused")
_CODES = (FP8_EMULATION_CODE, FA4_PREFERS_FA3_CODE, "x.refused")


def _unit(name: str, draw) -> ProbeResult:
    if draw(st.booleans()):
        return ProbeResult(name, True)
    return ProbeResult(name, False, (Reason(draw(st.sampled_from(_CODES)), "refused", "rule"),))


@st.composite
def _results(draw) -> list[ProbeResult]:
    flash = combine_variants("flash", tuple(_unit(f, draw) for f in ("fa4", "fa3", "fa2")))
    return [_unit("fused", draw), flash, _unit("triton", draw), _unit("unfused", draw)]


@given(st.frozensets(st.sampled_from(_UNITS)), st.booleans(),
       st.one_of(st.none(), st.sampled_from(_UNITS)),
       st.lists(st.sampled_from(_UNITS), max_size=2), _results())  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_the_filter_shortcut_and_the_untimed_flavour_give_the_full_paths_answers(
        off, emulate, force, prefer, results):  # fmt: skip
    """A policy with nothing off, forced or waived passes every result through unchanged, as its
    full filter would; and a flavour picked without timings (no sort) is the one picked with
    timings that name no flavour, for any policy and results."""
    policy = Policy(off=off, unfused_fp8_emulation=emulate, force=force, prefer=prefer)
    full = _full(policy)
    for r in results:
        assert policy.filter(r) == full.filter(r)
    flash = results[1]
    assert policy.flavour(flash) == policy.flavour(flash, {"no such unit": 1.0})
    if not off and not emulate and force is None:
        assert all(policy.filter(r) is r for r in results)


def test_the_environment_snapshot_follows_variables_set_and_unset(monkeypatch):
    """The snapshot reads every variable with one C call while all are set and with one
    ``dict.get`` each once one is not: either way it holds exactly what ``os.environ`` holds,
    as variables come and go (the policy follows at once)."""
    from te_fl_attention import policy as policy_mod

    names = policy_mod.env_vars()

    def expected():
        return tuple(None if os.environ.get(n) is None else os.fsencode(os.environ[n])
                     for n in names)  # fmt: skip

    for n in names:  # all set: candidates on, nothing forced, preferred, verified or measured
        monkeypatch.setenv(n, "" if n in ("TE_FL_ATTN_FORCE", "TE_FL_ATTN_PREFER") else
                           "0" if n in policy_mod.OTHER_VARS else "1")  # fmt: skip
    steps = [("NVTE_FUSED_ATTN", "0"), ("NVTE_FUSED_ATTN", None), ("NVTE_FLASH_ATTN", None),
             ("NVTE_FUSED_ATTN", "1"), ("NVTE_FLASH_ATTN", "1"), ("NVTE_FUSED_ATTN", "0")]
    for name, value in [(None, None), *steps]:
        if name is not None and value is None:
            monkeypatch.delenv(name)
        elif name is not None:
            monkeypatch.setenv(name, value)
        snap = policy_mod.snapshot()
        assert snap[0] == expected(), (name, value)
        fused_on = os.environ.get("NVTE_FUSED_ATTN", "1") != "0"
        assert Policy.from_env().fused is fused_on, (name, value)

"""Rules TE applies to every backend at once (common.py) and the no-GPU rule: each refuses in
every candidate's probe."""

from __future__ import annotations

import pytest
from rule_cases import SHARED_NAMES, by_name, case_id, check, result_codes

from te_fl_attention.probes import common, triton, unfused
from te_fl_attention.probes.flash import fa2 as flash_fa2
from te_fl_attention.probes.flash import fa3 as flash_fa3
from te_fl_attention.probes.flash import fa4 as flash_fa4
from te_fl_attention.probes.flash import probe as flash_probe
from te_fl_attention.probes.flash import rules as flash_rules
from te_fl_attention.probes.fused import probe as fused_probe
from te_fl_attention.probes.fused import rules as fused_rules

RULES = by_name((*common.ALL_BACKENDS, fused_rules.PYTHON_RULES[0]))
PROBES = {
    "fused": fused_probe.CudnnProbe(),
    "flash": flash_probe.FlashAttnProbe(),
    "triton": triton.TritonFlashProbe(),
    "unfused": unfused.UnfusedProbe(),
}

KV = dict(kv_cache=True, attn_mask_type="padding")

CASES = [
    ("score_mod_bprop_needs_score_mod", {"has_score_mod": True, "has_score_mod_bprop": True},
     "h100", None),
    ("score_mod_bprop_needs_score_mod", {"has_score_mod_bprop": True}, "h100",
     "score_mod.bprop_without_fwd"),
    ("max_logit_with_fp8", {"return_max_logit": True}, "h100", None),
    ("max_logit_with_fp8", {"return_max_logit": True, "fp8": True}, "h100", "max_logit.fp8"),
    ("kv_cache_with_cp", KV, "h100", None),
    ("kv_cache_with_cp", {**KV, "context_parallel": True, "cp_size": 2}, "h100",
     "kv_cache.context_parallel"),
    ("kv_cache_with_fp8_mha", {**KV, "fp8": True}, "h100", None),
    ("kv_cache_with_fp8_mha", {**KV, "fp8_mha": True}, "h100", "kv_cache.fp8_mha"),
    ("kv_cache_thd_padding", {**KV, "qkv_layout": "thd_bshd_bshd"}, "h100", None),
    ("kv_cache_thd_padding", {**KV, "qkv_layout": "thd_bshd_bshd", "pad_between_seqs": True,
                              "fp8": True}, "h100", None),
    ("kv_cache_thd_padding", {**KV, "qkv_layout": "thd_bshd_bshd", "pad_between_seqs": True},
     "h100", "kv_cache.pad_between_seqs"),
    ("requires_gpu", {}, "h100", None),
    ("requires_gpu", {}, "h100:sm=none", "device.no_gpu"),
]  # fmt: skip


# Unfused attention runs on CPU: it has no GPU rule (see test_unfused_runs_without_a_gpu).
PARAMS = [pytest.param(case, b, id=f"{b}:{case_id(case)}") for case in CASES for b in PROBES
          if not (case[0] == "requires_gpu" and b == "unfused")]  # fmt: skip


@pytest.mark.parametrize("case, backend", PARAMS)
def test_rule_in_every_probe(case, backend):
    check(RULES, case, lambda c, d: result_codes(PROBES[backend].probe(c, d)))


def test_shared_rules_are_in_every_probe():
    for name, probe in PROBES.items():
        rules = (
            (*flash_rules.SHARED, *flash_fa2.FA2, *flash_fa3.FA3, *flash_fa4.FA4)
            if name == "flash" else probe.RULES
        )  # fmt: skip
        names = {r.__name__ for r in rules}
        expected = SHARED_NAMES - ({"requires_gpu"} if name == "unfused" else set())
        assert expected <= names, (name, expected - names)


def test_unfused_runs_without_a_gpu():
    from te_fl_attention.config import FusedAttnConfig
    from te_fl_attention.device import profile

    r = PROBES["unfused"].probe(FusedAttnConfig(), profile("h100:sm=none"))
    assert r.supported and r.reasons == ()


def test_every_common_rule_has_cases():
    names = {c[0] for c in CASES}
    assert names == set(RULES) == set(SHARED_NAMES)

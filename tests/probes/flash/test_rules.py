"""FlashAttention rules (shared, FA2, FA3, FA4): accepting and refusing cases per rule, and the
precedence among supported flavours."""

from __future__ import annotations

import pytest
from rule_cases import SHARED_NAMES, assert_covered, by_name, case_id, check, result_codes

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes.flash import fa2 as flash_fa2
from te_fl_attention.probes.flash import fa3 as flash_fa3
from te_fl_attention.probes.flash import fa4 as flash_fa4
from te_fl_attention.probes.flash import probe as flash_probe
from te_fl_attention.probes.flash import rules as flash_rules

RULES = by_name((*flash_rules.SHARED, *flash_fa2.FA2, *flash_fa3.FA3, *flash_fa4.FA4))
PROBE = flash_probe.FlashAttnProbe()

FA3 = "h100:fa3=3.0.0b1"
FA4_90 = "h100:fa4=4.0.0b36"
FA4 = "b200:fa4=4.0.0b36"
THD = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding")
KV = dict(kv_cache=True, attn_mask_type="padding")
PAGED = dict(qkv_layout="paged_kv_bshd_bshd_bshd", page_size=256, attn_mask_type="padding")
CP = dict(context_parallel=True, cp_size=2)
FP8 = dict(fp8=True)
INFER = dict(is_training=False)
CROSS = dict(max_seqlen_kv=256)
ALIBI = dict(bias_type="alibi")

SHARED_CASES = [
    ("fp8_sm120", FP8, "h100", None),
    ("fp8_sm120", FP8, "rtx5090", "fp8.sm120"),
    ("max_logit", {}, "h100", None),
    ("max_logit", {"return_max_logit": True}, "h100", "max_logit.unsupported"),
    ("score_mod", {}, "h100", None),
    ("score_mod", {"has_score_mod": True}, "h100", "score_mod.unsupported"),
    ("kv_cache_sm120", KV, "b200", None),
    ("kv_cache_sm120", KV, "rtx5090", "kv_cache.sm120"),
    ("softmax_type", {}, "h100", None),
    ("softmax_type", {"softmax_type": "learnable"}, "h100", "softmax.unsupported"),
    ("context_parallel", CP, "h100", None),
    ("context_parallel", {**CP, "bias_type": "post_scale_bias"}, "h100", None),
    ("context_parallel", {**CP, **FP8}, "h100", "cp.fp8"),
    ("context_parallel", {**CP, "attn_mask_type": "causal_bottom_right"}, "h100",
     "cp.bottom_right"),
    ("context_parallel", {**CP, **CROSS, "attn_mask_type": "causal"}, "h100", "cp.causal_cross"),
    ("context_parallel", {**CP, **ALIBI}, "h100", "cp.bias_type"),
    ("context_parallel", {**CP, **THD, "bias_type": "post_scale_bias"}, "h100", "cp.thd_bias"),
    ("arbitrary_mask", {}, "h100", None),
    ("arbitrary_mask", {"attn_mask_type": "arbitrary"}, "h100", "mask.arbitrary"),
    ("causal_cross_top_left", {"attn_mask_type": "causal"}, "h100", None),
    ("causal_cross_top_left", {**CROSS, "attn_mask_type": "causal_bottom_right"}, "h100", None),
    ("causal_cross_top_left", {**CROSS, "attn_mask_type": "causal"}, "h100",
     "mask.causal_top_left_cross"),
    ("causal_cross_top_left", {**KV, **CROSS, "attn_mask_type": "padding_causal"}, "h100",
     None),  # a KV cache aligns causal masks bottom-right
    ("window_top_left_cross", {**CROSS, "window_size": (64, 64)}, "h100", None),
    ("window_top_left_cross", {**CROSS, "window_size": (64, 64),
                               "bottom_right_diagonal": False}, "h100", "window.top_left_cross"),
    ("bias", ALIBI, "h100", None),
    ("bias", {"bias_type": "post_scale_bias"}, "h100", "bias.unsupported"),
    ("bias", {"bias_type": "pre_scale_bias"}, "h100", "bias.unsupported"),
    ("bias", {**ALIBI, "bias_shape": "1hss"}, "h100", "bias.unsupported"),
]  # fmt: skip

FA2_CASES = [
    ("fa2_installed", {}, "a100", None),
    ("fa2_installed", {}, "a100:fa2=none", "fa2.not_installed"),
    ("fa2_version_range", {}, "a100:fa2=2.1.1", None),
    ("fa2_version_range", {}, "a100:fa2=2.0.9", "fa2.version_range"),
    ("fa2_version_range", {}, "a100:fa2=2.8.4", "fa2.version_range"),
    ("fa2_version_range", {}, "b200:fa2=2.7.2", "fa2.version_range"),
    ("fa2_version_range", {}, "b200:fa2=2.7.3", None),
    ("fa2_sm", {}, "a100", None),
    ("fa2_sm", {}, "t4", "fa2.sm"),
    ("fa2_dtype", {"dtype": "fp16"}, "a100", None),
    ("fa2_dtype", {"dtype": "fp32"}, "a100", "fa2.dtype"),
    ("fa2_fp8", {}, "a100", None),
    ("fa2_fp8", FP8, "a100", "fa2.fp8"),
    ("fa2_num_splits", {}, "a100", None),
    ("fa2_num_splits", {"num_splits": 2}, "a100", "fa2.num_splits"),
    ("fa2_softcap", {"softcap": 30.0}, "a100:fa2=2.6.0", None),
    ("fa2_softcap", {"softcap": 30.0}, "a100:fa2=2.5.9", "fa2.softcap_version"),
    ("fa2_softcap", {"softcap": 30.0, "dropout": 0.1}, "a100", "fa2.softcap_dropout"),
    ("fa2_softcap", {"softcap": 30.0, "dropout": 0.1, **INFER}, "a100", None),
    ("fa2_page_size", PAGED, "a100", None),
    ("fa2_page_size", {**PAGED, "page_size": 64}, "a100", "fa2.page_size"),
    ("_fa2_paged_version", PAGED, "a100:fa2=2.5.0", None),
    ("_fa2_paged_version", PAGED, "a100:fa2=2.4.0", "fa2.version"),
    ("fa2_kv_seqlen", {**KV, "max_seqlen_kv": 512}, "a100", None),
    ("fa2_kv_seqlen", {**KV, "max_seqlen_kv": 300}, "a100", "fa2.kv_seqlen"),
    ("fa2_kv_seqlen", {**PAGED, "max_seqlen_kv": 300}, "a100", None),
    ("fa2_head_dim", {"head_dim_qk": 256}, "a100", None),
    ("fa2_head_dim", {"head_dim_qk": 256}, "l40s", "fa2.head_dim"),
    ("fa2_head_dim", {"head_dim_qk": 192, "head_dim_v": 128}, "l40s", None),
    ("fa2_head_dim", {"head_dim_qk": 264}, "a100", "fa2.head_dim"),
    ("fa2_head_dim", {"head_dim_qk": 36}, "a100", "fa2.head_dim"),
    ("fa2_pad_between_seqs", THD, "a100", None),
    ("fa2_pad_between_seqs", {**THD, "pad_between_seqs": True}, "a100", "fa2.pad_between_seqs"),
    ("fa2_alibi_cross", {**ALIBI, **CROSS}, "a100", None),
    ("fa2_alibi_cross", {**ALIBI, **CROSS, "bottom_right_diagonal": False}, "a100",
     "fa2.alibi_cross"),
    ("_fa2_versioned", {"window_size": (64, 64)}, "a100:fa2=2.3.0", None),
    ("_fa2_versioned", {"window_size": (64, 64)}, "a100:fa2=2.2.0", "fa2.version"),
    ("_fa2_versioned", ALIBI, "a100:fa2=2.3.0", "fa2.version"),
    ("_fa2_versioned", {"deterministic": True}, "a100:fa2=2.4.0", "fa2.version"),
    ("_fa2_versioned", {"deterministic": True}, "a100:fa2=2.4.1", None),
]  # fmt: skip

FA3_CASES = [
    ("fa3_installed", {}, FA3, None),
    ("fa3_installed", {}, "h100", "fa3.not_installed"),
    ("fa3_sm", {}, FA3, None),
    ("fa3_sm", {}, "b200:fa3=3.0.0b1", "fa3.sm"),
    ("fa3_dtype", {"dtype": "fp8_e4m3", **FP8}, FA3, None),
    ("fa3_dtype", {"dtype": "fp32"}, FA3, "fa3.dtype"),
    ("fa3_fp8_training", {**FP8, **INFER}, FA3, None),
    ("fa3_fp8_training", FP8, FA3, "fa3.fp8_training"),
    ("fa3_fp8_recipe", {**FP8, **INFER, "fp8_recipe": "current"}, FA3, None),
    ("fa3_fp8_recipe", {**FP8, **INFER, "fp8_recipe": "mxfp8"}, FA3, "fa3.fp8_recipe"),
    ("fa3_softcap", {}, FA3, None),
    ("fa3_softcap", {"softcap": 30.0}, FA3, "fa3.softcap"),
    ("fa3_fp8_kv_cache", {**FP8, **INFER, **KV, "qkv_layout": "thd_bshd_bshd"}, FA3, None),
    ("fa3_fp8_kv_cache", {**FP8, **INFER, **KV}, FA3, "fa3.fp8_kv_cache"),
    ("fa3_head_dims", {"head_dim_qk": 192, "head_dim_v": 128}, FA3, None),
    ("fa3_head_dims", {"head_dim_qk": 64, "head_dim_v": 512}, FA3, None),
    ("fa3_head_dims", {"head_dim_qk": 128, "head_dim_v": 64}, FA3, "fa3.head_dim"),
    ("fa3_head_dims", {"head_dim_qk": 264}, FA3, "fa3.head_dim"),
    ("fa3_dropout", {}, FA3, None),
    ("fa3_dropout", {"dropout": 0.1}, FA3, "fa3.dropout"),
    ("fa3_deterministic_d256", {"deterministic": True, "head_dim_qk": 128}, FA3, None),
    ("fa3_deterministic_d256", {"deterministic": True, "head_dim_qk": 256, **INFER}, FA3, None),
    ("fa3_deterministic_d256", {"deterministic": True, "head_dim_qk": 256}, FA3,
     "fa3.deterministic_d256"),
    ("fa3_alibi", {}, FA3, None),
    ("fa3_alibi", ALIBI, FA3, "fa3.alibi"),
]  # fmt: skip

FA4_CASES = [
    ("fa4_installed", {}, FA4, None),
    ("fa4_installed", {}, "b200", "fa4.not_installed"),
    ("fa4_sm", {}, FA4_90, None),
    ("fa4_sm", {}, "a100:fa4=4.0.0b36", "fa4.sm"),
    ("fa4_prefer_fa3", {}, FA4_90, None),
    ("fa4_prefer_fa3", {}, "h100:fa3=3.0.0b1,fa4=4.0.0b36", "fa4.prefer_fa3"),
    ("fa4_prefer_fa3", {}, "b200:fa3=3.0.0b1,fa4=4.0.0b36", None),
    ("fa4_dtype", {"dtype": "fp16"}, FA4, None),
    ("fa4_dtype", {"dtype": "fp32"}, FA4, "fa4.dtype"),
    ("fa4_fp8", {}, FA4, None),
    ("fa4_fp8", FP8, FA4, "fa4.fp8"),
    ("fa4_num_splits", {"num_splits": 2}, FA4, None),
    ("fa4_num_splits", {"num_splits": 2}, FA4_90, "fa4.num_splits"),
    ("fa4_softcap", {}, FA4, None),
    ("fa4_softcap", {"softcap": 30.0}, FA4, "fa4.softcap"),
    ("fa4_kv_cache", {}, FA4, None),
    ("fa4_kv_cache", KV, FA4, "fa4.kv_cache"),
    ("fa4_head_dims", {"head_dim_qk": 192, "head_dim_v": 128}, FA4, None),
    ("fa4_head_dims", {"head_dim_qk": 160}, FA4, "fa4.head_dim"),
    ("fa4_head_dims", {"head_dim_qk": 160}, FA4_90, None),
    ("fa4_head_dims", {"head_dim_qk": 264}, FA4_90, "fa4.head_dim"),
    ("fa4_head_dims", {"head_dim_qk": 264}, "rtx5090:fa4=4.0.0b36", None),
    ("fa4_d512_sm100", {"head_dim_qk": 64, "head_dim_v": 512}, FA4, None),
    ("fa4_d512_sm100", {"head_dim_qk": 512}, FA4, "fa4.d512_sm100"),
    ("fa4_d256_cross_sm100", {"head_dim_qk": 256}, FA4, None),
    ("fa4_d256_cross_sm100", {"head_dim_qk": 256, **CROSS}, FA4, "fa4.d256_cross_sm100"),
    ("fa4_mla_backward_bug", {"head_dim_qk": 192, "head_dim_v": 128}, FA4, None),
    ("fa4_mla_backward_bug", {"head_dim_qk": 128, "head_dim_v": 96, **INFER}, FA4, None),
    ("fa4_mla_backward_bug", {"head_dim_qk": 128, "head_dim_v": 96}, FA4, "fa4.mla_backward"),
    ("fa4_dropout", {}, FA4, None),
    ("fa4_dropout", {"dropout": 0.1}, FA4, "fa4.dropout"),
    ("fa4_cp_comm_type", {**CP, "cp_comm_type": "a2a"}, FA4, None),
    ("fa4_cp_comm_type", {**CP, "cp_comm_type": "a2a+p2p"}, FA4, "fa4.cp_comm_type"),
    ("fa4_window_d256_sm100", {"head_dim_qk": 256, "window_size": (64, 64)}, FA4_90, None),
    ("fa4_window_d256_sm100", {"head_dim_qk": 256, "window_size": (64, 64)}, FA4,
     "fa4.window_d256_sm100"),
    ("fa4_alibi", {}, FA4, None),
    ("fa4_alibi", ALIBI, FA4, "fa4.alibi"),
]  # fmt: skip

CASES = SHARED_CASES + FA2_CASES + FA3_CASES + FA4_CASES


def _probe_codes(config, device):
    return result_codes(PROBE.probe(config, device))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_rule(case):
    check(RULES, case, _probe_codes)


def test_every_flash_rule_has_cases():
    assert_covered(RULES, CASES, skip=SHARED_NAMES)


def test_fa4_accepts_padding_between_sequences():
    """TE 2.20.2 passes seqused_q/seqused_k to FA4 for padded thd: only FA2 refuses it."""
    c = FusedAttnConfig(**THD, pad_between_seqs=True)
    r = PROBE.probe(c, profile(FA4))
    assert r.supported and r.detail["variant"] == "fa4"
    assert "fa2.pad_between_seqs" in {x.code for x in r.variants[2].reasons}


@pytest.mark.parametrize(
    "spec, config, variant",
    [
        # all supported: FA4 > FA3 > FA2
        (FA4, {}, "fa4"),
        (FA4_90, {}, "fa4"),
        (FA3, {}, "fa3"),
        ("a100", {}, "fa2"),
        # FA4 refused (dropout): the next flavour wins
        (FA4, {"dropout": 0.1}, "fa2"),
        ("h100:fa3=3.0.0b1,fa4=4.0.0b36", {"dropout": 0.1}, "fa2"),
        # on sm90 TE prefers an installed FA3 over FA4
        ("h100:fa3=3.0.0b1,fa4=4.0.0b36", {}, "fa3"),
        # FA3 refused (ALiBi), FA4 refused (ALiBi): FA2
        ("h100:fa3=3.0.0b1,fa4=4.0.0b36", ALIBI, "fa2"),
        # FA2 refused (num_splits): FA4 on sm100
        (FA4, {"num_splits": 2}, "fa4"),
        # nothing
        ("a100:fa2=none", {}, None),
    ],
)
def test_flavour_precedence(spec, config, variant):
    r = PROBE.probe(FusedAttnConfig(**config), profile(spec))
    assert [v.backend for v in r.variants] == list(flash_rules.PRECEDENCE) == ["fa4", "fa3", "fa2"]
    assert r.detail["variant"] == variant
    assert r.supported == (variant is not None)
    if variant is not None:
        assert r.reasons == ()
        chosen = r.chosen_variant()
        assert chosen is not None and chosen.supported
        ahead = list(flash_rules.PRECEDENCE)[: list(flash_rules.PRECEDENCE).index(variant)]
        assert all(not v.supported for v in r.variants if v.backend in ahead)
    else:
        assert {x.code for x in r.reasons} >= {"fa2.not_installed", "fa3.not_installed",
                                               "fa4.not_installed"}  # fmt: skip

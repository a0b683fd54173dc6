"""Rules of our Triton candidate (called directly, so they are tested whether or not the kernel
module is part of this checkout; without it the candidate is refused with
``triton.kernel_missing``) and of UnfusedDotProductAttention."""

from __future__ import annotations

import importlib.util

import pytest
from rule_cases import SHARED_NAMES, assert_covered, by_name, case_id, check, result_codes

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes import triton, unfused

TRITON_RULES = by_name(triton.TritonFlashProbe.RULES)
UNFUSED_RULES = by_name(unfused.UnfusedProbe.RULES)
TRITON = triton.TritonFlashProbe()
UNFUSED = unfused.UnfusedProbe()
KERNEL = "te_fl_attention.kernels.triton_flash"

THD = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding")
CP = dict(context_parallel=True, cp_size=2)
FP8 = dict(fp8=True)

TRITON_CASES = [
    # kernel_available depends on this installation: see test_kernel_available.
    ("triton_installed", {}, "h100", None),
    ("triton_installed", {}, "h100:triton=none", "triton.not_installed"),
    ("sm", {}, "a100", None),
    ("sm", {}, "t4", "triton.sm"),
    ("dtype", {"dtype": "fp32"}, "h100", None),
    ("dtype", {"dtype": "fp8_e4m3", **FP8}, "h100", "triton.dtype"),
    ("head_dim", {"head_dim_qk": 256, "head_dim_v": 200}, "h100", None),
    ("head_dim", {"head_dim_qk": 264}, "h100", "triton.head_dim"),
    ("triton_bias", {"bias_type": "post_scale_bias"}, "h100", "triton.bias"),
    ("triton_bias", {"bias_type": "alibi"}, "h100", "triton.bias"),
    ("triton_dropout", {"dropout": 0.1}, "h100", "triton.dropout"),
    ("triton_fp8", FP8, "h100", "triton.fp8"),
    ("triton_cp", CP, "h100", "triton.cp"),
    ("triton_kv_cache", {"kv_cache": True, "attn_mask_type": "padding"}, "h100",
     "triton.kv_cache"),
    ("triton_softmax", {"softmax_type": "off-by-one"}, "h100", "triton.softmax"),
    ("triton_softcap", {"softcap": 30.0}, "h100", "triton.softcap"),
    ("triton_num_splits", {"num_splits": 2}, "h100", "triton.num_splits"),
    ("triton_max_logit", {"return_max_logit": True}, "h100", "triton.max_logit"),
    ("triton_score_mod", {"has_score_mod": True}, "h100", "triton.score_mod"),
    ("triton_arbitrary", {"attn_mask_type": "arbitrary"}, "h100", "triton.arbitrary"),
]  # fmt: skip
# Everything the kernel supports (GQA, windows, thd, bottom-right causal, MLA dims) passes
# every feature rule.
SUPPORTED = dict(num_heads=16, num_gqa_groups=4, head_dim_qk=192, head_dim_v=128,
                 qkv_layout="thd_thd_thd", attn_mask_type="padding_causal_bottom_right",
                 window_size=(64, 0), pad_between_seqs=True)  # fmt: skip
TRITON_CASES += [(r.__name__, SUPPORTED, "h100", None) for r in triton.UNSUPPORTED]

UNFUSED_CASES = [
    ("fp8_attention", {}, "h100", None),
    ("fp8_attention", FP8, "h100", "fp8.unfused"),
    ("num_splits", {}, "h100", None),
    ("num_splits", {"num_splits": 4}, "h100", "num_splits.unsupported"),
    ("score_mod", {}, "h100", None),
    ("score_mod", {"has_score_mod": True}, "h100", "score_mod.unsupported"),
    ("thd_padding_between_seqs", THD, "h100", None),
    ("thd_padding_between_seqs", {**THD, "pad_between_seqs": True}, "h100",
     "thd.pad_between_seqs"),
    ("softmax_fp8", {"softmax_type": "learnable"}, "h100", None),
    ("softmax_fp8", {"softmax_type": "learnable", **FP8}, "h100", "softmax.fp8"),
    ("context_parallel", {}, "h100", None),
    ("context_parallel", CP, "h100", "cp.unsupported"),
]  # fmt: skip


@pytest.mark.parametrize("case", TRITON_CASES, ids=[case_id(c) for c in TRITON_CASES])
def test_triton_rule(case):
    check(TRITON_RULES, case, lambda c, d: result_codes(TRITON.probe(c, d)))


@pytest.mark.parametrize("case", UNFUSED_CASES, ids=[case_id(c) for c in UNFUSED_CASES])
def test_unfused_rule(case):
    check(UNFUSED_RULES, case, lambda c, d: result_codes(UNFUSED.probe(c, d)))


@pytest.fixture(params=[False, True], ids=["kernel missing", "kernel present"])
def kernel(request, monkeypatch):
    """Pretend the kernel module is missing or present, whichever this checkout has."""
    real = importlib.util.find_spec
    present = request.param

    def find_spec(name, *args):
        if name == KERNEL:
            return object() if present else None
        return real(name, *args)

    monkeypatch.setattr(triton.importlib.util, "find_spec", find_spec)
    return present


def test_kernel_available(kernel):
    """Refused (stage import) while the kernel module is missing; accepted once it exists."""
    c, d = FusedAttnConfig(), profile("h100")
    reason = triton.kernel_available(c, d)
    result = TRITON.probe(c, d)
    if kernel:
        assert reason is None
        assert "triton.kernel_missing" not in result_codes(result)
    else:
        assert reason is not None and reason.code == "triton.kernel_missing"
        assert reason.stage == "import" and reason.limit == KERNEL and reason.message
        assert not result.supported and result.reasons[0].code == "triton.kernel_missing"


def test_every_triton_and_unfused_rule_has_cases():
    assert_covered(TRITON_RULES, TRITON_CASES, skip={*SHARED_NAMES, "kernel_available"})
    assert "kernel_available" in TRITON_RULES
    assert_covered(UNFUSED_RULES, UNFUSED_CASES, skip=SHARED_NAMES)

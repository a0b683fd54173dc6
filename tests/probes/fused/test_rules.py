"""FusedAttention (cuDNN) rules: one accepting and one refusing case (or more) per rule."""

from __future__ import annotations

import pytest
from rule_cases import FORCE, SHARED_NAMES, assert_covered, by_name, case_id, check, result_codes

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes.fused import cpp as fused_cpp
from te_fl_attention.probes.fused import probe as fused_probe
from te_fl_attention.probes.fused import rules as fused_rules
from te_fl_attention.probes.fused import table as fused_table

RULES = by_name((*fused_rules.PYTHON_RULES, *fused_cpp.CPP_RULES, *fused_table.TABLE_RULES,
                 fused_rules.determinism))
PROBE = fused_probe.CudnnProbe()

THD = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding")
THD_BR = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal_bottom_right")
BHSS_1024 = dict(bias_shape="bhss", batch_size=2, max_seqlen_q=1024, max_seqlen_kv=1024,
                 num_tokens_q=1024, num_tokens_kv=1024)
KV = dict(kv_cache=True, attn_mask_type="padding")
PAGED = dict(qkv_layout="paged_kv_bshd_bshd_bshd", page_size=256, attn_mask_type="padding")
CP = dict(context_parallel=True, cp_size=2)
MLA = dict(head_dim_qk=128, head_dim_v=64)
WIN = dict(window_size=(64, 64))
DET = dict(deterministic=True)
FP8 = dict(fp8=True)
MX = dict(fp8=True, fp8_recipe="mxfp8")
CS = dict(fp8=True, fp8_recipe="current")
OBO = dict(softmax_type="off-by-one")
BIAS = dict(bias_type="post_scale_bias")

# (rule, config kwargs, device, expected code or None)
PYTHON_CASES = [
    ("cudnn_present", {}, "h100", None),
    ("cudnn_present", {}, "h100:cudnn=none", "fused.cudnn_missing"),
    ("sm80", {}, "a100", None),
    ("sm80", {}, "t4", "fused.sm"),
    ("dtype", {"dtype": "fp16"}, "h100", None),
    ("dtype", {"dtype": "fp32"}, "h100", "fused.dtype"),
    ("dtype", {"dtype": "fp8_e5m2", **FP8}, "h100", "fused.dtype"),
    ("fp8_recipe", {}, "h100", None),
    ("fp8_recipe", FP8, "h100", None),
    ("fp8_recipe", MX, "b200", None),
    ("fp8_recipe", {**CS, **DET}, "b200", None),
    ("fp8_recipe", FP8, "rtx5090", "fused.fp8_sm120"),
    ("fp8_recipe", {**FP8, **DET}, "b200:cudnn=9.17.0", "fused.fp8_delayed_det"),
    ("fp8_recipe", CS, "h100", "fused.fp8_current_sm"),
    ("fp8_recipe", CS, "b200:cudnn=9.13.0", "fused.fp8_current_cudnn"),
    ("fp8_recipe", {**CS, **DET}, "b200:cudnn=9.17.0", "fused.fp8_current_det"),
    ("fp8_recipe", MX, "h100", "fused.mxfp8_sm"),
    ("fp8_recipe", {**MX, "fp8_mha": True}, "b200", "fused.mxfp8_mha"),
    ("fp8_recipe", MX, "b200:cudnn=9.20.0", "fused.mxfp8_cudnn"),
    ("fp8_recipe", MX, "b200:cudnn=9.23.1", "fused.mxfp8_cudnn_bug"),
    ("fp8_recipe", {**MX, **THD}, "b200", "fused.mxfp8_thd"),
    ("fp8_recipe", {"fp8_recipe": "block"}, "b200", "fused.fp8_recipe"),
    ("fp8_recipe", {"fp8_recipe": "nvfp4"}, "b200", "fused.fp8_recipe"),
    ("num_splits", {}, "h100", None),
    ("num_splits", {"num_splits": 2}, "h100", "fused.num_splits"),
    ("softcap", {}, "h100", None),
    ("softcap", {"softcap": 30.0}, "h100", "fused.softcap"),
    ("score_mod", {"has_score_mod": True}, "h100", None),
    ("score_mod", {"has_score_mod": True, "attn_mask_type": "causal"}, "h100", "fused.score_mod"),
    ("score_mod", {"has_score_mod": True, "dropout": 0.1}, "h100", "fused.score_mod"),
    ("kv_cache", KV, "h100", None),
    ("kv_cache", KV, "l40s", "fused.kv_cache_sm"),
    ("kv_cache", KV, "rtx5090", "fused.kv_cache_sm"),
    ("kv_cache", {**KV, **FP8}, "h100", "fused.kv_cache_fp8"),
    ("mla_layout", MLA, "h100", None),
    ("mla_layout", {**MLA, **PAGED}, "h100", "fused.mla_layout"),
    ("mla_layout", PAGED, "h100", None),
    ("mla_sm120_training", {"head_dim_qk": 192, "head_dim_v": 128, "is_training": False},
     "rtx5090", None),
    ("mla_sm120_training", {"head_dim_qk": 192, "head_dim_v": 128}, "rtx5090",
     "fused.mla_sm120"),
    ("mla_sm120_training", {"head_dim_qk": 192, "head_dim_v": 128}, "b200", None),
    ("thd_sm120", THD, "rtx5090", None),
    ("thd_sm120", THD, "rtx5090:cudnn=9.18.0", "fused.thd_sm120_cudnn"),
    ("thd_sm120", {**THD, "qkv_layout": "t3hd"}, "rtx5090", "fused.thd_sm120_layout"),
    ("softmax", OBO, "h100", None),
    ("softmax", {**OBO, **CP, "cp_comm_type": "a2a"}, "h100", None),
    ("softmax", {**OBO, **FP8}, "h100", "fused.softmax_fp8"),
    ("softmax", {**OBO, **FP8}, "b200:cudnn=9.20.0", "fused.softmax_fp8"),
    ("softmax", {**OBO, **THD}, "h100:cudnn=9.17.0", "fused.softmax_thd"),
    ("softmax", {**OBO, **CP}, "h100", "fused.softmax_cp"),
    ("context_parallel", CP, "h100", None),
    ("context_parallel", {**CP, "attn_mask_type": "causal"}, "h100", None),
    ("context_parallel", {**CP, "attn_mask_type": "causal_bottom_right"}, "h100",
     "fused.cp_bottom_right"),
    ("context_parallel", {**CP, "attn_mask_type": "causal", "max_seqlen_kv": 256}, "h100",
     "fused.cp_causal_cross"),
    ("context_parallel", {**CP, "bias_type": "pre_scale_bias"}, "h100", "fused.cp_bias_type"),
    ("context_parallel", {**CP, **BIAS, **THD}, "h100", "fused.cp_thd_bias"),
    ("context_parallel", {**CP, **BIAS, **FP8}, "h100", "fused.cp_fp8_bias"),
    ("context_parallel", {**CP, **BIAS, "cp_comm_type": "all_gather"}, "h100",
     "fused.cp_bias_comm"),
    ("context_parallel", {**CP, **WIN}, "h100", "fused.cp_window"),
    ("context_parallel", {**CP, **WIN, "cp_comm_type": "all_gather"}, "h100", None),
    ("context_parallel", {**CP, "cp_comm_type": "a2a", "num_heads": 3}, "h100",
     "fused.cp_a2a_heads"),
    ("arbitrary_mask", {"attn_mask_type": "padding"}, "h100", None),
    ("arbitrary_mask", {"attn_mask_type": "arbitrary"}, "h100", "fused.mask_arbitrary"),
    ("sliding_window", WIN, "h100", None),
    ("sliding_window", {**WIN, **FP8}, "h100", "fused.window_fp8"),
    ("sliding_window", {**WIN, **FP8}, "b200", None),
    ("sliding_window", {**WIN, "dropout": 0.1}, "h100", "fused.window_dropout"),
    ("sliding_window", {**WIN, "max_seqlen_kv": 64}, "h100", "fused.window_sq_gt_skv"),
    ("bias_111s_grad", {**BIAS, "bias_shape": "111s", "batch_size": 2}, "h100", None),
    ("bias_111s_grad", {**BIAS, "bias_shape": "111s", "batch_size": 2,
                        "bias_requires_grad": True}, "h100", "fused.bias_111s_grad"),
    # TE reads a (1, 1, 1, skv) bias as 1hss with one head (b1ss with batch 1): no refusal.
    ("bias_111s_grad", {**BIAS, "bias_shape": "111s", "batch_size": 2, "num_heads": 1,
                        "bias_requires_grad": True}, "h100", None),
    ("bias_111s_grad", {**BIAS, "bias_shape": "111s", "bias_requires_grad": True}, "h100",
     None),
]  # fmt: skip

TABLE_CASES = [
    ("table_arch", {}, "h100", None),
    ("table_arch", {}, "h100:cudnn=8.9.7", "cudnn_table.cudnn_old"),
    ("table_arch", {}, "h100:cudnn=9.10.1", "cudnn_table.cudnn_9_10"),
    ("table_arch", {}, "h100:cudnn=9.10.2", None),
    ("table_arch", FP8, "a100", "cudnn_table.fp8_sm"),
    ("table_arch", {}, "b200:cudnn=9.6.0", "cudnn_table.blackwell_cudnn"),
    ("table_arch", {}, "rtx5090:cudnn=9.18.0", "cudnn_table.sm120_cudnn"),
    ("table_head_dim", {"head_dim_qk": 128}, "a100", None),
    ("table_head_dim", {"head_dim_qk": 36}, "h100", "cudnn_table.head_dim_align"),
    ("table_head_dim", {"head_dim_qk": 256}, "a100", "cudnn_table.head_dim"),
    ("table_head_dim", {"head_dim_qk": 256}, "h100", None),
    ("table_head_dim", {"head_dim_qk": 256, "is_training": False}, "a100", None),
    ("table_head_dim", {"head_dim_qk": 192, "head_dim_v": 128}, "b200", None),
    ("table_head_dim", {"head_dim_qk": 256, "head_dim_v": 128}, "h100",
     "cudnn_table.hopper_mla_bwd"),
    ("table_head_dim", {**FP8, "head_dim_qk": 128}, "h100", None),
    ("table_head_dim", {**FP8, "head_dim_qk": 64}, "h100", "cudnn_table.fp8_head_dim"),
    ("table_bias", BIAS, "h100", None),
    ("table_bias", {"bias_type": "alibi", "attn_mask_type": "causal"}, "h100", None),
    ("table_bias", {"bias_type": "alibi", "attn_mask_type": "causal"}, "a100",
     "cudnn_table.alibi"),
    ("table_bias", {"bias_type": "alibi", "attn_mask_type": "padding"}, "h100",
     "cudnn_table.alibi"),
    ("table_bias", {**BIAS, "attn_mask_type": "padding"}, "h100", None),  # cuDNN builds it
    ("table_mask_layout", THD, "h100", None),
    ("table_mask_layout", {**THD, "num_gqa_groups": 4}, "h100:cudnn=9.5.0",
     "cudnn_table.thd_gqa"),
    ("table_mask_layout", {"qkv_layout": "sbhd_bshd_bshd"}, "h100:cudnn=9.6.0",
     "cudnn_table.mixed_format"),
    ("table_mask_layout", {"attn_mask_type": "causal_bottom_right", "max_seqlen_kv": 64}, "h100",
     "cudnn_table.bottom_right_sq"),
    ("table_mask_layout", {**PAGED, "dropout": 0.1}, "h100:cudnn=9.6.0",
     "cudnn_table.mask_bias_dropout"),
    ("table_mask_layout", {**PAGED, "dropout": 0.1}, "h100", None),
    # A bottom-right causal mask with bias, ALiBi or training dropout: cuDNN refuses it.
    ("table_mask_layout", {"attn_mask_type": "causal_bottom_right", "dropout": 0.1}, "h100",
     "cudnn_table.bottom_right_bias_dropout"),
    ("table_mask_layout", {"attn_mask_type": "causal_bottom_right", "dropout": 0.1,
                           "is_training": False}, "h100", None),
    ("table_mask_layout", {"attn_mask_type": "padding_causal_bottom_right", **BIAS}, "b200",
     "cudnn_table.bottom_right_bias_dropout"),
    ("table_mask_layout", {"attn_mask_type": "causal_bottom_right", "bias_type": "alibi",
                           "alibi_slopes_shape": (16,)}, "a100",
     "cudnn_table.bottom_right_bias_dropout"),
    ("table_mask_layout", {"attn_mask_type": "causal", "dropout": 0.1, **BIAS}, "h100", None),
    ("table_mask_layout", OBO, "h100:cudnn=9.13.0", "cudnn_table.softmax_cudnn"),
    ("table_mask_layout", {"return_max_logit": True}, "h100:cudnn=9.20.0",
     "cudnn_table.max_logit_cudnn"),
    ("table_window", WIN, "h100", None),
    ("table_window", {"window_size": (64, 0)}, "h100:cudnn=9.1.0", "cudnn_table.window_cudnn"),
    ("table_window", {**WIN, **BIAS}, "h100", "cudnn_table.window_bias"),
    ("table_window", WIN, "h100:cudnn=9.5.0", "cudnn_table.window_right"),
    ("table_window", {"window_size": (64, 0)}, "h100:cudnn=9.5.0", None),
    ("table_window", {"window_size": (16, 0), "attn_mask_type": "causal", "max_seqlen_kv": 256},
     "h100", "cudnn_table.window_top_left_cross"),
    ("table_blackwell_training", DET, "b200", None),
    ("table_blackwell_training", DET, "rtx5090", "cudnn_table.sm120_det"),
    ("table_blackwell_training", DET, "b200:cudnn=9.18.0", "cudnn_table.blackwell_det"),
    ("table_blackwell_training", {**DET, "dropout": 0.1}, "b200", "cudnn_table.blackwell_det"),
    ("table_blackwell_training", {**BIAS, "dropout": 0.1}, "b200",
     "cudnn_table.blackwell_dropout_bias"),
    ("table_blackwell_training", {**BIAS, "dropout": 0.1, "is_training": False}, "b200", None),
    # FP8 thd and mixed formats are TE's C++ rules now (cpp_fp8); bhsd below 9.21 stays.
    ("table_head_dim", {**FP8, **THD, "head_dim_qk": 128, "is_training": False}, "b200", None),
    ("table_head_dim", {**FP8, "qkv_layout": "bhsd_bhsd_bhsd", "head_dim_qk": 128}, "b200", None),
    ("table_head_dim", {**FP8, "qkv_layout": "bhsd_bhsd_bhsd", "head_dim_qk": 128},
     "b200:cudnn=9.20.0", "cudnn_table.fp8_format"),
    # thd bias on the ragged graph: [1, h, 128, 128] vs the bucketed [b, h, 1024, 1024].
    ("table_bias", {**THD, **BIAS, "batch_size": 2}, "h100", "cudnn_table.thd_bias_ragged"),
    ("table_bias", {**THD, **BIAS, "batch_size": 2}, "b200", "cudnn_table.thd_bias_ragged"),
    ("table_bias", {**THD, "bias_type": "alibi", "alibi_slopes_shape": (16,), "batch_size": 2},
     "h100", "cudnn_table.thd_bias_ragged"),
    ("table_bias", {**THD_BR, **BIAS, "batch_size": 2}, "rtx5090", None),  # no ragged graph
    # s_q = the token bucket and a batch-1 bias: it broadcasts, forward and backward.
    ("table_bias", {**THD_BR, **BIAS, "max_seqlen_q": 1024, "max_seqlen_kv": 1024}, "h100",
     None),
    ("table_bias", {**THD, **BIAS, "max_seqlen_q": 1024, "max_seqlen_kv": 1024,
                    "num_tokens_q": 3000}, "h100", "cudnn_table.thd_bias_ragged"),
    # A [2, h, 1024, 1024] bias with 1024 tokens: the forward (real batch with cu_seqlens)
    # broadcasts; the backward's batch is bucketed to 32, and so is the forward's without
    # cu_seqlens (cuDNN < 9.24).
    ("table_bias", {**THD_BR, **BIAS, **BHSS_1024}, "h100", "cudnn_table.thd_bias_ragged"),
    ("table_bias", {**THD_BR, **BIAS, **BHSS_1024, "is_training": False}, "h100", None),
    ("table_bias", {**THD_BR, **BIAS, **BHSS_1024, "is_training": False}, "h100:cudnn=9.23.0",
     "cudnn_table.thd_bias_ragged"),
    ("table_cp_steps", {**CP, "max_seqlen_q": 256}, "h100", None),
    ("table_cp_steps", {**CP, "max_seqlen_q": 2, "cp_comm_type": "all_gather"}, "h100",
     "cudnn_table.cp_step_invalid"),  # s_q // (2 cp) = 0
    ("table_short_sequences", {**CP, "max_seqlen_q": 2, "max_seqlen_kv": 2048, **OBO,
                               "cp_comm_type": "a2a", "is_training": False}, "h100", None),
    ("table_short_sequences", {**CP, "max_seqlen_q": 2, "max_seqlen_kv": 2048, **OBO,
                               "is_training": False}, "h100",
     "cudnn_table.decode_sink"),  # a2a: s_q 2; p2p: each rank's s_q 2 // 2 = 1 with a sink
    ("table_short_sequences", {"max_seqlen_q": 1, "max_seqlen_kv": 2048, **OBO,
                               "is_training": False}, "h100", "cudnn_table.decode_sink"),
    ("table_short_sequences", {"max_seqlen_q": 2, "max_seqlen_kv": 2048, **OBO,
                               "is_training": False}, "h100", None),
    ("table_short_sequences", {**THD, "max_seqlen_q": 1, **OBO, "is_training": False}, "h100",
     None),  # the ragged graph's s_q is the token bucket
    ("table_short_sequences", {**THD, "max_seqlen_q": 1, **OBO, "is_training": False},
     "rtx5090", "cudnn_table.decode_sink"),  # no ragged graph on sm120
    ("table_short_sequences", {"max_seqlen_q": 1, "max_seqlen_kv": 1}, "b200",
     "cudnn_table.bwd_s1"),
    ("table_short_sequences", {"max_seqlen_q": 1, "max_seqlen_kv": 1, "is_training": False},
     "b200", None),
    ("table_head_dim", {**FP8, "head_dim_qk": 128, "dropout": 0.1}, "b200",
     "cudnn_table.fp8_blackwell_dropout"),
    ("table_head_dim", {**FP8, "head_dim_qk": 128, "dropout": 0.1}, "h100", None),
    ("table_head_dim", {**FP8, "head_dim_qk": 128, "dropout": 0.1, "is_training": False}, "b200",
     None),
    # dBias unless [1, 1, 1, s_kv], requires_grad or not.
    ("table_blackwell_training", {**DET, **BIAS}, "b200", "cudnn_table.blackwell_det"),
    ("table_blackwell_training", {**DET, **BIAS, "bias_shape": "111s", "batch_size": 2,
                                  "max_seqlen_q": 256}, "b200", None),
    ("table_blackwell_training", {**DET, "bias_type": "alibi", "attn_mask_type": "causal"},
     "b200", "cudnn_table.blackwell_det"),
    ("table_blackwell_training", {**BIAS, "dropout": 0.1, "bias_shape": "111s", "batch_size": 2,
                                  "max_seqlen_q": 256}, "b200", None),
    ("table_blackwell_training", {"bias_type": "alibi", "attn_mask_type": "causal",
                                  "dropout": 0.1}, "b200", None),
    ("determinism", DET, "h100", None),
    ("determinism", {**DET, "is_training": False}, "a100", None),
    ("determinism", {**DET, **OBO}, "h100", "fused.det_softmax"),
    ("determinism", {**DET, **FP8, "head_dim_qk": 128}, "h100:cudnn=9.18.0", "fused.det_fp8"),
    ("determinism", {**DET, **FP8, "head_dim_qk": 128}, "h100:cudnn=9.19.0", None),
    ("determinism", DET, "a100", "fused.det_f16"),
    ("determinism", {**DET, **BIAS, "bias_shape": "1hss", "bias_requires_grad": True}, "h100",
     "fused.det_f16"),
    ("determinism", {**DET, **THD, "batch_size": 8, "max_seqlen_q": 4096,
                     "max_seqlen_kv": 4096}, "h100", "fused.det_thd_workspace"),
    ("determinism", {**DET, **THD, "batch_size": 8, "max_seqlen_q": 4096,
                     "max_seqlen_kv": 4096}, "b200", None),
]  # fmt: skip

CPP_CASES = [
    ("cpp_ragged_inputs", THD, "h100", None),
    ("cpp_ragged_inputs", {}, "h100", None),
    ("cpp_ragged_inputs", {"qkv_layout": "thd_thd_thd"}, "h100", "fused_cpp.thd_mask"),
    ("cpp_ragged_inputs", {"qkv_layout": "thd_bshd_bshd", "attn_mask_type": "causal"}, "a100",
     "fused_cpp.thd_mask"),
    ("cpp_ragged_inputs", {**THD, "num_tokens_q": 1}, "h100", None),
    ("cpp_ragged_inputs", {**THD, "num_tokens_q": 0}, "h100", "fused_cpp.thd_num_tokens"),
    ("cpp_ragged_inputs", {"qkv_layout": "thd_bshd_bshd", "attn_mask_type": "padding",
                           FORCE: {"num_tokens_kv": 0}}, "h100", None),  # kv is not ragged
    ("cpp_paged_kv", PAGED, "h100", None),
    ("cpp_paged_kv", {**PAGED, FORCE: {"attn_mask_type": "causal"}}, "h100",
     "fused_cpp.paged_mask"),
    ("cpp_paged_kv", {**PAGED, FORCE: {"page_size": 0}}, "h100", "fused_cpp.paged_dims"),
    ("cpp_pre_scale_bias", BIAS, "h100", None),
    ("cpp_pre_scale_bias", {"bias_type": "pre_scale_bias"}, "h100", "fused_cpp.pre_scale_bias"),
    ("cpp_pre_scale_bias", {**FP8, "bias_type": "pre_scale_bias", "head_dim_qk": 128}, "h100",
     "fused_cpp.pre_scale_bias"),
    ("cpp_f16", THD, "h100", None),
    ("cpp_f16", THD, "a100", "fused_cpp.thd_sm90"),
    ("cpp_f16", {**THD, "qkv_layout": "t3hd"}, "l40s", "fused_cpp.thd_sm90"),
    ("cpp_f16", {**THD, "qkv_layout": "thd_bshd_bshd"}, "a100", None),  # one ragged side
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True}, "h100:cudnn=9.15.0",
     "fused_cpp.cuda_graph_cudnn"),
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True, "qkv_layout": "sbhd_sbhd_sbhd"},
     "h100:cudnn=9.12.0", "fused_cpp.cuda_graph_cudnn"),
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True}, "h100:cudnn=9.15.1", None),
    # Context parallelism: TE asks for each step's s_kv (all_gather: 256 / 4 = 64; p2p causal:
    # 256 / 2 = 128 and its half, 64; a2a: 256).
    ("cpp_f16", {"max_seqlen_q": 256, "max_seqlen_kv": 256, "cuda_graph": True, **CP,
                 "cp_comm_type": "all_gather"}, "h100:cudnn=9.14.0", "fused_cpp.cuda_graph_cudnn"),
    ("cpp_f16", {"max_seqlen_q": 256, "max_seqlen_kv": 256, "cuda_graph": True, **CP,
                 "attn_mask_type": "causal"}, "h100:cudnn=9.14.0", "fused_cpp.cuda_graph_cudnn"),
    ("cpp_f16", {"max_seqlen_q": 256, "max_seqlen_kv": 256, "cuda_graph": True, **CP},
     "h100:cudnn=9.14.0", None),
    ("cpp_f16", {"max_seqlen_q": 256, "max_seqlen_kv": 256, "cuda_graph": True, **CP,
                 "cp_comm_type": "a2a"}, "h100:cudnn=9.14.0", None),
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True, "is_training": False},
     "h100:cudnn=9.15.0", None),
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True, "attn_mask_type": "padding"},
     "h100:cudnn=9.15.0", None),
    # C++'s qkv_format of sbhd_bshd_bshd is sbhd_2bshd, not sbhd: not refused.
    ("cpp_f16", {"max_seqlen_kv": 100, "cuda_graph": True, "qkv_layout": "sbhd_bshd_bshd"},
     "h100:cudnn=9.15.0", None),
    ("cpp_f16", {**THD, "softmax_type": "learnable"}, "h100:cudnn=9.25.0",
     "fused_cpp.thd_learnable_bwd"),
    ("cpp_f16", {**THD, "qkv_layout": "thd_bshd_bshd", "softmax_type": "learnable"},
     "b200:cudnn=9.25.0", "fused_cpp.thd_learnable_bwd"),
    ("cpp_f16", {**THD, "softmax_type": "learnable"}, "h100", None),
    ("cpp_f16", {**THD, "softmax_type": "learnable", "is_training": False}, "h100:cudnn=9.25.0",
     None),
    ("cpp_f16", {**THD, "softmax_type": "off-by-one"}, "h100:cudnn=9.25.0", None),
    ("cpp_f16", {**THD, "softmax_type": "learnable"}, "rtx5090:cudnn=9.25.0", None),  # no ragged
    ("cpp_fp8", {**FP8, "head_dim_qk": 128}, "h100", None),
    ("cpp_fp8", {**FP8, "head_dim_qk": 128, "return_max_logit": True}, "h100", None),  # Python's
    ("cpp_fp8", {**FP8, "head_dim_qk": 128, "qkv_layout": "sbhd_bshd_bshd"}, "h100",
     "fused_cpp.fp8_format"),
    # MXFP8 hands cuDNN bhsd for a mixed layout; only the gradient keeps the caller's format.
    ("cpp_fp8", {**MX, "head_dim_qk": 128, "qkv_layout": "sbhd_bshd_bshd"}, "b200",
     "fused_cpp.fp8_format"),
    ("cpp_fp8", {**MX, "head_dim_qk": 128, "qkv_layout": "sbhd_bshd_bshd", "is_training": False},
     "b200", None),
    ("cpp_fp8", {**FP8, **THD, "head_dim_qk": 128}, "b200", None),
    ("cpp_fp8", {**FP8, **THD, "head_dim_qk": 128}, "b200:cudnn=9.22.0",
     "fused_cpp.fp8_thd_cudnn"),
    ("cpp_fp8", {**FP8, **THD, "head_dim_qk": 128}, "h100", "fused_cpp.fp8_thd_bwd_sm"),
    ("cpp_fp8", {**FP8, **THD, "head_dim_qk": 128, "is_training": False}, "h100", None),
    ("cpp_fp8", {**FP8, **THD, **OBO, "head_dim_qk": 128}, "b200:cudnn=9.25.0",
     "fused_cpp.fp8_thd_softmax"),
    ("cpp_fp8", {**FP8, **THD, **OBO, "head_dim_qk": 128}, "b200", None),
    ("cpp_fp8", {**FP8, **THD, "head_dim_qk": 192, "head_dim_v": 128}, "b200",
     "fused_cpp.fp8_thd_head_dim"),
    ("cpp_fp8", {**FP8, "head_dim_qk": 192, "head_dim_v": 128}, "b200", None),  # bshd: cuDNN's
    ("cpp_fp8", {**FP8, **BIAS, "head_dim_qk": 128}, "h100", "fused_cpp.fp8_bias"),
    ("cpp_fp8", {**FP8, "bias_type": "alibi", "attn_mask_type": "causal", "head_dim_qk": 128},
     "h100", "fused_cpp.fp8_bias"),
]  # fmt: skip

CASES = PYTHON_CASES + CPP_CASES + TABLE_CASES


def _probe_codes(config, device):
    return result_codes(PROBE.probe(config, device))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_rule(case):
    check(RULES, case, _probe_codes)


def test_every_fused_rule_has_cases():
    assert_covered(RULES, CASES, skip=SHARED_NAMES)


def test_table_and_cpp_rules_wait_for_a_known_device():
    """Table and C++ rules say nothing without a GPU or a cuDNN version (reported once,
    earlier: TE reaches its C++ query only on a GPU)."""
    for c in (FusedAttnConfig(head_dim_qk=36), FusedAttnConfig(bias_type="pre_scale_bias")):
        for spec in ("h100:sm=none", "h100:cudnn=none"):
            rules = (*fused_table.TABLE_RULES, *fused_cpp.CPP_RULES)
            assert [r(c, profile(spec)) for r in rules] == [None] * len(rules)


def test_cpp_rules_cite_tes_cpp_and_bind():
    """Each C++ rule names TE 2.20.2's file and function; like the Python filters it binds: the
    probe never asks cuDNN past it (TE's C++ refuses before building a graph)."""
    for rule in fused_cpp.CPP_RULES:
        doc = rule.__doc__ or ""
        assert "TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2" in doc, rule.__name__
    assert set(fused_cpp.CPP_RULES) <= set(fused_cpp.BINDING_RULES)
    assert not set(fused_cpp.CPP_RULES) & set(fused_table.TABLE_RULES)
    asked = []
    probe = fused_probe.CudnnProbe(graph=True)
    probe._ask_cudnn = lambda c, d: asked.append(c) or (None, None)  # type: ignore[method-assign]
    r = probe.probe(FusedAttnConfig(qkv_layout="thd_thd_thd", attn_mask_type="padding"),
                    profile("a100"))
    assert not r.supported and r.reasons[0].code == "fused_cpp.thd_sm90" and asked == []
    assert not r.detail["predicted"]  # a binding refusal, not a prediction


def test_sub_backend_follows_fp8_attention():
    """FP8 DPA hands cuDNN FP8 q/k/v whatever the module's dtype: FP8 sub-backend (2)."""
    assert fused_rules.fused_sub_backend(FusedAttnConfig()) == fused_rules.F16_ARBITRARY_SEQLEN
    assert fused_rules.fused_sub_backend(FusedAttnConfig(fp8=True)) == fused_rules.FP8
    fp8 = FusedAttnConfig(fp8=True, dtype="fp8_e4m3")
    assert fused_rules.fused_sub_backend(fp8) == fused_rules.FP8
    r = PROBE.probe(FusedAttnConfig(fp8=True, head_dim_qk=128), profile("h100"))
    assert r.supported and r.detail["sub_backend"] == fused_rules.FP8

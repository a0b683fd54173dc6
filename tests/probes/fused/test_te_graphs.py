"""The cuDNN probe builds TE 2.20.2's own FusedAttention graphs: a table of configs over TE's test
families whose expected graph parameters are written from TE's C++, checked against the graph
spec (``spec=True``), each with cuDNN's verdict on a named device.

The expected dims, strides, data types, offsets, options and tensors below are worked out by hand
from TE 2.20.2's C++ (transformer_engine/common/fused_attn/, /work/notes/te_cpp_fused_attn.md):
``FusedAttnConfig::derive()`` (config_and_params.cpp), ``create_graph_f16_fwd/bwd``
(fused_attn_f16_arbitrary_seqlen.cu), ``create_graph_fp8_fwd/bwd`` (fused_attn_fp8.cu),
``generateMatrixStrides`` / ``get_max_tokens`` / ``get_max_batch_size`` (utils.cu),
``nvte_get_fused_attn_backend_v2`` (fused_attn.cpp). The verdicts are cuDNN 9.28.1's (cudnn-frontend
1.32.0) deviceless answers for the catalog descriptors; the asserted substrings are cuDNN's words.
Everything runs through the deviceless planner in one probe worker (~1-20 ms a graph).

Base config unless a case says otherwise: batch 2, 8 heads (hg 8), head dim 64, s_q = s_kv = 128,
bf16, training, ``bshd_bshd_bshd``. So ``h*d = 512``; BSHD strides are ``[s*512, 64, 512, 1]``;
the thd token count defaults to ``2*128 = 256`` -> TE's bucket 1024; the bucketed batch is 32.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
from cudnn_skip import require_cudnn

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.probes.fused.worker import CudnnWorker

require_cudnn()

BASE = dict(batch_size=2, num_heads=8, head_dim_qk=64, max_seqlen_q=128, dtype="bf16")
OK = "supported"
UNSET = None  # TE sets no data type on the tensor: cudnn-frontend's JSON says null
NO = "absent"  # no ragged offset on the tensor
S128 = [65536, 64, 512, 1]  # BSHD, s = 128
S1024 = [524288, 64, 512, 1]  # THD on the ragged graph, s = 1024 tokens
STATS128 = [1024, 128, 1, 1]  # BHS1
STATS_TH1 = [8192, 1, 8, 1]  # TH1, s = 1024
SCALAR = ([1, 1, 1, 1], [1, 1, 1, 1])


_SKIP: Any = object()


def T(dim: Any = _SKIP, stride: Any = _SKIP, dtype: Any = _SKIP, off: Any = _SKIP,
      mult: Any = _SKIP, by_value: Any = _SKIP, name: Any = _SKIP) -> dict[str, Any]:  # fmt: skip
    """An expected tensor: only the given fields are checked. ``dtype=UNSET``: TE sets none;
    ``off``: ``NO`` or ``(dtype, dim)`` of its ragged offset; ``mult``: its ragged offset
    multiplier (None: none set)."""
    spec = dict(dim=dim, stride=stride, dtype=dtype, off=off, mult=mult, by_value=by_value,
                name=name)  # fmt: skip
    return {k: v for k, v in spec.items() if v is not _SKIP}


def ragged(dtype: str, b: int, mult: int | None) -> dict[str, Any]:
    return {"off": (dtype, [b + 1, 1, 1, 1]), "mult": mult}


@dataclass
class Case:
    id: str
    device: str
    config: dict[str, Any]
    verdict: str | tuple[str, str, str]  # OK, or (step, graph, cuDNN's words)
    fwd: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> expected tensor
    bwd: dict[str, dict[str, Any]] = field(default_factory=dict)
    fwd_node: dict[str, Any] = field(default_factory=dict)  # node option -> expected value
    bwd_node: dict[str, Any] = field(default_factory=dict)
    fwd_absent: tuple[str, ...] = ()  # node roles that must not be there
    bwd_absent: tuple[str, ...] = ()
    graphs: tuple[str, ...] | None = None  # the graphs the spec must hold (default: by verdict)


F16_IN = {"Q": T([2, 8, 128, 64], S128, UNSET, NO), "K": T([2, 8, 128, 64], S128, UNSET, NO),
          "V": T([2, 8, 128, 64], S128, UNSET, NO),
          "Attn_scale": T(*SCALAR, "FLOAT", by_value=True, name="attn_scale")}  # fmt: skip
NO_EXTRAS = ("SEQ_LEN_Q", "SEQ_LEN_KV", "CU_SEQ_LEN_Q", "CU_SEQ_LEN_KV", "Bias", "Seed",
             "Offset", "SINK_TOKEN", "Max", "Page_table_K")  # fmt: skip

CASES = [
    # ------------------------------------------------------------------ layouts, dense graphs
    Case("bshd_no_mask_h100", "h100", {}, OK,
         fwd={**F16_IN, "O": T([2, 8, 128, 64], S128, UNSET, NO),
              "Stats": T([2, 8, 128, 1], STATS128, "FLOAT", NO)},
         # derive(): no window and no causal mask -> TOP_LEFT although the config says BR.
         fwd_node=dict(name="flash_attention", diagonal_alignment="TOP_LEFT", left_bound=None,
                       right_bound=None, padding_mask=False, alibi_mask=False,
                       generate_stats=True, max_total_seq_len_q=None),
         fwd_absent=NO_EXTRAS,
         bwd={**F16_IN, "O": T([2, 8, 128, 64], S128, UNSET, NO),
              "dO": T([2, 8, 128, 64], S128, UNSET, NO),
              "Stats": T([2, 8, 128, 1], STATS128, "FLOAT", NO, name="stats"),
              "dQ": T([2, 8, 128, 64], S128), "dK": T([2, 8, 128, 64], S128)},
         bwd_node=dict(name="flash_attention_backward", is_deterministic_algorithm=False,
                       max_total_seq_len_q=None, max_total_seq_len_kv=None),
         bwd_absent=("dBias", "DSINK_TOKEN", *NO_EXTRAS)),
    Case("sbhd_causal_h100", "h100", dict(qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal"),
         OK, fwd={"Q": T([2, 8, 128, 64], [512, 64, 1024, 1]),
                  "O": T([2, 8, 128, 64], [512, 64, 1024, 1])},
         fwd_node=dict(diagonal_alignment="TOP_LEFT", right_bound=0, left_bound=None),
         bwd={"dO": T([2, 8, 128, 64], [512, 64, 1024, 1])},
         bwd_node=dict(diagonal_alignment="TOP_LEFT", right_bound=0)),
    Case("sb3hd_causal_h100", "h100", dict(qkv_layout="sb3hd", attn_mask_type="causal"), OK,
         fwd={"Q": T([2, 8, 128, 64], [1536, 64, 3072, 1]),
              "K": T([2, 8, 128, 64], [1536, 64, 3072, 1]),
              "O": T([2, 8, 128, 64], [512, 64, 1024, 1])},
         bwd={"dV": T([2, 8, 128, 64], [1536, 64, 3072, 1])}),
    Case("bsh3d_h100", "h100", dict(qkv_layout="bsh3d"), OK,
         fwd={"V": T([2, 8, 128, 64], [196608, 192, 1536, 1]),
              "O": T([2, 8, 128, 64], S128)}),
    Case("gqa_bshd_bs2hd_h100", "h100", dict(qkv_layout="bshd_bs2hd", num_gqa_groups=2,
                                            attn_mask_type="causal"), OK,
         fwd={"Q": T([2, 8, 128, 64], S128), "K": T([2, 2, 128, 64], [32768, 64, 256, 1]),
              "V": T([2, 2, 128, 64], [32768, 64, 256, 1])},
         bwd={"dK": T([2, 2, 128, 64], [32768, 64, 256, 1])}),
    Case("mqa_bshd_bsh2d_h100", "h100", dict(qkv_layout="bshd_bsh2d", num_gqa_groups=1), OK,
         fwd={"K": T([2, 1, 128, 64], [16384, 128, 128, 1])}),
    Case("mla_192_128_causal_h100", "h100", dict(head_dim_qk=192, head_dim_v=128,
                                                attn_mask_type="causal"), OK,
         fwd={"Q": T([2, 8, 128, 192], [196608, 192, 1536, 1]),
              "K": T([2, 8, 128, 192], [196608, 192, 1536, 1]),
              "V": T([2, 8, 128, 128], [131072, 128, 1024, 1]),
              "O": T([2, 8, 128, 128], [131072, 128, 1024, 1])},
         bwd={"dQ": T([2, 8, 128, 192], [196608, 192, 1536, 1]),
              "dO": T([2, 8, 128, 128], [131072, 128, 1024, 1])}),
    Case("bhsd_h100", "h100", dict(qkv_layout="bhsd_bhsd_bhsd"), OK,
         fwd={"Q": T([2, 8, 128, 64], [65536, 8192, 64, 1]),
              "O": T([2, 8, 128, 64], [65536, 8192, 64, 1])}),
    Case("a100_causal_d128", "a100", dict(head_dim_qk=128, attn_mask_type="causal"), OK,
         fwd={"Q": T([2, 8, 128, 128], [131072, 128, 1024, 1])}),
    Case("deterministic_h100", "h100", dict(deterministic=True), OK,
         bwd_node=dict(is_deterministic_algorithm=True)),
    Case("inference_forward_only_h100", "h100", dict(is_training=False), OK,
         fwd={"Stats": T([2, 8, 128, 1], STATS128, "FLOAT")},
         fwd_node=dict(generate_stats=True), graphs=("fwd",)),
    # ------------------------------------------------------------------ padding, dropout
    Case("padding_cu_seqlens_unified_h100", "h100", dict(attn_mask_type="padding"), OK,
         fwd={"CU_SEQ_LEN_Q": T([3, 1, 1, 1], [1, 1, 1, 1], "INT32", name="cu_seq_len_q"),
              "CU_SEQ_LEN_KV": T([3, 1, 1, 1], [1, 1, 1, 1], "INT32", name="cu_seq_len_kv")},
         fwd_node=dict(padding_mask=True, implementation="UNIFIED"),
         fwd_absent=("SEQ_LEN_Q", "SEQ_LEN_KV"),
         bwd={"SEQ_LEN_Q": T([2, 1, 1, 1], [1, 1, 1, 1], "INT32", name="seq_q"),
              "SEQ_LEN_KV": T([2, 1, 1, 1], [1, 1, 1, 1], "INT32", name="seq_kv")},
         bwd_node=dict(padding_mask=True), bwd_absent=("CU_SEQ_LEN_Q", "CU_SEQ_LEN_KV")),
    Case("padding_dropout_seq_len_h100", "h100", dict(attn_mask_type="padding", dropout=0.1), OK,
         fwd={"SEQ_LEN_Q": T([2, 1, 1, 1], [1, 1, 1, 1], "INT32"),
              "Seed": T(*SCALAR, "INT64", by_value=False, name="Seed"),
              "Offset": T(*SCALAR, "INT64", by_value=False, name="Offset")},
         fwd_absent=("CU_SEQ_LEN_Q", "CU_SEQ_LEN_KV"),
         bwd={"Seed": T(*SCALAR, "INT64", by_value=False)}),
    # ------------------------------------------------------------------ thd: the ragged graph
    Case("thd_ragged_h100", "h100", dict(qkv_layout="thd_thd_thd",
                                        attn_mask_type="padding_causal"), OK,
         fwd={"Q": T([2, 8, 1024, 64], S1024, UNSET, **ragged("INT32", 2, 512)),
              "K": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512)),
              "V": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512)),
              "O": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512)),
              "Stats": T([2, 8, 1024, 1], STATS_TH1, "FLOAT", **ragged("INT32", 2, 8)),
              "CU_SEQ_LEN_Q": T([3, 1, 1, 1], [1, 1, 1, 1], "INT32")},
         fwd_node=dict(implementation="UNIFIED", diagonal_alignment="TOP_LEFT", right_bound=0,
                       max_total_seq_len_q=None, max_total_seq_len_kv=None),
         bwd={"Q": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None)),
              "O": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None)),
              "dO": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None)),
              "Stats": T([32, 8, 1024, 1], STATS_TH1, "FLOAT", **ragged("INT64", 32, None)),
              "SEQ_LEN_Q": T([32, 1, 1, 1], [1, 1, 1, 1], "INT32"),
              "dK": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None))},
         bwd_node=dict(max_total_seq_len_q=1024, max_total_seq_len_kv=1024)),
    Case("thd_tokens_and_batch_buckets_h100", "h100",
         dict(qkv_layout="thd_thd_thd", attn_mask_type="padding", batch_size=40,
              num_tokens_q=3000, num_tokens_kv=3000), OK,
         # get_max_tokens(3000) = 4096, get_max_batch_size(40) = 64; fwd keeps b (uses_cu).
         fwd={"Q": T([40, 8, 4096, 64], [2097152, 64, 512, 1], **ragged("INT32", 40, 512)),
              "CU_SEQ_LEN_KV": T([41, 1, 1, 1])},
         bwd={"Q": T([64, 8, 4096, 64], [2097152, 64, 512, 1], **ragged("INT64", 64, None)),
              "SEQ_LEN_KV": T([64, 1, 1, 1])},
         bwd_node=dict(max_total_seq_len_q=4096, max_total_seq_len_kv=4096)),
    Case("thd_dropout_int64_bucketed_fwd_h100", "h100",
         dict(qkv_layout="thd_thd_thd", attn_mask_type="padding", dropout=0.1), OK,
         # dropout turns uses_cu_seqlens_directly off: bucketed batch, INT64, no multipliers.
         fwd={"Q": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None)),
              "Stats": T([32, 8, 1024, 1], STATS_TH1, **ragged("INT64", 32, None)),
              "SEQ_LEN_Q": T([32, 1, 1, 1], [1, 1, 1, 1], "INT32")},
         fwd_absent=("CU_SEQ_LEN_Q",)),
    Case("thd_q_only_dense_a100", "a100",
         dict(qkv_layout="thd_bshd_bshd", attn_mask_type="padding"), OK,
         # sm80: no ragged graph -> batch and max_seqlen dims, BHS1 stats, offsets on q/o only.
         fwd={"Q": T([2, 8, 128, 64], S128, **ragged("INT32", 2, 512)),
              "K": T([2, 8, 128, 64], S128, off=NO),
              "O": T([2, 8, 128, 64], S128, **ragged("INT32", 2, 512)),
              "Stats": T([2, 8, 128, 1], STATS128, off=NO)},
         bwd={"Q": T([2, 8, 128, 64], S128, **ragged("INT64", 2, None)),
              "Stats": T([2, 8, 128, 1], STATS128, off=NO)},
         bwd_node=dict(max_total_seq_len_q=None, max_total_seq_len_kv=None)),
    Case("thd_both_a100_te_refuses", "a100", dict(qkv_layout="thd_thd_thd",
                                                 attn_mask_type="padding"),
         ("derive", "", "fused_cpp.thd_sm90: thd q and k/v need sm >= 90")),
    Case("thd_dense_sm120_rtx5090", "rtx5090", dict(qkv_layout="thd_thd_thd",
                                                   attn_mask_type="padding"), OK,
         fwd={"Q": T([2, 8, 128, 64], S128, **ragged("INT32", 2, 512)),
              "Stats": T([2, 8, 128, 1], STATS128, off=NO)},
         bwd={"K": T([2, 8, 128, 64], S128, **ragged("INT64", 2, None))},
         bwd_node=dict(max_total_seq_len_q=None, max_total_seq_len_kv=None)),
    Case("thd_q_bshd_kv_h100", "h100", dict(qkv_layout="thd_bshd_bshd", attn_mask_type="padding"),
         OK,
         fwd={"Q": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512)),
              "K": T([2, 8, 128, 64], S128, off=NO),
              "Stats": T([2, 8, 1024, 1], STATS_TH1, **ragged("INT32", 2, 8))},
         bwd={"Q": T([32, 8, 1024, 64], S1024, **ragged("INT64", 32, None)),
              "K": T([32, 8, 128, 64], S128, off=NO)},
         bwd_node=dict(max_total_seq_len_q=1024, max_total_seq_len_kv=None)),
    Case("thd_q_sbhd_kv_bucketed_stride_h100", "h100",
         dict(qkv_layout="thd_sbhd_sbhd", attn_mask_type="padding"), OK,
         # SBHD's s-stride is b*h*d with b the graph batch: 2 in the fwd, 32 in the bwd.
         fwd={"K": T([2, 8, 128, 64], [512, 64, 1024, 1], off=NO)},
         bwd={"K": T([32, 8, 128, 64], [512, 64, 16384, 1], off=NO)}),
    Case("t3hd_packed_multipliers_h100", "h100", dict(qkv_layout="t3hd", attn_mask_type="padding"),
         OK,
         fwd={"Q": T([2, 8, 1024, 64], [1572864, 64, 1536, 1], **ragged("INT32", 2, 1536)),
              "K": T([2, 8, 1024, 64], [1572864, 64, 1536, 1], **ragged("INT32", 2, 1536)),
              "O": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512))}),
    # ------------------------------------------------------------------ bias and ALiBi
    Case("family_a_thd_bias_1hss_h100", "h100",
         dict(qkv_layout="thd_thd_thd", attn_mask_type="padding", bias_type="post_scale_bias",
              bias_shape="1hss"),
         ("build_operation_graph", "fwd",
          "dimensions mismatch as broadcasting 2 non-one dimension sizes"),
         fwd={"Bias": T([1, 8, 128, 128], [131072, 16384, 128, 1], UNSET, name="bias"),
              "Q": T([2, 8, 1024, 64], S1024)}),
    Case("family_a_thd_bias_1hss_b200", "b200",
         dict(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal",
              bias_type="post_scale_bias", bias_shape="1hss"),
         ("build_operation_graph", "fwd",
          "dimensions mismatch as broadcasting 2 non-one dimension sizes"),
         fwd={"Bias": T([1, 8, 128, 128], [131072, 16384, 128, 1])}),
    Case("bias_1hss_no_grad_has_dbias_h100", "h100",
         dict(bias_type="post_scale_bias", bias_shape="1hss", bias_requires_grad=False), OK,
         fwd={"Bias": T([1, 8, 128, 128], [131072, 16384, 128, 1], UNSET)},
         bwd={"Bias": T([1, 8, 128, 128], [131072, 16384, 128, 1]),
              "dBias": T([1, 8, 128, 128], [131072, 16384, 128, 1], UNSET, name="dBias")}),
    Case("bias_111s_no_dbias_h100", "h100", dict(bias_type="post_scale_bias", bias_shape="111s"),
         OK, fwd={"Bias": T([1, 1, 1, 128], [128, 128, 128, 1])},
         bwd={"Bias": T([1, 1, 1, 128], [128, 128, 128, 1])}, bwd_absent=("dBias",)),
    Case("bias_b1ss_h100", "h100", dict(bias_type="post_scale_bias", bias_shape="b1ss"), OK,
         fwd={"Bias": T([2, 1, 128, 128], [16384, 16384, 128, 1])},
         bwd={"dBias": T([2, 1, 128, 128], [16384, 16384, 128, 1])}),
    Case("bias_11ss_h100", "h100", dict(bias_type="post_scale_bias", bias_shape="11ss"), OK,
         bwd={"dBias": T([1, 1, 128, 128], [16384, 16384, 128, 1])}),
    Case("bias_bhss_grad_cross_h100", "h100",
         dict(bias_type="post_scale_bias", bias_shape="bhss", bias_requires_grad=True,
              max_seqlen_kv=256), OK,
         fwd={"Bias": T([2, 8, 128, 256], [262144, 32768, 256, 1])},
         bwd={"dBias": T([2, 8, 128, 256], [262144, 32768, 256, 1])}),
    Case("family_b_deterministic_bias_no_grad_b200", "b200",
         dict(bias_type="post_scale_bias", bias_shape="1hss", deterministic=True),
         ("validate", "bwd", "Deterministic algorithm is not supported on blackwell "
                             "architecture when dbias"),
         bwd={"dBias": T([1, 8, 128, 128], [131072, 16384, 128, 1])},
         bwd_node=dict(is_deterministic_algorithm=True)),
    Case("family_b_dropout_bias_b200", "b200",
         dict(bias_type="post_scale_bias", bias_shape="1hss", dropout=0.1),
         ("create_execution_plans", "bwd",
          "With dropout, this engine only supports fprop inference"),
         bwd={"dBias": T([1, 8, 128, 128]), "Seed": T(*SCALAR, "INT64")}),
    Case("bias_111s_dropout_b200", "b200",
         dict(bias_type="post_scale_bias", bias_shape="111s", dropout=0.1), OK,
         bwd_absent=("dBias",)),
    Case("bias_training_b200", "b200", dict(bias_type="post_scale_bias", bias_shape="1hss"), OK,
         bwd={"dBias": T([1, 8, 128, 128])}),
    Case("alibi_causal_h100", "h100", dict(bias_type="alibi", attn_mask_type="causal"), OK,
         fwd_node=dict(alibi_mask=True, diagonal_alignment="TOP_LEFT", right_bound=0),
         fwd_absent=("Bias",), bwd_node=dict(alibi_mask=True), bwd_absent=("Bias", "dBias")),
    Case("alibi_slopes_h_as_1hss_bias_h100", "h100",
         dict(bias_type="alibi", alibi_slopes_shape=(8,), attn_mask_type="causal"), OK,
         fwd={"Bias": T([1, 8, 128, 128], [131072, 16384, 128, 1])},
         fwd_node=dict(alibi_mask=False),
         bwd={"dBias": T([1, 8, 128, 128], [131072, 16384, 128, 1])}),
    Case("alibi_slopes_bh_as_bhss_bias_h100", "h100",
         dict(bias_type="alibi", alibi_slopes_shape=(2, 8)), OK,
         fwd={"Bias": T([2, 8, 128, 128], [131072, 16384, 128, 1])},
         bwd={"dBias": T([2, 8, 128, 128])}),
    Case("alibi_no_window_top_left_h100", "h100",
         dict(bias_type="alibi", bottom_right_diagonal=True),
         ("validate", "fwd", "When alibi mask is used, diagonal_band_right_bound needs to be set"),
         fwd_node=dict(diagonal_alignment="TOP_LEFT", alibi_mask=True)),
    # ------------------------------------------------------------------ masks and windows
    Case("swa_both_sides_bottom_right_h100", "h100", dict(window_size=(64, 64)), OK,
         fwd_node=dict(diagonal_alignment="BOTTOM_RIGHT", left_bound=65, right_bound=64),
         bwd_node=dict(diagonal_alignment="BOTTOM_RIGHT", left_bound=65, right_bound=64)),
    Case("swa_causal_top_left_cross_h100", "h100",
         dict(attn_mask_type="causal", window_size=(128, 0), max_seqlen_q=256,
              max_seqlen_kv=512), OK,
         fwd={"K": T([2, 8, 512, 64], [262144, 64, 512, 1])},
         fwd_node=dict(diagonal_alignment="TOP_LEFT", left_bound=129, right_bound=0)),
    Case("causal_bottom_right_cross_h100", "h100",
         dict(attn_mask_type="causal_bottom_right", max_seqlen_kv=512), OK,
         fwd_node=dict(diagonal_alignment="BOTTOM_RIGHT", left_bound=None, right_bound=0)),
    Case("bottom_right_longer_q_refused_h100", "h100",
         dict(attn_mask_type="causal_bottom_right", max_seqlen_q=256, max_seqlen_kv=128),
         ("validate", "fwd", "Bottom right causal mask does not support max_s_q > max_s_kv")),
    # ------------------------------------------------------------------ softmax types, max logit
    Case("off_by_one_sink_h100", "h100", dict(softmax_type="off-by-one", attn_mask_type="causal"),
         OK, fwd={"SINK_TOKEN": T([1, 8, 1, 1], [8, 1, 1, 1], "FLOAT", name="softmax_offset")},
         bwd={"SINK_TOKEN": T([1, 8, 1, 1], [8, 1, 1, 1], "FLOAT"),
              "DSINK_TOKEN": T([1, 8, 1, 1], [8, 1, 1, 1], "FLOAT", name="d_softmax_offset")}),
    Case("learnable_thd_h100", "h100", dict(softmax_type="learnable", qkv_layout="thd_thd_thd",
                                           attn_mask_type="padding"), OK,
         fwd={"SINK_TOKEN": T([1, 8, 1, 1]), "Q": T([2, 8, 1024, 64])},
         bwd={"DSINK_TOKEN": T([1, 8, 1, 1]), "Q": T([32, 8, 1024, 64])}),
    Case("max_logit_thd_h100", "h100", dict(return_max_logit=True, qkv_layout="thd_thd_thd",
                                           attn_mask_type="padding"), OK,
         fwd={"Max": T([2, 8, 1024, 1], STATS_TH1, "FLOAT", name="Max",
                       **ragged("INT32", 2, 8))}),
    Case("max_logit_bshd_h100", "h100", dict(return_max_logit=True), OK,
         fwd={"Max": T([2, 8, 128, 1], STATS128, "FLOAT", off=NO)}),
    # ------------------------------------------------------------------ paged KV (inference)
    Case("paged_bshd_h100", "h100", dict(qkv_layout="paged_kv_bshd_bshd_bshd", page_size=64,
                                        attn_mask_type="padding", is_training=False), OK,
         # 2 pages per sequence, 4 pages; page_table strides {mpps, mpps, 1, 1}.
         fwd={"K": T([4, 8, 64, 64], [32768, 64, 512, 1]),
              "V": T([4, 8, 64, 64], [32768, 64, 512, 1]),
              "Page_table_K": T([2, 1, 2, 1], [2, 2, 1, 1], "INT32", name="page_table_k"),
              "Page_table_V": T([2, 1, 2, 1], [2, 2, 1, 1], "INT32", name="page_table_v"),
              "CU_SEQ_LEN_KV": T([3, 1, 1, 1])},
         fwd_node=dict(max_seq_len_kv=128), graphs=("fwd",)),
    Case("paged_sbhd_h100", "h100", dict(qkv_layout="paged_kv_sbhd_sbhd_sbhd", page_size=64,
                                        attn_mask_type="padding", is_training=False), OK,
         fwd={"K": T([4, 8, 64, 64], [512, 64, 2048, 1]),
              "Q": T([2, 8, 128, 64], [512, 64, 1024, 1])}, graphs=("fwd",)),
    Case("paged_thd_q_h100", "h100", dict(qkv_layout="paged_kv_thd_bshd_bshd", page_size=64,
                                         attn_mask_type="padding", is_training=False), OK,
         fwd={"Q": T([2, 8, 1024, 64], S1024, **ragged("INT32", 2, 512)),
              "K": T([4, 8, 64, 64], [32768, 64, 512, 1], off=NO)}, graphs=("fwd",)),
    # ------------------------------------------------------------------ FP8
    Case("fp8_delayed_causal_h100", "h100",
         dict(fp8=True, dtype="fp8_e4m3", head_dim_qk=128, attn_mask_type="causal"), OK,
         fwd={"Q": T([2, 8, 128, 128], [131072, 128, 1024, 1], "FP8_E4M3"),
              "O": T([2, 8, 128, 128], [131072, 128, 1024, 1], "FP8_E4M3"),
              "Descale_K": T(*SCALAR, "FLOAT", name="Descale_q"),
              "Scale_O": T(*SCALAR, "FLOAT", by_value=False, name="Scale_o"),
              "Amax_O": T(*SCALAR, "FLOAT"), "Amax_S": T(*SCALAR, "FLOAT"),
              "Stats": T([2, 8, 128, 1], STATS128, "FLOAT")},
         fwd_node=dict(name="sdpa_fp8", diagonal_alignment="TOP_LEFT", right_bound=0),
         bwd={"O": T([2, 8, 128, 128], dtype="FP8_E4M3"), "dO": T(dtype="FP8_E5M2"),
              "dQ": T([2, 8, 128, 128], [131072, 128, 1024, 1], "FP8_E5M2"),
              "Descale_O": T(*SCALAR, "FLOAT", name="Descale_O"),
              "Scale_dQ": T(*SCALAR, "FLOAT", by_value=False, name="Scale_dQ"),
              "Stats": T([2, 8, 128, 1], STATS128, "FLOAT", name="Stats"),
              "Amax_dP": T(*SCALAR, "FLOAT")},
         bwd_node=dict(name="sdpa_fp8_backward", is_deterministic_algorithm=False)),
    Case("fp8_current_scaling_b200", "b200",
         dict(fp8=True, fp8_recipe="current", head_dim_qk=128, attn_mask_type="causal"), OK,
         fwd={"Q": T(dtype="FP8_E4M3"), "O": T(dtype="BFLOAT16"),
              "Scale_O": T([1], [1], "FLOAT", by_value=True)},
         bwd={"dQ": T(dtype="BFLOAT16"), "dO": T(dtype="FP8_E5M2"), "O": T(dtype="BFLOAT16"),
              "Descale_O": T([1], [1], "FLOAT", by_value=True),
              "Scale_dK": T([1], [1], "FLOAT", by_value=True)}),
    Case("fp8_window_bounds_b200", "b200",
         dict(fp8=True, fp8_recipe="current", head_dim_qk=128, attn_mask_type="causal",
              window_size=(64, 0)), OK,
         fwd_node=dict(left_bound=65, right_bound=0, diagonal_alignment="TOP_LEFT")),
    Case("fp8_thd_b200", "b200",
         dict(fp8=True, fp8_recipe="current", head_dim_qk=128, qkv_layout="thd_thd_thd",
              attn_mask_type="padding"), OK,
         fwd={"Q": T([2, 8, 1024, 128], [1048576, 128, 1024, 1], "FP8_E4M3",
                     **ragged("INT32", 2, 1024)),
              "Stats": T([2, 8, 1024, 1], STATS_TH1, **ragged("INT32", 2, 8)),
              "CU_SEQ_LEN_Q": T([3, 1, 1, 1])},
         fwd_node=dict(implementation="UNIFIED"),
         bwd={"Q": T([32, 8, 1024, 128], **ragged("INT64", 32, None)),
              "Stats": T([32, 8, 1024, 1], STATS_TH1, **ragged("INT64", 32, None))},
         # the FP8 backward builder sets no max_total_seq_len
         bwd_node=dict(max_total_seq_len_q=None, max_total_seq_len_kv=None)),
    Case("fp8_sbhd_delayed_b200", "b200",
         dict(fp8=True, head_dim_qk=128, qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal"),
         OK, fwd={"Q": T([2, 8, 128, 128], [1024, 128, 2048, 1], "FP8_E4M3"),
                  "O": T([2, 8, 128, 128], [1024, 128, 2048, 1], "FP8_E4M3")}),
    Case("fp8_thd_training_h100_te_refuses", "h100",
         dict(fp8=True, head_dim_qk=128, qkv_layout="thd_thd_thd", attn_mask_type="padding"),
         ("derive", "", "fused_cpp.fp8_thd_bwd_sm: FP8 thd backward needs sm >= 100")),
    Case("fp8_bias_te_refuses", "b200",
         dict(fp8=True, fp8_recipe="current", head_dim_qk=128, bias_type="post_scale_bias"),
         ("derive", "", "fused_cpp.fp8_bias: FP8 fused attention with bias_type")),
    # ------------------------------------------------------------------ TE's own refusals
    Case("fp32_te_refuses", "h100", dict(dtype="fp32"),
         ("derive", "", "Unsupported QKV dtype qkv_dtype=fp32")),
    Case("pre_scale_bias_te_refuses", "h100", dict(bias_type="pre_scale_bias"),
         ("derive", "", "fused_cpp.pre_scale_bias:")),
    Case("thd_without_padding_te_refuses", "h100", dict(qkv_layout="thd_thd_thd"),
         ("derive", "", "fused_cpp.thd_mask: thd needs a padding mask type")),
]  # fmt: skip


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    env = dict(os.environ, TE_FL_ATTENTION_STUB_DIR=str(tmp_path_factory.mktemp("stubcuda")))
    w = CudnnWorker(env=env)
    yield w
    w.close()


def run(worker, device: str, **fields: Any) -> dict[str, Any]:
    r = worker.probe(FusedAttnConfig(**{**BASE, **fields}).to_dict(), device, spec=True)
    json.dumps(r)  # plain JSON through the worker
    return r


def _role(graph: dict[str, Any], role: str) -> dict[str, Any] | None:
    node = graph["nodes"][0]
    uid = node["inputs"].get(role, node["outputs"].get(role))
    if uid is None:
        return None
    return next(t for t in graph["tensors"] if t["uid"] == uid)


def _check_tensor(graph: dict[str, Any], which: str, role: str, want: dict[str, Any]) -> None:
    t = _role(graph, role)
    assert t is not None, f"{which}: no {role} in {sorted(graph['nodes'][0]['inputs'])}"
    where = f"{which} {role}"
    for key, json_key in (("dim", "dim"), ("stride", "stride"), ("name", "name"),
                          ("by_value", "is_pass_by_value")):  # fmt: skip
        if key in want:
            assert t[json_key] == want[key], (where, key, t)
    if "dtype" in want:
        assert t["data_type"] == want["dtype"], (where, t)
    if "off" in want:
        if want["off"] == NO:
            assert "ragged_offset_uid" not in t, (where, t)
        else:
            off = next(x for x in graph["tensors"] if x["uid"] == t["ragged_offset_uid"])
            assert (off["data_type"], off["dim"], off["stride"]) == (*want["off"], [1, 1, 1, 1])
    if "mult" in want:
        assert t.get("ragged_offset_multiplier") == want["mult"], (where, t)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_te_graph(worker, case: Case):
    r = run(worker, case.device, **case.config)
    if case.verdict == OK:
        assert r["supported"] and r["decided"] and r["code"] is None, r["summary"]
        assert r["heur_mode"]["fwd"] == "A" and r["plans"]["fwd"]
    else:
        step, graph, text = case.verdict
        assert not r["supported"] and r["decided"], r
        assert r["step"] == step and (r["graph"] or "") == graph, (r["step"], r["graph"])
        assert r["code"] == ("cudnn.te_refused" if step == "derive" else "cudnn.not_supported")
        assert text in r["message"] and text in r["summary"]
    spec = r["graph_spec"]
    graphs = case.graphs
    if graphs is None:
        if case.verdict == OK or case.verdict[1] == "bwd":
            graphs = ("fwd", "bwd") if case.config.get("is_training", True) else ("fwd",)
        else:
            graphs = ("fwd",) if case.verdict[0] != "derive" else ()
    assert sorted(spec) == sorted(graphs)
    for which, tensors, node, absent in (("fwd", case.fwd, case.fwd_node, case.fwd_absent),
                                         ("bwd", case.bwd, case.bwd_node, case.bwd_absent)):
        if which not in spec:
            assert not (tensors or node or absent), f"{which} expectations but no {which} graph"
            continue
        g = spec[which]
        assert len(g["nodes"]) == 1 and g["context"]["intermediate_data_type"] == "FLOAT"
        for role, want in tensors.items():
            _check_tensor(g, which, role, want)
        for key, value in node.items():
            assert g["nodes"][0][key] == value, (which, key, g["nodes"][0][key])
        for role in absent:
            assert _role(g, role) is None, (which, role)


def test_table_spans_te_families():
    ids = " ".join(c.id for c in CASES)
    assert len(CASES) >= 30
    for family in ("thd", "bshd", "sbhd", "gqa", "mqa", "mla", "swa", "bias_1hss", "bias_111s",
                   "bias_b1ss", "bias_11ss", "bias_bhss", "alibi", "dropout", "off_by_one",
                   "learnable", "paged", "fp8", "max_logit", "deterministic"):  # fmt: skip
        assert family in ids, family
    assert {c.device for c in CASES} >= {"h100", "b200", "a100", "rtx5090"}


def test_spec_is_opt_in_and_derived_config_is_reported(worker):
    cfg = FusedAttnConfig(**{**BASE, "qkv_layout": "thd_thd_thd", "attn_mask_type": "padding"})
    plain = worker.probe(cfg.to_dict(), "h100")
    assert "graph_spec" not in plain and "derived" not in plain
    d = worker.probe(cfg.to_dict(), "h100", spec=True)["derived"]
    assert (d["graph_batch_size_fwd"], d["graph_batch_size_bwd"]) == (2, 32)
    assert (d["graph_max_seqlen_q"], d["graph_max_seqlen_kv"]) == (1024, 1024)
    assert (d["ragged_offset_type_fwd"], d["ragged_offset_type_bwd"]) == ("INT32", "INT64")
    assert d["uses_cu_seqlens_directly"] and d["uses_ragged_graph"] and d["uses_ragged_stats"]


def test_configs_in_one_token_bucket_build_one_graph(worker):
    def spec(tokens: int) -> dict[str, Any]:
        out = run(worker, "h100", qkv_layout="thd_thd_thd", attn_mask_type="padding",
                  num_tokens_q=tokens, num_tokens_kv=tokens)["graph_spec"]  # fmt: skip
        for g in out.values():
            g.pop("gid")  # cudnn-frontend's running graph number
        return out

    a, b, c = spec(600), spec(1000), spec(1100)
    assert a == b and a != c
    assert _role(c["fwd"], "Q")["dim"] == [2, 8, 2048, 64]


def test_other_heuristic_modes_are_only_a_note(worker):
    """The verdict is the first mode's (heur_mode.A by default: the only one TE asks); another
    mode that would offer a plan is a note. Shown with the modes swapped, since heur_mode.A
    proposes a plan for this graph and FALLBACK does not."""
    cfg = FusedAttnConfig(**BASE).to_dict()
    r = worker.probe(cfg, "h100", heuristics=("FALLBACK", "A"))
    assert (r["supported"], r["decided"], r["step"], r["graph"]) == (
        False, True, "create_execution_plans", "fwd")  # fmt: skip
    assert r["heur_mode"] == {"fwd": "FALLBACK"}
    (note,) = [n for n in r["notes"] if "would have offered" in n]
    assert "heur_mode.A would have offered" in note
    assert "the verdict is heur_mode.FALLBACK's" in note
    r = worker.probe(cfg, "h100")
    assert r["supported"] and r["heur_mode"] == {"fwd": "A", "bwd": "A"}
    assert not any("would have offered" in n for n in r["notes"])


# ------------------------------------------------------------------ the two families
# Verdict-only (no spec), so they run against the code before this change too: there all four
# said "supported".
def test_family_a_thd_post_scale_bias_training_refused_on_sm90_and_sm100(worker):
    for device in ("h100", "b200"):
        r = worker.probe(FusedAttnConfig(**{**BASE, "qkv_layout": "thd_thd_thd",
                                            "attn_mask_type": "padding",
                                            "bias_type": "post_scale_bias",
                                            "bias_shape": "1hss"}).to_dict(), device)  # fmt: skip
        assert not r["supported"] and r["decided"], (device, r["summary"])
        assert (r["step"], r["graph"]) == ("build_operation_graph", "fwd")
        assert "dimensions mismatch as broadcasting 2 non-one dimension sizes" in r["message"]


def test_family_a_control_bshd_bias_and_thd_without_bias_supported(worker):
    bias = dict(bias_type="post_scale_bias", bias_shape="1hss")
    thd = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding")
    for device in ("h100", "b200"):
        for kw in (bias, thd):
            r = worker.probe(FusedAttnConfig(**{**BASE, **kw}).to_dict(), device)
            assert r["supported"], (device, kw, r["summary"])


def test_family_b_blackwell_bias_training_with_determinism_or_dropout_refused(worker):
    def probe(**kw: Any) -> dict[str, Any]:
        return worker.probe(FusedAttnConfig(**{**BASE, "bias_type": "post_scale_bias",
                                               "bias_shape": "1hss", **kw}).to_dict(), "b200")

    r = probe(deterministic=True)  # no grad asked: TE's bwd graph still has dBias
    assert not r["supported"] and (r["step"], r["graph"]) == ("validate", "bwd")
    assert ("Deterministic algorithm is not supported on blackwell architecture when dbias"
            in r["message"])  # fmt: skip
    r = probe(dropout=0.1)
    assert not r["supported"] and (r["step"], r["graph"]) == ("create_execution_plans", "bwd")
    assert "With dropout, this engine only supports fprop inference" in r["message"]


def test_family_b_what_blackwell_still_accepts(worker):
    """Neither determinism nor dropout: TE's dBias graph is supported on sm100; a [1,1,1,s_kv]
    bias has no dBias, so dropout is fine there; inference has no backward graph."""
    for kw in (dict(bias_shape="1hss"), dict(bias_shape="bhss", bias_requires_grad=True),
               dict(bias_shape="111s", dropout=0.1), dict(bias_shape="1hss", dropout=0.1,
                                                          is_training=False)):  # fmt: skip
        r = worker.probe(FusedAttnConfig(**{**BASE, "bias_type": "post_scale_bias",
                                            **kw}).to_dict(), "b200")  # fmt: skip
        assert r["supported"], (kw, r["summary"])

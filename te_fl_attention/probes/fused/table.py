"""FusedAttention (cuDNN): a prediction of cuDNN's own verdict for TE's graphs
(``TABLE_RULES``, stage ``rule``, codes ``cudnn_table.*``), for when cuDNN cannot be asked."""

from __future__ import annotations

import dataclasses

from ...config import FusedAttnConfig, te_max_batch_size, te_max_tokens
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import (
    Rule,
    fmt_version,
    reject,
)
from .cp import cp_steps
from .cpp import (
    cpp_qkv_format,
    fp8_layouts,
    is_f16,
    known_device,
    layout_formats,
    ragged_graph,
    ragged_sides,
)
from .rules import FP8, cudnn_of, fused_bias, fused_sub_backend


# --------------------------------------------------------------- cuDNN's verdict, predicted
def _t(code: str, message: str, observed: object, limit: object, hint: str | None = None
       ) -> Reason:  # fmt: skip
    return reject(
        f"cudnn_table.{code}",
        message + " (a prediction of cuDNN's verdict)",
        observed=observed,
        limit=limit,
        hint=hint,
    )


def _bias_dims(c: FusedAttnConfig) -> tuple[int, int, int, int] | None:
    """The ``[b, h, s_q, s_kv]`` bias tensor TE's graphs get for a post_scale_bias (ALiBi with
    slopes included: TE passes it as a ``(1|b, h, s_q, s_kv)`` bias), or None."""
    btype, shape, _ = fused_bias(c)
    if btype != "post_scale_bias" or shape is None:
        return None
    return (c.batch_size if shape[0] == "b" else 1, c.num_heads if shape[1] == "h" else 1,
            1 if shape == "111s" else c.max_seqlen_q, c.max_seqlen_kv)  # fmt: skip


def _has_dbias(c: FusedAttnConfig) -> bool:
    """TE 2.20.2 fused_attn_f16_arbitrary_seqlen.cu, create_graph_f16_bwd: the backward graph
    carries dBias for every post_scale_bias except a ``[1, 1, 1, s_kv]`` one, whether or not the
    bias requires grad (the torch extension always allocates dBias)."""
    dims = _bias_dims(c)
    return c.is_training and dims is not None and dims[:3] != (1, 1, 1)


def table_arch(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN by version and sm, as TE's pre-2.20 support table (nvte_get_fused_attn_backend)
    stated it: F16 needs 80 <= sm < 100, or sm >= 100 with cuDNN 9.7; FP8 needs sm >= 90; sm120
    needs cuDNN 9.18.1; cuDNN 9.10.0/9.10.1 are excluded. TE 2.20.2 requires cuDNN 9.12, so the
    gates below 9.12 only answer what-if versions (``h100:cudnn=9.10.2``)."""
    sm, cv = d.sm or 0, cudnn_of(d)
    if cv < (9, 0, 0):
        return _t("cudnn_old", "cuDNN older than 9.0", fmt_version(cv), ">= 9.0")
    if cv[:2] == (9, 10) and cv[2] in (0, 1):
        return _t(
            "cudnn_9_10",
            "cuDNN 9.10.0/9.10.1 are excluded for fused attention",
            fmt_version(cv),
            "not 9.10.0/9.10.1",
            hint="use cuDNN 9.10.2+",
        )
    if fused_sub_backend(c) == FP8 and sm < 90:
        return _t("fp8_sm", f"FP8 fused attention needs sm >= 90 (found sm{sm})", sm, ">= 90")
    if sm >= 100 and cv < (9, 7, 0):
        return _t("blackwell_cudnn", "sm >= 100 needs cuDNN 9.7", fmt_version(cv), ">= 9.7.0")
    if sm == 120 and cv < (9, 18, 1):
        return _t("sm120_cudnn", "sm120 needs cuDNN 9.18.1", fmt_version(cv), ">= 9.18.1")
    return None


def table_head_dim(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN's F16 head dims, as TE's pre-2.20 support table (nvte_get_fused_attn_backend)
    stated them: both % 8 == 0 and <= 128; <= 256 on sm90 (training cuDNN 9.5); any size for
    inference on cuDNN 9.10.2+ (s_q > 1, or paged, or non-causal decode); (192, 128) training on
    sm100+ (cuDNN 9.11); (256, 256) training on sm100-109 (cuDNN 9.23, 9.25 for thd); minus the
    Hopper MLA backward bug (cuDNN 9.11+, dqk, dv >= 128, dqk != dv, not (192, 128)). TE 2.20.2's
    C++ has no head-dim rule for F16 (cuDNN answers); the gates below cuDNN 9.12 (TE 2.20.2's
    minimum) only answer what-if versions."""
    dqk, dv, sm, cv = c.head_dim_qk, c.head_dim_v, d.sm or 0, cudnn_of(d)
    if fused_sub_backend(c) == FP8:
        return _table_fp8_dims(c, d)
    if dqk % 8 or dv % 8:
        return _t(
            "head_dim_align",
            f"head dims ({dqk}, {dv}) must be multiples of 8",
            (dqk, dv),
            "% 8 == 0",
            hint="pad the head dim to a multiple of 8",
        )
    train = c.is_training
    ok = dqk <= 128 and dv <= 128
    ok = ok or (sm == 90 and dqk <= 256 and dv <= 256 and cv >= ((9, 5, 0) if train else (9, 1, 0)))
    ok = ok or (not train and sm >= 100 and cv >= (9, 9, 0) and c.max_seqlen_q > 1
                and not c.paged)  # fmt: skip
    ok = ok or (not train and cv >= (9, 10, 2) and (
        c.paged or c.max_seqlen_q > 1
        or c.attn_mask_type not in ("causal", "padding_causal")))  # fmt: skip
    ok = ok or ((dqk, dv) == (192, 128) and train and sm >= 100 and cv >= (9, 11, 0))
    ok = ok or ((dqk, dv) == (256, 256) and train and 100 <= sm < 110
                and cv >= ((9, 25, 0) if c.qkv_format == "thd" else (9, 23, 0))
                and not c.paged and c.bias_type == "no_bias" and not c.dropout
                and c.softmax_type == "vanilla")  # fmt: skip
    if not ok:
        return _t("head_dim", f"head dims ({dqk}, {dv}) on sm{sm} with cuDNN {fmt_version(cv)} "
                  f"({'training' if train else 'inference'})", (dqk, dv),
                  "<= 128; <= 256 on sm90; larger for inference on cuDNN 9.10.2+")  # fmt: skip
    if train and sm == 90 and cv >= (9, 11, 0) and dqk >= 128 and dv >= 128 and dqk != dv \
            and (dqk, dv) != (192, 128):  # fmt: skip
        return _t(
            "hopper_mla_bwd",
            f"MLA backward ({dqk}, {dv}) on sm90 hits a cuDNN bug",
            (dqk, dv),
            "dqk == dv, or (192, 128), or a dim < 128",
        )
    return None


def _table_fp8_dims(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN's FP8 head dims and formats, as TE's pre-2.20 table (nvte_get_fused_attn_backend)
    stated them: d % 16 == 0 and (sm < 100: inference d <= 256, training d == 128; sm >= 100:
    d <= 128, or dqk <= 192 / dv <= 128 on cuDNN 9.21); bhsd needs cuDNN 9.21. On sm >= 100 the
    FP8 backward runs cuDNN's deterministic FP8 algorithm, which takes no dropout (cuDNN 9.28.1,
    deviceless: "FP8 deterministic algorithm ... is not supported on Blackwell when dropout is
    enabled"). TE 2.20.2's C++ refuses FP8 bias, mixed formats and the thd limits itself
    (``cpp_fp8``)."""
    dqk, dv, sm, cv = c.head_dim_qk, c.head_dim_v, d.sm or 0, cudnn_of(d)
    aligned = dqk % 16 == 0 and dv % 16 == 0
    if sm < 100:
        ok = aligned and ((not c.is_training and dqk <= 256 and dv <= 256)
                          or (dqk == dv == 128))  # fmt: skip
    else:
        ok = aligned and ((dqk <= 128 and dv <= 128) or (cv >= (9, 21, 0) and dqk <= 192
                                                         and dv <= 128))  # fmt: skip
    if not ok:
        return _t(
            "fp8_head_dim",
            f"FP8 head dims ({dqk}, {dv}) on sm{sm}",
            (dqk, dv),
            "% 16 == 0; sm90: 128 training, <= 256 inference; sm100: <= 128",
        )
    fmt = cpp_qkv_format(fp8_layouts(c)[0])
    if fmt == "bhsd" and cv < (9, 21, 0):
        return _t("fp8_format", "FP8 fused attention with qkv_format = bhsd needs cuDNN 9.21",
                  fmt_version(cv), ">= 9.21.0")  # fmt: skip
    if sm >= 100 and c.is_training and c.dropout:
        return _t("fp8_blackwell_dropout", f"FP8 backward with dropout on sm{sm}", c.dropout,
                  "no dropout in FP8 training on sm >= 100")  # fmt: skip
    return None


def table_bias(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN and biases. As TE's pre-2.20 table (nvte_get_fused_attn_backend) stated it: ALiBi
    (without slopes: cuDNN's alibi mask) needs sm90 and a non-padding causal mask. That table's
    "no post_scale_bias with a padding mask" was TE's own refusal, which 2.20.2's C++ no longer
    makes: it asks cuDNN, which builds TE's bias graph with padding (and the post_scale_bias TE
    turns ALiBi slopes into; cuDNN 9.28.1, sm80/90/100/120), so it is not predicted. From TE
    2.20.2's graphs (fused_attn_f16_arbitrary_seqlen.cu, create_graph_f16_fwd/bwd): on the ragged
    graph (thd on sm >= 90, not sm120) the sequence dims are the bucketed token counts
    (get_max_tokens) and the batch is bucketed (get_max_batch_size; forward keeps the real batch
    with cu_seqlens, cuDNN >= 9.24 without dropout), so a bias whose dims are neither 1 nor the
    graph's cannot broadcast ("dimensions mismatch as broadcasting 2 non-one dimension sizes")."""
    btype, _, _ = fused_bias(c)
    m, sm = c.attn_mask_type, d.sm or 0
    if btype == "alibi" and (sm < 90 or m in ("no_mask", "padding", "padding_causal",
                                              "padding_causal_bottom_right")):  # fmt: skip
        return _t(
            "alibi",
            f"ALiBi without slopes needs sm >= 90 and a non-padding causal mask "
            f"(found {m} on sm{d.sm})",
            (m, d.sm),
            "causal or causal_bottom_right, sm90+",
        )
    ragged = _ragged_bias_mismatch(c, d)
    if ragged is not None:
        return ragged
    return None


def _graph_seqlens(c: FusedAttnConfig, d: DeviceProfile) -> tuple[int, int]:
    """The sequence dims of TE's graphs (``graph_max_seqlen_q/kv`` in TE 2.20.2's ``derive()``):
    the bucketed token count for a ragged tensor on the ragged graph, else ``max_seqlen``."""
    rq, rkv = ragged_sides(c)
    ragged = ragged_graph(d)

    def tokens(name: str, seqlen: int) -> int:
        return getattr(c, name, None) or te_max_tokens(c.batch_size * seqlen)

    return (tokens("num_tokens_q", c.max_seqlen_q) if rq and ragged else c.max_seqlen_q,
            tokens("num_tokens_kv", c.max_seqlen_kv) if rkv and ragged else c.max_seqlen_kv)


def _ragged_bias_mismatch(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """``table_bias``'s ragged-graph broadcast check (see there)."""
    rq, rkv = ragged_sides(c)
    bias = _bias_dims(c)
    cv = cudnn_of(d)
    if bias is None or not (rq or rkv) or not ragged_graph(d) or not is_f16(c):
        return None
    s_q, s_kv = _graph_seqlens(c, d)
    uses_cu = cv >= (9, 24, 0) and not (c.is_training and c.dropout)
    batches = [("fwd", c.batch_size if uses_cu else te_max_batch_size(c.batch_size))]
    if c.is_training:
        batches.append(("bwd", te_max_batch_size(c.batch_size)))
    for graph, b in batches:
        dims = (b, c.num_heads, s_q, s_kv)
        if any(x not in (1, g) for x, g in zip(bias, dims, strict=True)):
            return _t("thd_bias_ragged", f"a [{', '.join(map(str, bias))}] bias does not "
                      f"broadcast to the ragged {graph} graph's [{', '.join(map(str, dims))}]",
                      bias, "1 or the graph's dims (bucketed tokens and batch)")  # fmt: skip
    return None


def table_mask_layout(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN by mask and format, as TE's pre-2.20 table (nvte_get_fused_attn_backend) stated
    it: thd with GQA/MQA needs cuDNN 9.6; mixed q/kv formats need cuDNN 9.7; bottom-right masks
    need s_q <= s_kv; paged KV needs no bias and no dropout below cuDNN 9.7; a non-vanilla softmax
    needs cuDNN 9.13.1; return_max_logit needs cuDNN 9.21. A bottom-right causal mask takes no
    bias, ALiBi (slopes or not) or training dropout, any s_q/s_kv, padding or not (cudnn-frontend
    1.32 SDPA validate: "Bottom right causal mask is only supported with is_bias=False,
    is_alibi=False, is_dropout=False"; verified deviceless with cuDNN 9.28.1 on TE 2.20.2's
    graphs, sm80/90/100; TE's old table allowed it from cuDNN 9.7). The gates below cuDNN 9.12
    (TE 2.20.2's minimum) only answer what-if versions. (TE 2.20.2's C++ refuses thd/paged
    without a padding mask itself; one ragged side below sm90 is cuDNN's to answer.)"""
    m, cv = c.attn_mask_type, cudnn_of(d)
    q_format, kv_format = layout_formats(c.qkv_layout)
    thd = "thd" in (q_format, kv_format)
    if thd and c.num_heads != c.num_gqa_groups and cv < (9, 6, 0):
        return _t("thd_gqa", "thd with GQA/MQA needs cuDNN 9.6", fmt_version(cv), ">= 9.6.0")
    if q_format != kv_format and cv < (9, 7, 0):
        return _t(
            "mixed_format", "different q and kv formats need cuDNN 9.7", fmt_version(cv), ">= 9.7.0"
        )
    if "bottom_right" in m and c.max_seqlen_q > c.max_seqlen_kv:
        return _t(
            "bottom_right_sq",
            f"{m} with s_q = {c.max_seqlen_q} > s_kv = {c.max_seqlen_kv}",
            (c.max_seqlen_q, c.max_seqlen_kv),
            "s_q <= s_kv",
        )
    dropout = c.is_training and c.dropout  # TE's is_dropout (derive())
    btype = fused_bias(c)[0]  # ALiBi slopes: the post_scale_bias TE's Python turns them into
    if "bottom_right" in m and (btype != "no_bias" or dropout):
        what = btype if btype != "no_bias" else "dropout"
        if btype != c.bias_type:
            what += " (TE's bias for the ALiBi slopes)"
        return _t(
            "bottom_right_bias_dropout",
            f"{m} with {what}",
            (m, btype, c.dropout),
            "a bottom-right causal mask without bias, ALiBi or dropout",
        )
    if cv < (9, 7, 0) and c.paged and (c.bias_type != "no_bias" or dropout):
        return _t(
            "mask_bias_dropout",
            "paged KV with bias or dropout needs cuDNN 9.7",
            fmt_version(cv),
            ">= 9.7.0",
        )
    if c.softmax_type != "vanilla" and cv < (9, 13, 1):
        return _t(
            "softmax_cudnn",
            f"softmax_type = {c.softmax_type} needs cuDNN 9.13.1",
            fmt_version(cv),
            ">= 9.13.1",
        )
    if c.return_max_logit and cv < (9, 21, 0):
        return _t(
            "max_logit_cudnn", "return_max_logit needs cuDNN 9.21", fmt_version(cv), ">= 9.21.0"
        )
    return None


def table_short_sequences(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN and one-token graphs (cudnn-frontend 1.32 SDPA validate, verified deviceless with
    cuDNN 9.28.1 on TE 2.20.2's graphs): a forward graph with s_q == 1 takes no sink token (a
    non-vanilla softmax: "decode only mode, i.e. s_q == 1, not supported with sink_token"); a
    backward graph with s_q == s_kv == 1 is refused ("s_q = s_kv = 1 is not supported"). The
    sequence dims are the graph's (TE 2.20.2 derive(): a ragged tensor's are its bucketed token
    count on sm >= 90, not sm120)."""
    s_q, s_kv = _graph_seqlens(c, d)
    if s_q == 1 and c.softmax_type != "vanilla":
        return _t("decode_sink", f"s_q = 1 with softmax_type = {c.softmax_type}",
                  (s_q, c.softmax_type), "s_q > 1 or the vanilla softmax")  # fmt: skip
    if c.is_training and s_q == s_kv == 1:
        return _t("bwd_s1", "a backward graph with s_q = s_kv = 1", (s_q, s_kv),
                  "s_q > 1 or s_kv > 1, or inference")  # fmt: skip
    return None


def table_window(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN and sliding windows, as TE's pre-2.20 table (nvte_get_fused_attn_backend) stated
    it: cuDNN 9.2 (left, 0) windows; 9.6 any (left, right) with no_mask, padding or bottom-right
    masks; never with bias; top-left causal windows only for s_q == s_kv. The 9.2/9.6 gates are
    below TE 2.20.2's minimum cuDNN (9.12): what-if versions only."""
    if not c.has_window:
        return None
    cv, m = cudnn_of(d), c.attn_mask_type
    if cv < (9, 2, 0):
        return _t("window_cudnn", "sliding window needs cuDNN 9.2", fmt_version(cv), ">= 9.2.0")
    if c.bias_type != "no_bias":
        return _t("window_bias", "sliding window with a bias", c.bias_type, "no_bias")
    if c.window_size[1] not in (0, -1) and cv < (9, 6, 0):  # type: ignore[index]
        return _t(
            "window_right", "a window with right > 0 needs cuDNN 9.6", fmt_version(cv), ">= 9.6.0"
        )
    if m in ("causal", "padding_causal") and c.max_seqlen_q != c.max_seqlen_kv:
        return _t(
            "window_top_left_cross",
            f"sliding window with top-left {m} for cross-attention",
            m,
            "bottom-right masks for s_q != s_kv",
        )
    return None


def table_blackwell_training(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN's sm >= 100 backward for TE's graphs: deterministic needs cuDNN 9.18.1 and no
    dropout, ALiBi or dBias ("Deterministic algorithm is not supported on blackwell architecture
    when dbias, rng/dropout, alibi is enabled"); dropout together with dBias has no engine
    (cuDNN 9.28.1 on sm100; on sm120 it finds one: rule_drift); deterministic training on sm120
    is never supported (TE's pre-2.20 table; cuDNN 9.28.1 accepts it: rule_drift). dBias as TE
    2.20.2 builds it: every post_scale_bias except ``[1, 1, 1, s_kv]``, requires_grad or not
    (fused_attn_f16_arbitrary_seqlen.cu, create_graph_f16_bwd)."""
    if (d.sm or 0) < 100 or not c.is_training:
        return None
    btype, _, _ = fused_bias(c)
    dbias, alibi = _has_dbias(c), btype == "alibi"
    if d.sm == 120 and c.deterministic:
        return _t("sm120_det", "deterministic training on sm120", True, False)
    if c.deterministic and (cudnn_of(d) < (9, 18, 1) or c.dropout or dbias or alibi):
        return _t(
            "blackwell_det",
            "deterministic training on sm >= 100 needs cuDNN 9.18.1 and no dropout, ALiBi or "
            "dBias",
            (fmt_version(cudnn_of(d)), c.dropout, "dBias" if dbias else btype),
            "cuDNN >= 9.18.1, dropout 0, no ALiBi, no bias or a [1, 1, 1, s_kv] one",
        )
    if c.dropout and dbias:
        return _t(
            "blackwell_dropout_bias",
            "dropout together with dBias on sm >= 100",
            (c.dropout, _bias_dims(c)),
            "dropout, or no bias / a [1, 1, 1, s_kv] bias",
        )
    return None


def per_cp_step(rule: Rule) -> Rule:
    """A table rule as TE 2.20.2 asks cuDNN with context parallelism: once per per-step config
    (:func:`.cp.cp_steps`, TE's ``cp_per_step_configs``); the first step it refuses answers, its
    message naming the step. Without context parallelism, the rule itself."""

    def stepped(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        steps = cp_steps(c)
        if not steps:
            return rule(c, d)
        for step in steps:
            if step.config is None:  # no valid step config: table_cp_steps refuses it
                continue
            reason = rule(step.config, d)
            if reason is not None:
                return dataclasses.replace(reason, message=f"{step.describe()}: {reason.message}")
        return None

    stepped.__name__, stepped.__doc__ = rule.__name__, rule.__doc__
    return stepped


def table_cp_steps(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """A context-parallel step TE's C++ query gets with a sequence length (or heads) of 0
    (``cp_per_step_configs`` divides s by the ranks unchecked: TE needs every sequence length to
    be a multiple of 2 * cp_size): no graph with a 0 dim is built, so fused is predicted
    refused there; the probe builds no graph for it either (undecided)."""
    for step in cp_steps(c):
        if step.error is not None:
            p = step.params
            return _t("cp_step_invalid", f"{step.describe()} is no valid query: {step.error}",
                      (p["max_seqlen_q"], p["max_seqlen_kv"], p["num_heads"]),
                      "s_q, s_kv multiples of 2 * cp_size; heads divisible by the a2a group",
                      hint="pad the sequences to a multiple of 2 * cp_size")  # fmt: skip
    return None


#: cuDNN's graph rules, each asked once per context-parallel step (as TE queries cuDNN).
_GRAPH_RULES: tuple[Rule, ...] = tuple(per_cp_step(r) for r in (
    table_arch, table_head_dim, table_bias, table_mask_layout, table_short_sequences,
    table_window, table_blackwell_training,
))  # fmt: skip

TABLE_RULES: tuple[Rule, ...] = tuple(known_device(r) for r in (table_cp_steps, *_GRAPH_RULES))

"""FusedAttention (cuDNN): what TE 2.20.2's C++ query ``nvte_get_fused_attn_backend_v2``
(``fused_attn.cpp``) refuses before it builds a cuDNN graph (``CPP_RULES``, codes ``fused_cpp.*``;
binding), and ``BINDING_RULES``: everything TE decides before cuDNN is asked."""

from __future__ import annotations

import functools

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import (
    Rule,
    cudnn_version,
    fmt_version,
    reject,
)
from .cp import cp_steps
from .rules import (
    F16_ARBITRARY_SEQLEN,
    FP8,
    PYTHON_RULES,
    cudnn_of,
    determinism,
    fused_bias,
    fused_sub_backend,
)


# ---------------------------------------------------------- TE's C++ refusals (before cuDNN)
def known_device(rule: Rule) -> Rule:
    """Table rules need a GPU and a cuDNN version (their absence is reported once, earlier)."""

    def guarded(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        return rule(c, d) if d.sm is not None and cudnn_version(d) is not None else None

    guarded.__name__, guarded.__doc__ = rule.__name__, rule.__doc__
    return guarded


@functools.lru_cache(maxsize=256)
def layout_formats(layout: str) -> tuple[str, str]:
    """The q and kv formats the C++ side reads off a layout (``nvte_get_q_format`` /
    ``nvte_get_kv_format``): ``sbhd_bs2hd`` -> (sbhd, bshd), ``t3hd`` -> (thd, thd)."""
    parts = layout.replace("paged_kv_", "").split("_")
    alpha = ["".join(ch for ch in p if ch.isalpha()) for p in parts]
    return alpha[0], alpha[-1]


@functools.lru_cache(maxsize=256)
def cpp_qkv_format(layout: str) -> str:
    """``nvte_get_qkv_format``: the common format, or ``q_2kv`` for mixed q/kv formats."""
    q, kv = layout_formats(layout)
    return q if q == kv else f"{q}_2{kv}"


def ragged_sides(c: FusedAttnConfig) -> tuple[bool, bool]:
    """``FusedAttnConfig::derive()``: ``is_ragged_q`` / ``is_ragged_kv`` (a thd q / k-v)."""
    return _ragged_layout(c.qkv_layout)


@functools.lru_cache(maxsize=256)
def _ragged_layout(layout: str) -> tuple[bool, bool]:
    q, kv = layout_formats(layout)
    return q == "thd", kv == "thd"


def fp8_layouts(c: FusedAttnConfig) -> tuple[str, str]:
    """The ``qkv_layout`` and ``dqkv_layout`` TE hands the FP8 C++ query
    (``get_fused_attn_spec``): ``paged_kv_`` dropped; for MXFP8 anything but bshd/sbhd becomes
    ``bhsd_bhsd_bhsd``; ``dqkv_layout`` is the caller's layout."""
    layout = c.qkv_layout.replace("paged_kv_", "")
    if c.fp8_recipe == "mxfp8" and layout not in ("bshd_bshd_bshd", "sbhd_sbhd_sbhd"):
        layout = "bhsd_bhsd_bhsd"
    return layout, c.qkv_layout


def ragged_graph(d: DeviceProfile) -> bool:
    """``uses_ragged_graph`` in TE 2.20.2's ``derive()``: sm >= 90 and not sm120."""
    return (d.sm or 0) >= 90 and d.sm != 120


def _step_seqlens_kv(c: FusedAttnConfig) -> tuple[int, ...]:
    """The s_kv of every graph TE's C++ query is asked about: with context parallelism, one per
    per-step config (TE 2.20.2 context_parallel.py, ``cp_per_step_configs``; :func:`.cp.cp_steps`),
    else the config's own."""
    steps = cp_steps(c)
    if not steps:
        assert c.max_seqlen_kv is not None
        return (c.max_seqlen_kv,)
    return tuple(dict.fromkeys(s.params["max_seqlen_kv"] for s in steps))


def is_f16(c: FusedAttnConfig) -> bool:
    return fused_sub_backend(c) == F16_ARBITRARY_SEQLEN and c.dtype in ("fp16", "bf16")


def _c(code: str, message: str, observed: object, limit: object, hint: str | None = None
       ) -> Reason:  # fmt: skip
    return reject(f"fused_cpp.{code}", message + " (TE's C++ refuses it before asking cuDNN)",
                  observed=observed, limit=limit, hint=hint)  # fmt: skip


def cpp_ragged_inputs(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2 (checks 1-2): a ragged (thd) q or
    k/v needs a padding mask ("THD format requires PADDING / PADDING_CAUSAL /
    PADDING_CAUSAL_BOTTOM_RIGHT mask") and a non-zero num_tokens_q / num_tokens_kv for each
    ragged tensor. (A token count of 0 is what TE passes when AttentionParams lacks it.)"""
    rq, rkv = ragged_sides(c)
    if not (rq or rkv):
        return None
    if "padding" not in c.attn_mask_type:
        return _c("thd_mask", f"thd needs a padding mask type (found {c.attn_mask_type})",
                  c.attn_mask_type, "padding, padding_causal, padding_causal_bottom_right")
    tokens = (getattr(c, "num_tokens_q", None) if rq else None,
              getattr(c, "num_tokens_kv", None) if rkv else None)  # fmt: skip
    if 0 in tokens:
        return _c("thd_num_tokens", "thd needs num_tokens_q / num_tokens_kv (q.shape[0] / "
                  "k.shape[0]) for its ragged tensors", tokens, "> 0")  # fmt: skip
    return None


def cpp_paged_kv(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2 (checks 3-4): paged KV needs a
    padding mask, and num_pages, page_size and max_pages_per_seq set (non-zero) for K and V. A
    validated FusedAttnConfig always has both (a KV cache needs a padding mask, a paged one a
    page_size >= 1; num_pages and max_pages_per_seq follow from batch, s_kv and page_size), so
    this rule only guards configs built around that validation."""
    if not c.paged:
        return None
    if "padding" not in c.attn_mask_type:
        return _c("paged_mask", f"paged KV needs a padding mask type (found {c.attn_mask_type})",
                  c.attn_mask_type, "padding, padding_causal, padding_causal_bottom_right")
    if c.page_size <= 0:
        return _c("paged_dims", "paged KV needs num_pages, page_size and max_pages_per_seq",
                  c.page_size, "page_size >= 1")  # fmt: skip
    return None


def cpp_pre_scale_bias(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2 (check 5): "Fused attention does
    not support pre-scale bias" (every dtype)."""
    if c.bias_type == "pre_scale_bias":
        return _c("pre_scale_bias", "pre_scale_bias is not supported by FusedAttention",
                  c.bias_type, "no_bias, post_scale_bias, alibi",
                  hint="use post_scale_bias or unfused")  # fmt: skip
    return None


def cpp_f16(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2 (checks 6a-6c, F16/BF16 q/k/v):
    a thd q *and* thd k/v need sm >= 90 (one ragged side passes); cuDNN <= 9.15.0 with CUDA
    graphs, training, a bshd/sbhd qkv_format, s_kv % 128 != 0 (for any context-parallel step's
    s_kv: TE asks once per step) and no padding mask is refused (a known cuDNN bug); training
    with the ragged stats (thd q on sm >= 90, not sm120) and the learnable softmax needs cuDNN
    9.26.0 (a known backward bug)."""
    if not is_f16(c):
        return None
    sm = d.sm or 0
    rq, rkv = ragged_sides(c)
    if rq and rkv and sm < 90:
        return _c("thd_sm90", f"thd q and k/v need sm >= 90 (found sm{sm})", sm, ">= 90")
    if not c.is_training:  # both refusals below are training's
        return None
    cv = cudnn_of(d)
    if (c.cuda_graph and cv <= (9, 15, 0) and "padding" not in c.attn_mask_type
            and cpp_qkv_format(c.qkv_layout) in ("bshd", "sbhd")):  # fmt: skip
        odd = [s for s in _step_seqlens_kv(c) if s % 128]
        if odd:
            return _c("cuda_graph_cudnn", "cuDNN <= 9.15.0 bug: CUDA graph training with s_kv % "
                      "128 != 0", (fmt_version(cv), odd[0]),
                      "cuDNN > 9.15.0 or s_kv % 128 == 0 (each context-parallel step)")
    if rq and ragged_graph(d) and c.softmax_type == "learnable" and cv < (9, 26, 0):
        return _c("thd_learnable_bwd", "cuDNN < 9.26.0 bug: thd backward with the learnable "
                  "softmax", fmt_version(cv), ">= 9.26.0")  # fmt: skip
    return None


def cpp_fp8(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20.2 fused_attn.cpp, nvte_get_fused_attn_backend_v2 (checks 7b-7d, FP8 q/k/v):
    qkv_format (of the layout ``get_fused_attn_spec`` hands over) and, in training, the dqkv
    layout's format in {bshd, sbhd, thd, bhsd} (mixed formats refused); thd needs cuDNN 9.23.0,
    sm >= 100 for training, cuDNN 9.26.0 for a non-vanilla softmax in training, head dims <= 128
    on sm >= 100; no post_scale_bias (ALiBi with slopes is one) and no ALiBi. The other FP8
    checks are TE Python filters that run first, stated there once: 7a (no return_max_logit) is
    ``max_logit.fp8``, 7f (MXFP8 needs cuDNN 9.21) ``fused.mxfp8_cudnn``; 7e (the recipe) cannot
    fail for the dtypes ``get_fused_attn_spec`` produces."""
    if fused_sub_backend(c) != FP8:
        return None
    sm, cv = d.sm or 0, cudnn_of(d)
    layout, dqkv_layout = fp8_layouts(c)
    fmt, allowed = cpp_qkv_format(layout), ("bshd", "sbhd", "thd", "bhsd")
    dfmt = cpp_qkv_format(dqkv_layout)
    if fmt not in allowed or (c.is_training and dfmt not in allowed):
        return _c("fp8_format", f"FP8 fused attention with qkv_format = {fmt} (gradient format "
                  f"{dfmt})", (fmt, dfmt), "bshd, sbhd, thd, bhsd")  # fmt: skip
    if fmt == "thd":
        if cv < (9, 23, 0):
            return _c("fp8_thd_cudnn", "FP8 thd needs cuDNN 9.23.0", fmt_version(cv),
                      ">= 9.23.0")  # fmt: skip
        if c.is_training and sm < 100:
            return _c("fp8_thd_bwd_sm", f"FP8 thd backward needs sm >= 100 (found sm{sm})", sm,
                      ">= 100")  # fmt: skip
        if c.is_training and c.softmax_type != "vanilla" and cv < (9, 26, 0):
            return _c("fp8_thd_softmax", f"FP8 thd backward with softmax_type = "
                      f"{c.softmax_type} needs cuDNN 9.26.0", fmt_version(cv), ">= 9.26.0")
        if sm >= 100 and (c.head_dim_qk > 128 or c.head_dim_v > 128):
            return _c("fp8_thd_head_dim", f"FP8 thd head dims ({c.head_dim_qk}, "
                      f"{c.head_dim_v}) on sm{sm}", (c.head_dim_qk, c.head_dim_v), "<= 128")
    btype, _, _ = fused_bias(c)
    if btype in ("post_scale_bias", "alibi"):
        return _c("fp8_bias", f"FP8 fused attention with bias_type = {btype}", btype, "no_bias")
    return None


CPP_RULES: tuple[Rule, ...] = tuple(known_device(r) for r in (
    cpp_ragged_inputs, cpp_paged_kv, cpp_pre_scale_bias, cpp_f16, cpp_fp8,
))  # fmt: skip


#: What TE decides before cuDNN is asked, in TE's order: its Python filters, its C++ query's own
#: refusals, then the determinism filter (after the query in get_attention_backend). Binding.
BINDING_RULES: tuple[Rule, ...] = (*PYTHON_RULES, *CPP_RULES, determinism)

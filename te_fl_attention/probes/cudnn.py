"""FusedAttention (cuDNN): TE 2.20.2's Python-side filters, its C++ refusals, and a prediction of
cuDNN's own verdict.

Three rule groups run here, each TE condition stated once, in the group where TE decides it:

* ``PYTHON_RULES`` (and ``determinism``) mirror ``get_attention_backend``'s FusedAttention
  filters (codes ``fused.*``). Binding.
* ``CPP_RULES`` mirror what TE 2.20.2's C++ query ``nvte_get_fused_attn_backend_v2``
  (``fused_attn.cpp``) refuses *before* it builds a cuDNN graph (codes ``fused_cpp.*``). Binding
  too: TE never asks cuDNN for these configs, whatever cuDNN would say.
* ``TABLE_RULES`` predict what cuDNN itself answers for TE's graphs when cuDNN cannot be asked
  (another cuDNN version than the installed one, no cudnn-frontend): stage ``rule``, codes
  ``cudnn_table.*``. The real graph-build probe runs after the binding rules when cudnn-frontend
  is available, and its verdict replaces the prediction (a disagreement is ``rule_drift``).

``fused_sub_backend`` names TE's sub-backend: 1 (F16_arbitrary_seqlen) or 2 (FP8).
"""

from __future__ import annotations

import functools
import importlib.util
import time
from typing import Any

from ..config import FusedAttnConfig, te_max_batch_size, te_max_tokens
from ..device import DeviceProfile
from ..reasons import ProbeResult, Reason
from .base import (
    Rule,
    RuleProbe,
    cudnn_version,
    evaluate,
    fmt_version,
    no_gpu,
    reject,
    version,
)
from .common import ALL_BACKENDS

F16_ARBITRARY_SEQLEN = 1
FP8 = 2


def fused_sub_backend(c: FusedAttnConfig) -> int:
    """TE's sub-backend for a supported config: FP8 (2) for FP8 attention, else F16 (1).

    With FP8 DPA, ``get_fused_attn_spec`` hands cuDNN FP8 q/k/v for every recipe (also when the
    module's inputs are bf16/fp16), so the FP8 sub-backend answers."""
    return FP8 if c.fp8 or c.dtype in ("fp8_e4m3", "fp8_e5m2") else F16_ARBITRARY_SEQLEN


def _cv(d: DeviceProfile) -> tuple[int, int, int]:
    return cudnn_version(d) or (0, 0, 0)


def _r(code: str, message: str, observed: object, limit: object, hint: str | None = None
       ) -> Reason:  # fmt: skip
    return reject(f"fused.{code}", message, observed=observed, limit=limit, hint=hint)


# ----------------------------------------------------------------------- Python-side filters
def cudnn_present(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """FusedAttention needs cuDNN; TE reads its version with ``get_cudnn_version()``."""
    if d.sm is not None and cudnn_version(d) is None:
        return _r(
            "cudnn_missing",
            "cuDNN version unknown or cuDNN not installed",
            None,
            "cuDNN 9",
            hint="pip install nvidia-cudnn-cu13 (or say --device NAME:cudnn=9.x)",
        )
    return None


def sm80(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention for compute capability < sm80"."""
    if d.sm is not None and d.sm < 80:
        return _r(
            "sm", f"FusedAttention needs compute capability >= sm80 (found sm{d.sm})", d.sm, ">= 80"
        )
    return None


def dtype(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention for unsupported qkv_dtype" (bf16, fp16, float8_e4m3fn)."""
    if c.dtype not in ("fp16", "bf16", "fp8_e4m3"):
        return _r(
            "dtype",
            f"qkv_dtype = {c.dtype} is not supported by FusedAttention",
            c.dtype,
            "fp16, bf16, fp8_e4m3",
            hint="use unfused attention for fp32",
        )
    return None


def fp8_recipe(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's FP8 recipe filters: delayed (sm100 determinism), current scaling (sm100+, cuDNN
    9.14, 9.18 deterministic), MXFP8 (sm100+, no fp8_mha, cuDNN 9.21, not 9.23.0/1, no thd),
    block scaling and NVFP4 (never), and no FP8 at all on sm120."""
    if not c.fp8:
        return None
    sm, cv, r = d.sm or 0, _cv(d), c.fp8_recipe
    if sm == 120:
        return _r("fp8_sm120", "FP8 attention is not supported on sm120", "sm120", "sm != 120")
    if r == "delayed" and sm >= 100 and c.deterministic and cv < (9, 18, 0):
        return _r(
            "fp8_delayed_det",
            "FP8 delayed scaling with determinism on sm >= 100 needs cuDNN 9.18.0",
            fmt_version(cv),
            ">= 9.18.0",
        )
    if r == "current":
        if sm < 100:
            return _r(
                "fp8_current_sm",
                f"FP8 current scaling needs sm >= 100 (found sm{sm})",
                sm,
                ">= 100",
            )
        if cv < (9, 14, 0):
            return _r(
                "fp8_current_cudnn",
                "FP8 current scaling needs cuDNN 9.14.0",
                fmt_version(cv),
                ">= 9.14.0",
            )
        if c.deterministic and cv < (9, 18, 0):
            return _r(
                "fp8_current_det",
                "deterministic FP8 current scaling needs cuDNN 9.18.0",
                fmt_version(cv),
                ">= 9.18.0",
            )
    if r == "mxfp8":
        if sm < 100:
            return _r("mxfp8_sm", f"MXFP8 needs sm >= 100 (found sm{sm})", sm, ">= 100")
        if c.fp8_mha:
            return _r("mxfp8_mha", "MXFP8 with fp8_mha=True is not supported", True, False)
        if cv < (9, 21, 0):
            return _r("mxfp8_cudnn", "MXFP8 needs cuDNN 9.21.0", fmt_version(cv), ">= 9.21.0")
        if cv[:2] == (9, 23) and cv[2] in (0, 1):
            return _r(
                "mxfp8_cudnn_bug",
                "MXFP8 is disabled on cuDNN 9.23.0/9.23.1 (known bugs)",
                fmt_version(cv),
                "not 9.23.0/9.23.1",
            )
        if c.qkv_format == "thd":
            return _r(
                "mxfp8_thd", "MXFP8 with qkv_format = thd is not supported", "thd", "bshd, sbhd"
            )
    if r in ("block", "nvfp4"):
        return _r(
            "fp8_recipe",
            f"FP8 recipe {r} is not supported by FusedAttention",
            r,
            "delayed, current, mxfp8",
        )
    return None


def num_splits(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention for num_splits"."""
    if c.num_splits != 1:
        return _r(
            "num_splits",
            f"num_splits = {c.num_splits} is not supported",
            c.num_splits,
            1,
            hint="num_splits needs FlashAttention 3/4",
        )
    return None


def softcap(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention as it does not support softcap"."""
    if c.softcap != 0.0:
        return _r("softcap", "softcap is not supported by FusedAttention", c.softcap, 0.0)
    return None


def score_mod(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention for score_mod because ..." (score_mod needs plain bf16/fp16
    attention without masks, windows, bias, dropout, thd, KV cache, CP, FP8, max_logit...)."""
    if not c.has_score_mod:
        return None
    why = []
    if c.dtype not in ("fp16", "bf16"):
        why.append(f"qkv_dtype = {c.dtype}")
    if c.fp8:
        why.append("FP8 attention")
    if c.fp8_output:
        why.append("fp8_output")
    if c.kv_cache:
        why.append("KV caching")
    if c.context_parallel:
        why.append("context parallelism")
    if "thd" in (c.qkv_format, c.q_format, c.kv_format):
        why.append("thd format")
    if c.pad_between_seqs:
        why.append("pad_between_seqs")
    if c.attn_mask_type != "no_mask":
        why.append(f"attn_mask_type = {c.attn_mask_type}")
    if c.window_size != (-1, -1):
        why.append(f"window_size = {c.window_size}")
    if c.bias_type != "no_bias":
        why.append(f"bias_type = {c.bias_type}")
    if c.alibi_slopes_shape is not None:
        why.append("ALiBi slopes")
    if c.softmax_type != "vanilla":
        why.append(f"softmax_type = {c.softmax_type}")
    if c.dropout:
        why.append(f"dropout = {c.dropout}")
    if c.return_max_logit:
        why.append("return_max_logit")
    if c.checkpoint_core_attention:
        why.append("checkpoint_core_attention")
    if c.cuda_graph:
        why.append("CUDA graph capture")
    if c.num_splits != 1:
        why.append(f"num_splits = {c.num_splits}")
    if why:
        return _r(
            "score_mod",
            "score_mod is not supported with " + "; ".join(why),
            why,
            "plain fp16/bf16 bshd/sbhd attention",
        )
    return None


def kv_cache(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: KV caching is disabled on sm89/sm120, and with FP8."""
    if not c.kv_cache:
        return None
    if d.sm in (89, 120):
        return _r(
            "kv_cache_sm", f"KV caching is disabled on sm{d.sm} (cuDNN bug)", d.sm, "not sm89/sm120"
        )
    if c.fp8:
        return _r("kv_cache_fp8", "FP8 KV caching is not supported", True, False)
    return None


def mla_layout(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention as MLA is not supported with qkv_layout = %s": MLA needs
    the layout group (b/s/t removed) to be ``hd_hd_hd``. TE does not strip ``paged_kv_`` first,
    so every paged layout is refused for MLA too."""
    if c.is_mla and c.qkv_layout.replace("b", "").replace("s", "").replace("t", "") != "hd_hd_hd":
        return _r(
            "mla_layout",
            f"MLA (head_dim_qk = {c.head_dim_qk}, head_dim_v = {c.head_dim_v}) is not supported "
            f"with qkv_layout = {c.qkv_layout}",
            c.qkv_layout,
            "separate q, k, v (hd_hd_hd) layouts, not paged",
        )
    return None


def mla_sm120_training(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: MLA backward on sm120 needs head_dim_qk <= 128 and % 8 == 0."""
    if c.is_mla and d.sm == 120 and c.is_training and (c.head_dim_qk > 128 or c.head_dim_qk % 8):
        return _r(
            "mla_sm120",
            f"MLA backward on sm120 with head_dim_qk = {c.head_dim_qk}",
            c.head_dim_qk,
            "<= 128 and % 8 == 0",
        )
    return None


def thd_sm120(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: thd on sm120 needs cuDNN 9.18.1 and a layout other than t3hd/th3d."""
    if d.sm != 120 or "thd" not in (c.q_format, c.kv_format):
        return None
    if _cv(d) < (9, 18, 1):
        return _r(
            "thd_sm120_cudnn", "thd on sm120 needs cuDNN 9.18.1", fmt_version(_cv(d)), ">= 9.18.1"
        )
    if c.qkv_layout in ("t3hd", "th3d"):
        return _r(
            "thd_sm120_layout",
            f"qkv_layout = {c.qkv_layout} on sm120",
            c.qkv_layout,
            "not t3hd/th3d",
        )
    return None


def softmax(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's softmax filters: non-vanilla in FP8 (sm100+ and cuDNN 9.21), with thd (cuDNN 9.18),
    with context parallelism (a2a only)."""
    if c.softmax_type == "vanilla":
        return None
    st, cv = c.softmax_type, _cv(d)
    if c.fp8 and ((d.sm or 0) < 100 or cv < (9, 21, 0)):
        return _r(
            "softmax_fp8",
            f"softmax_type = {st} in FP8 needs sm >= 100 and cuDNN 9.21",
            (d.sm, fmt_version(cv)),
            "sm >= 100, cuDNN >= 9.21",
        )
    if c.qkv_format == "thd" and cv < (9, 18, 0):
        return _r(
            "softmax_thd",
            f"softmax_type = {st} with thd needs cuDNN 9.18",
            fmt_version(cv),
            ">= 9.18.0",
        )
    if c.context_parallel and c.cp_comm_type != "a2a":
        return _r(
            "softmax_cp",
            f"softmax_type = {st} with context parallelism needs cp_comm_type = a2a",
            c.cp_comm_type,
            "a2a",
        )
    return None


def context_parallel(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's context-parallel filter for FusedAttention (first match, as TE's elif chain)."""
    if not c.context_parallel:
        return None
    m, ct = c.attn_mask_type, c.cp_comm_type
    checks = (
        ("bottom_right" in m, "cp_bottom_right", f"attn_mask_type = {m}"),
        ("causal" in m and c.max_seqlen_q != c.max_seqlen_kv, "cp_causal_cross",
         "causal masking for cross-attention"),
        (c.bias_type not in ("no_bias", "post_scale_bias"), "cp_bias_type",
         f"bias type {c.bias_type}"),
        (c.qkv_format == "thd" and c.bias_type != "no_bias", "cp_thd_bias", "bias with thd"),
        (c.fp8 and c.bias_type != "no_bias", "cp_fp8_bias", "FP8 attention and bias"),
        (c.bias_type != "no_bias" and ct != "p2p", "cp_bias_comm",
         f"bias and cp_comm_type = {ct}"),
        (c.has_window and ct in ("p2p", "a2a+p2p"), "cp_window",
         f"sliding window and cp_comm_type = {ct}"),
        (ct in ("a2a", "a2a+p2p") and (c.num_heads % 2 or c.num_gqa_groups % 2), "cp_a2a_heads",
         f"cp_comm_type = {ct} with an odd num_heads/num_gqa_groups"),
    )  # fmt: skip
    for hit, code, what in checks:
        if hit:
            return _r(
                code,
                f"context parallelism is not supported with {what}",
                what,
                "see TE's context-parallel support table",
            )
    return None


def arbitrary_mask(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FusedAttention for arbitrary mask"."""
    if c.attn_mask_type == "arbitrary":
        return _r(
            "mask_arbitrary",
            "arbitrary masks are only supported by unfused attention",
            "arbitrary",
            "no_mask, padding, causal variants",
        )
    return None


def sliding_window(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's sliding-window filter: FP8 (sm100+ and cuDNN 9.21), no dropout, s_q <= s_kv."""
    if not c.has_window:
        return None
    if c.fp8 and ((d.sm or 0) < 100 or _cv(d) < (9, 21, 0)):
        return _r(
            "window_fp8",
            "sliding window in FP8 needs sm >= 100 and cuDNN 9.21",
            (d.sm, fmt_version(_cv(d))),
            "sm >= 100, cuDNN >= 9.21",
        )
    if c.dropout:
        return _r(
            "window_dropout",
            "sliding window attention is only supported without dropout",
            c.dropout,
            0.0,
        )
    if c.max_seqlen_q > c.max_seqlen_kv:
        return _r(
            "window_sq_gt_skv",
            "sliding window with s_q > s_kv is not supported",
            (c.max_seqlen_q, c.max_seqlen_kv),
            "s_q <= s_kv",
        )
    return None


def _fused_bias(c: FusedAttnConfig) -> tuple[str, str | None, bool]:
    """TE's rewrite for the fused query: ALiBi with slopes becomes a post_scale_bias."""
    if c.bias_type == "alibi" and c.alibi_slopes_shape is not None:
        shape = "1hss" if len(c.alibi_slopes_shape) == 1 else "bhss"
        return "post_scale_bias", shape, False
    return c.bias_type, c.bias_shape, c.bias_requires_grad


def _te_bias_shape_type(c: FusedAttnConfig, shape: str | None) -> str | None:
    """The shape type TE derives from the ``(b, h, sq, skv)`` bias tensor, in TE's order
    (bhss, 1hss, b1ss, 11ss/111s): with one head, a (1, 1, 1, skv) bias reads as 1hss."""
    if shape is None:
        return None
    b = c.batch_size if shape[0] == "b" else 1
    h = c.num_heads if shape[1] == "h" else 1
    sq = 1 if shape == "111s" else c.max_seqlen_q
    if b == c.batch_size and h == c.num_heads:
        return "bhss"
    if b == 1 and h == c.num_heads:
        return "1hss"
    if b == c.batch_size and h == 1:
        return "b1ss"
    return "111s" if sq == 1 and c.max_seqlen_q != 1 else "11ss"


def bias_111s_grad(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE (warning): "Disabling FusedAttention as dbias calculation is not supported for 111s"
    (111s as TE classifies the bias tensor's shape)."""
    btype, shape, grad = _fused_bias(c)
    if btype == "post_scale_bias" and _te_bias_shape_type(c, shape) == "111s" and grad:
        return _r(
            "bias_111s_grad",
            "dbias is not supported for bias shape 111s",
            "111s + grad",
            "111s without requires_grad",
        )
    return None


def determinism(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's determinism filter: no sink softmax; FP8 training needs sm90 and cuDNN 9.19;
    F16 training needs sm90 and no bias gradient; sm90 thd training limited to b*h*sq*skv < 2^30."""
    if not c.deterministic:
        return None
    if c.softmax_type != "vanilla":
        return _r(
            "det_softmax",
            f"deterministic FusedAttention with softmax_type = {c.softmax_type}",
            c.softmax_type,
            "vanilla",
            hint="set NVTE_ALLOW_NONDETERMINISTIC_ALGO=1",
        )
    if not c.is_training:
        return None
    sm, cv = d.sm or 0, _cv(d)
    if fused_sub_backend(c) == FP8:
        if sm < 90 or cv < (9, 19, 0):
            return _r(
                "det_fp8",
                "deterministic FP8 training needs sm >= 90 and cuDNN 9.19.0",
                (sm, fmt_version(cv)),
                "sm >= 90, cuDNN >= 9.19.0",
            )
        return None
    _, _, grad = _fused_bias(c)
    if sm < 90 or grad:
        return _r(
            "det_f16",
            "deterministic F16 training needs sm >= 90 and no bias gradient",
            (sm, grad),
            "sm >= 90, bias_requires_grad=False",
        )
    if (
        c.qkv_format == "thd"
        and sm == 90
        and (c.batch_size * c.num_heads * c.max_seqlen_q * c.max_seqlen_kv >= 1 << 30)
    ):
        return _r(
            "det_thd_workspace",
            "deterministic thd backward on sm90 needs b*h*s_q*s_kv < 2^30 (cuDNN workspace limit)",
            c.batch_size * c.num_heads * c.max_seqlen_q * c.max_seqlen_kv,
            "< 2^30",
        )
    return None


PYTHON_RULES: tuple[Rule, ...] = (
    no_gpu("FusedAttention"), cudnn_present, *ALL_BACKENDS, sm80, dtype, fp8_recipe, num_splits,
    softcap, score_mod, kv_cache, mla_layout, mla_sm120_training, thd_sm120, softmax,
    context_parallel, arbitrary_mask, sliding_window, bias_111s_grad,
)  # fmt: skip


# ---------------------------------------------------------- TE's C++ refusals (before cuDNN)
def _known_device(rule: Rule) -> Rule:
    """Table rules need a GPU and a cuDNN version (their absence is reported once, earlier)."""

    def guarded(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        return rule(c, d) if d.sm is not None and cudnn_version(d) is not None else None

    guarded.__name__, guarded.__doc__ = rule.__name__, rule.__doc__
    return guarded


@functools.lru_cache(maxsize=256)
def _layout_formats(layout: str) -> tuple[str, str]:
    """The q and kv formats the C++ side reads off a layout (``nvte_get_q_format`` /
    ``nvte_get_kv_format``): ``sbhd_bs2hd`` -> (sbhd, bshd), ``t3hd`` -> (thd, thd)."""
    parts = layout.replace("paged_kv_", "").split("_")
    alpha = ["".join(ch for ch in p if ch.isalpha()) for p in parts]
    return alpha[0], alpha[-1]


@functools.lru_cache(maxsize=256)
def _cpp_qkv_format(layout: str) -> str:
    """``nvte_get_qkv_format``: the common format, or ``q_2kv`` for mixed q/kv formats."""
    q, kv = _layout_formats(layout)
    return q if q == kv else f"{q}_2{kv}"


def _ragged(c: FusedAttnConfig) -> tuple[bool, bool]:
    """``FusedAttnConfig::derive()``: ``is_ragged_q`` / ``is_ragged_kv`` (a thd q / k-v)."""
    return _ragged_layout(c.qkv_layout)


@functools.lru_cache(maxsize=256)
def _ragged_layout(layout: str) -> tuple[bool, bool]:
    q, kv = _layout_formats(layout)
    return q == "thd", kv == "thd"


def _fp8_layouts(c: FusedAttnConfig) -> tuple[str, str]:
    """The ``qkv_layout`` and ``dqkv_layout`` TE hands the FP8 C++ query
    (``get_fused_attn_spec``): ``paged_kv_`` dropped; for MXFP8 anything but bshd/sbhd becomes
    ``bhsd_bhsd_bhsd``; ``dqkv_layout`` is the caller's layout."""
    layout = c.qkv_layout.replace("paged_kv_", "")
    if c.fp8_recipe == "mxfp8" and layout not in ("bshd_bshd_bshd", "sbhd_sbhd_sbhd"):
        layout = "bhsd_bhsd_bhsd"
    return layout, c.qkv_layout


def _ragged_graph(d: DeviceProfile) -> bool:
    """``uses_ragged_graph`` in TE 2.20.2's ``derive()``: sm >= 90 and not sm120."""
    return (d.sm or 0) >= 90 and d.sm != 120


def _step_seqlens_kv(c: FusedAttnConfig) -> tuple[int, ...]:
    """The s_kv of every graph TE's C++ query is asked about: with context parallelism, one per
    per-step config (TE 2.20.2 context_parallel.py, ``cp_per_step_configs``: a2a keeps s_kv;
    all_gather asks for s_kv / (2 cp) and s_kv; p2p for s_kv / p2p_size, and a causal mask adds
    half of that). For a2a+p2p the a2a group is taken as 2 ranks (an even cp_size; the config
    does not carry TE's ``cp_size_a2a``)."""
    skv, cp, ct = c.max_seqlen_kv, c.cp_size, c.cp_comm_type
    if not c.context_parallel or ct == "a2a":
        return (skv,)
    if ct == "all_gather":
        return (skv // (2 * cp), skv)
    r_kv = skv // (cp // 2 if ct == "a2a+p2p" and cp % 2 == 0 else cp)
    return (r_kv, r_kv // 2) if "causal" in c.attn_mask_type else (r_kv,)


def _f16(c: FusedAttnConfig) -> bool:
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
    rq, rkv = _ragged(c)
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
    if not _f16(c):
        return None
    sm = d.sm or 0
    rq, rkv = _ragged(c)
    if rq and rkv and sm < 90:
        return _c("thd_sm90", f"thd q and k/v need sm >= 90 (found sm{sm})", sm, ">= 90")
    if not c.is_training:  # both refusals below are training's
        return None
    cv = _cv(d)
    if (c.cuda_graph and cv <= (9, 15, 0) and "padding" not in c.attn_mask_type
            and _cpp_qkv_format(c.qkv_layout) in ("bshd", "sbhd")):  # fmt: skip
        odd = [s for s in _step_seqlens_kv(c) if s % 128]
        if odd:
            return _c("cuda_graph_cudnn", "cuDNN <= 9.15.0 bug: CUDA graph training with s_kv % "
                      "128 != 0", (fmt_version(cv), odd[0]),
                      "cuDNN > 9.15.0 or s_kv % 128 == 0 (each context-parallel step)")
    if rq and _ragged_graph(d) and c.softmax_type == "learnable" and cv < (9, 26, 0):
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
    sm, cv = d.sm or 0, _cv(d)
    layout, dqkv_layout = _fp8_layouts(c)
    fmt, allowed = _cpp_qkv_format(layout), ("bshd", "sbhd", "thd", "bhsd")
    dfmt = _cpp_qkv_format(dqkv_layout)
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
    btype, _, _ = _fused_bias(c)
    if btype in ("post_scale_bias", "alibi"):
        return _c("fp8_bias", f"FP8 fused attention with bias_type = {btype}", btype, "no_bias")
    return None


CPP_RULES: tuple[Rule, ...] = tuple(_known_device(r) for r in (
    cpp_ragged_inputs, cpp_paged_kv, cpp_pre_scale_bias, cpp_f16, cpp_fp8,
))  # fmt: skip


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
    btype, shape, _ = _fused_bias(c)
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
    sm, cv = d.sm or 0, _cv(d)
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
    dqk, dv, sm, cv = c.head_dim_qk, c.head_dim_v, d.sm or 0, _cv(d)
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
    dqk, dv, sm, cv = c.head_dim_qk, c.head_dim_v, d.sm or 0, _cv(d)
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
    fmt = _cpp_qkv_format(_fp8_layouts(c)[0])
    if fmt == "bhsd" and cv < (9, 21, 0):
        return _t("fp8_format", "FP8 fused attention with qkv_format = bhsd needs cuDNN 9.21",
                  fmt_version(cv), ">= 9.21.0")  # fmt: skip
    if sm >= 100 and c.is_training and c.dropout:
        return _t("fp8_blackwell_dropout", f"FP8 backward with dropout on sm{sm}", c.dropout,
                  "no dropout in FP8 training on sm >= 100")  # fmt: skip
    return None


def table_bias(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """cuDNN and biases. As TE's pre-2.20 table (nvte_get_fused_attn_backend) stated it: ALiBi
    (without slopes: cuDNN's alibi mask) needs sm90 and a non-padding causal mask;
    post_scale_bias never with padding masks (cuDNN 9.28.1 accepts both: rule_drift). From TE
    2.20.2's graphs (fused_attn_f16_arbitrary_seqlen.cu, create_graph_f16_fwd/bwd): on the ragged
    graph (thd on sm >= 90, not sm120) the sequence dims are the bucketed token counts
    (get_max_tokens) and the batch is bucketed (get_max_batch_size; forward keeps the real batch
    with cu_seqlens, cuDNN >= 9.24 without dropout), so a bias whose dims are neither 1 nor the
    graph's cannot broadcast ("dimensions mismatch as broadcasting 2 non-one dimension sizes")."""
    btype, _, _ = _fused_bias(c)
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
    if btype == "post_scale_bias" and m in ("padding", "padding_causal"):
        return _t(
            "bias_padding",
            f"post_scale_bias with attn_mask_type = {m}",
            m,
            "no_mask or causal masks with a bias",
        )
    return None


def _graph_seqlens(c: FusedAttnConfig, d: DeviceProfile) -> tuple[int, int]:
    """The sequence dims of TE's graphs (``graph_max_seqlen_q/kv`` in TE 2.20.2's ``derive()``):
    the bucketed token count for a ragged tensor on the ragged graph, else ``max_seqlen``."""
    rq, rkv = _ragged(c)
    ragged = _ragged_graph(d)

    def tokens(name: str, seqlen: int) -> int:
        return getattr(c, name, None) or te_max_tokens(c.batch_size * seqlen)

    return (tokens("num_tokens_q", c.max_seqlen_q) if rq and ragged else c.max_seqlen_q,
            tokens("num_tokens_kv", c.max_seqlen_kv) if rkv and ragged else c.max_seqlen_kv)


def _ragged_bias_mismatch(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """``table_bias``'s ragged-graph broadcast check (see there)."""
    rq, rkv = _ragged(c)
    bias = _bias_dims(c)
    cv = _cv(d)
    if bias is None or not (rq or rkv) or not _ragged_graph(d) or not _f16(c):
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
    m, cv = c.attn_mask_type, _cv(d)
    q_format, kv_format = _layout_formats(c.qkv_layout)
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
    if "bottom_right" in m and (c.bias_type != "no_bias" or dropout):
        return _t(
            "bottom_right_bias_dropout",
            f"{m} with {c.bias_type if c.bias_type != 'no_bias' else 'dropout'}",
            (m, c.bias_type, c.dropout),
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
    cv, m = _cv(d), c.attn_mask_type
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
    btype, _, _ = _fused_bias(c)
    dbias, alibi = _has_dbias(c), btype == "alibi"
    if d.sm == 120 and c.deterministic:
        return _t("sm120_det", "deterministic training on sm120", True, False)
    if c.deterministic and (_cv(d) < (9, 18, 1) or c.dropout or dbias or alibi):
        return _t(
            "blackwell_det",
            "deterministic training on sm >= 100 needs cuDNN 9.18.1 and no dropout, ALiBi or "
            "dBias",
            (fmt_version(_cv(d)), c.dropout, "dBias" if dbias else btype),
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


TABLE_RULES: tuple[Rule, ...] = tuple(_known_device(r) for r in (
    table_arch, table_head_dim, table_bias, table_mask_layout, table_short_sequences,
    table_window, table_blackwell_training,
))  # fmt: skip


#: What TE decides before cuDNN is asked, in TE's order: its Python filters, its C++ query's own
#: refusals, then the determinism filter (after the query in get_attention_backend). Binding.
BINDING_RULES: tuple[Rule, ...] = (*PYTHON_RULES, *CPP_RULES, determinism)


class CudnnProbe(RuleProbe):
    """The ``fused`` candidate: TE's Python filters and its C++ query's pre-graph refusals
    (binding), the prediction of cuDNN's verdict, then, with ``graph=True``, cuDNN itself builds
    the graph (:mod:`.cudnn_graph`, deviceless for catalog GPUs). cuDNN's verdict replaces the
    prediction; a disagreement is recorded in ``detail["rule_drift"]``. Without cudnn-frontend,
    or for a cuDNN version other than the installed one, the prediction stands, marked
    ``detail["predicted"]``."""

    name = "fused"
    RULES = (*BINDING_RULES, *TABLE_RULES)

    def __init__(self, graph: bool = False, timeout_s: float = 60.0):
        self.graph = graph
        self.timeout_s = timeout_s

    @staticmethod
    def binding(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The binding refusals (TE's Python filters, its C++ query, determinism)."""
        return tuple(evaluate(BINDING_RULES, config, device))

    @staticmethod
    def predicted(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The support table's predicted refusals (not binding)."""
        return tuple(evaluate(TABLE_RULES, config, device))

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]:
        return [*self.binding(config, device), *self.predicted(config, device)]

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        """A cached result under this process's binding rules: where they refuse, the rule
        stage's own refusal (as :meth:`probe` gives it), whatever ``cached`` claims; else
        ``cached`` (it may only refuse more). The table's predictions do not bind: cuDNN's
        cached verdict stands over them. ``None``: not a fused result (probe again)."""
        if cached.backend != self.name:
            return None
        binding = self.binding(config, device)
        return self._probe(config, device, binding) if binding else cached

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        return self._probe(config, device, self.binding(config, device))

    def _probe(self, config: FusedAttnConfig, device: DeviceProfile,
               binding: tuple[Reason, ...]) -> ProbeResult:  # fmt: skip
        """The verdict given the binding refusals (the rule stage decides when there are any,
        or when no graph is built)."""
        t0 = time.perf_counter()
        predicted = self.predicted(config, device)
        detail: dict[str, Any] = {"sub_backend": fused_sub_backend(config), "cudnn": device.cudnn}
        answer, note = (None, None)
        if not binding and self.graph:
            answer, note = self._ask_cudnn(config, device)
        if answer is None or not answer.get("decided"):
            reasons = (*binding, *predicted)
            detail["predicted"] = not binding  # the verdict rests on the table's prediction
            if note is not None:
                detail["graph_note"] = note.message
            return ProbeResult(
                backend=self.name, supported=not reasons, reasons=tuple(reasons),
                stage=reasons[0].stage if reasons else "rule", evidence="rules",
                elapsed_ms=(time.perf_counter() - t0) * 1e3,
                detail=detail if not reasons else {"predicted": detail["predicted"]},
            )  # fmt: skip
        ok = bool(answer["supported"])
        detail.update(
            plans=answer.get("plans") or {}, heur_mode=answer.get("heur_mode"),
            cudnn=answer.get("cudnn_version"), mode=answer.get("mode"),
        )  # fmt: skip
        # What a local answer rests on: the captured descriptor, real handle or not.
        if device.source == "local":  # gpu-only
            detail.update(descriptor=answer.get("descriptor"),
                          graph_notes=list(answer.get("notes") or []))  # fmt: skip
        if ok == bool(predicted):  # the table predicted the opposite of cuDNN's answer
            detail["rule_drift"] = {
                "rules": "refused" if predicted else "accepted",
                "cudnn": "accepted" if ok else "refused",
                "rule_codes": [r.code for r in predicted],
            }
        reasons = ()
        if not ok and answer.get("code") == "cudnn.te_refused":  # TE's C++ refusal, for the
            # device as the worker planned it (a binding rule stated in CPP_RULES)
            text = (answer.get("summary") or answer.get("message") or "").strip()
            reasons = (reject("cudnn.te_refused", f"TE's C++ refuses it before asking cuDNN: "
                              f"{text[:2000]}", observed="derive", limit="a config TE's C++ "
                              "asks cuDNN about", stage="rule"),)  # fmt: skip
        elif not ok:
            graph, step = answer.get("graph") or "fwd", answer.get("step") or "?"
            text = (answer.get("message") or answer.get("summary") or "").strip()
            reasons = (reject("cudnn.not_supported",
                              f"cuDNN {answer.get('cudnn_version')} refused the {graph} graph at "
                              f"{step}: {text[:2000]}", observed=f"{graph}.{step}",
                              limit="a plan cuDNN supports", stage="graph_build"),)  # fmt: skip
        mode = answer.get("mode") or "deviceless"
        return ProbeResult(
            backend=self.name, supported=ok, reasons=reasons,
            stage=reasons[0].stage if reasons else "graph_build",
            evidence=f"cudnn {answer.get('cudnn_version')} graph ({mode})",
            elapsed_ms=(time.perf_counter() - t0) * 1e3, detail=detail if ok else
            {k: v for k, v in detail.items()
             if k in ("rule_drift", "cudnn", "mode", "descriptor", "graph_notes")},
        )  # fmt: skip

    def _ask_cudnn(self, config: FusedAttnConfig, device: DeviceProfile, spec: bool = False
                   ) -> tuple[dict[str, Any] | None, Reason | None]:  # fmt: skip
        """cuDNN's answer for this config on this device, or why it cannot be asked."""
        installed = installed_cudnn()
        if importlib.util.find_spec("cudnn") is None or installed is None:
            return None, reject("cudnn.unavailable", "cudnn-frontend / libcudnn not installed: "
                                "the support-table prediction stands", stage="graph_build",
                                hint="pip install 'te-fl-attention[cudnn]'")  # fmt: skip
        want = cudnn_version(device)
        if want is not None and want != installed:
            return None, reject("cudnn.version_mismatch", f"the installed cuDNN "
                                f"{fmt_version(installed)} cannot answer for cuDNN "
                                f"{fmt_version(want)}: the support-table prediction stands",
                                stage="graph_build")  # fmt: skip
        try:
            return self._ask_worker(config, device, spec)
        except Exception as exc:  # noqa: BLE001 - a GPU/descriptor problem never escapes a probe
            return None, reject("cudnn.probe_error", f"asking cuDNN failed: "
                                f"{type(exc).__name__}: {exc}", stage="graph_build")  # fmt: skip

    def graph_spec(self, config: FusedAttnConfig, device: DeviceProfile) -> dict[str, Any]:
        """The graphs cuDNN is asked about for ``config`` on ``device`` (``explain
        --show-graph``): ``{"graphs": {"fwd": <cudnn-frontend JSON>, "bwd": ...}, "supported",
        "mode", "cudnn_version", "derived" (TE's derived config), "message"}``. Nothing is built
        where TE's Python filters or C++ refuse first, or where cuDNN cannot be asked here; the
        message says why."""
        binding = evaluate(BINDING_RULES, config, device)
        if binding:
            return {"graphs": {}, "message": "no graph is built: " + "; ".join(
                f"{r.code}: {r.message}" for r in binding)}  # fmt: skip
        answer, note = self._ask_cudnn(config, device, spec=True)
        if answer is None or note is not None and not answer.get("graph_spec"):
            return {"graphs": {}, "message": note.message if note else "cuDNN was not asked"}
        out = {k: answer.get(k) for k in ("supported", "mode", "cudnn_version", "derived")}
        out["graphs"] = answer.get("graph_spec") or {}
        if not answer.get("supported"):
            out["message"] = (answer.get("summary") or answer.get("message") or "")[:2000]
        return out

    def _ask_worker(self, config: FusedAttnConfig, device: DeviceProfile, spec: bool = False
                    ) -> tuple[dict[str, Any] | None, Reason | None]:  # fmt: skip
        """The worker's answer. A catalog GPU: its descriptor, deviceless, in the deviceless
        worker. The local GPU: the descriptor captured from the current device, with
        ``use_real_gpu``, in that device's worker (a real handle where the worker finds a real
        driver; the descriptor, deviceless, where it finds the stub). Never ran on a GPU."""
        from ..descriptors import DescriptorError, current_ordinal, descriptor_for
        from .cudnn_worker import get_worker

        ordinal, real = None, False
        if device.source == "local" and device.has_gpu:  # gpu-only
            ordinal = current_ordinal()
        try:
            desc = descriptor_for(device, ordinal)
        except DescriptorError as exc:
            return None, reject("cudnn.bad_descriptor", f"no device descriptor for {device.name}: "
                                f"{exc}", stage="graph_build")  # fmt: skip
        # A real handle only for the device the descriptor was captured from.
        if ordinal is not None:  # gpu-only
            real = bool(desc.get("_captured"))
        answer = get_worker(ordinal).probe(config.to_dict(), desc, device.sm,
                                           timeout_s=self.timeout_s, use_real_gpu=real,
                                           spec=spec)  # fmt: skip
        answer["descriptor"] = (desc.get("_sources") or {}).get("*") or desc.get("_catalog")
        if not answer.get("decided"):
            return answer, reject(answer.get("code") or "cudnn.undecided",
                                  answer.get("message") or "cuDNN could not be asked",
                                  stage="graph_build")  # fmt: skip
        return answer, None


def installed_cudnn() -> tuple[int, int, int] | None:
    """The cuDNN version the probe worker would load (package metadata, no import)."""
    from ..device import installed_versions

    v = version(installed_versions()["cudnn"])
    if v is None:
        return None
    rel = (*v.release, 0, 0)
    return (rel[0], rel[1], rel[2])

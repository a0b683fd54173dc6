"""FusedAttention (cuDNN): TE 2.20.2's Python-side filters (``PYTHON_RULES`` and
``determinism``, codes ``fused.*``; binding) and the sub-backend vocabulary."""

from __future__ import annotations

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import (
    Rule,
    cudnn_version,
    fmt_version,
    no_gpu,
    reject,
)
from ..common import ALL_BACKENDS

F16_ARBITRARY_SEQLEN = 1
FP8 = 2


def fused_sub_backend(c: FusedAttnConfig) -> int:
    """TE's sub-backend for a supported config: FP8 (2) for FP8 attention, else F16 (1).

    With FP8 DPA, ``get_fused_attn_spec`` hands cuDNN FP8 q/k/v for every recipe (also when the
    module's inputs are bf16/fp16), so the FP8 sub-backend answers."""
    return FP8 if c.fp8 or c.dtype in ("fp8_e4m3", "fp8_e5m2") else F16_ARBITRARY_SEQLEN


def cudnn_of(d: DeviceProfile) -> tuple[int, int, int]:
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
    sm, cv, r = d.sm or 0, cudnn_of(d), c.fp8_recipe
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
    if cudnn_of(d) < (9, 18, 1):
        return _r(
            "thd_sm120_cudnn",
            "thd on sm120 needs cuDNN 9.18.1",
            fmt_version(cudnn_of(d)),
            ">= 9.18.1",
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
    st, cv = c.softmax_type, cudnn_of(d)
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
    if c.fp8 and ((d.sm or 0) < 100 or cudnn_of(d) < (9, 21, 0)):
        return _r(
            "window_fp8",
            "sliding window in FP8 needs sm >= 100 and cuDNN 9.21",
            (d.sm, fmt_version(cudnn_of(d))),
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


def fused_bias(c: FusedAttnConfig) -> tuple[str, str | None, bool]:
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
    btype, shape, grad = fused_bias(c)
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
    sm, cv = d.sm or 0, cudnn_of(d)
    if fused_sub_backend(c) == FP8:
        if sm < 90 or cv < (9, 19, 0):
            return _r(
                "det_fp8",
                "deterministic FP8 training needs sm >= 90 and cuDNN 9.19.0",
                (sm, fmt_version(cv)),
                "sm >= 90, cuDNN >= 9.19.0",
            )
        return None
    _, _, grad = fused_bias(c)
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

"""TransformerEngine's side of the config: how TE's ``AttentionParams`` and q/k/v tensors become
:class:`~te_fl_attention.config.FusedAttnConfig` fields (recipes, dtypes, bias shapes, token
counts) and the size buckets and ragged-layout rules of TE's C++ that the config normalizes by.

``FusedAttnConfig.from_attention_params`` / ``from_tensors`` call the builders here with the
class; :mod:`te_fl_attention.config` re-exports the public helpers. Never imports torch or TE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from .config_fields import BIAS_SHAPES, DTYPES, FP8_DTYPES, bad_value, check_choice

__all__ = ["canonical_bias_shape", "classify_bias_shape", "from_attention_params", "from_tensors",
           "ragged_pieces", "te_max_batch_size", "te_max_tokens"]  # fmt: skip

#: The config class being built (:class:`~te_fl_attention.config.FusedAttnConfig` or a subclass).
C = TypeVar("C")

# TE recipe class name -> our recipe name (``fp8_meta["recipe"]``).
_RECIPE_CLASSES = {
    "DelayedScaling": "delayed",
    "Float8CurrentScaling": "current",
    "MXFP8BlockScaling": "mxfp8",
    "Float8BlockScaling": "block",
    "NVFP4BlockScaling": "nvfp4",
}
# str(torch.dtype) -> our dtype name (no torch import needed).
_TORCH_DTYPES = {
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}


def _te_bucket(n: int, floor_log2: int, pow2_log2: int) -> int:
    """TE's size buckets (fused_attn/utils.cu): ``2**floor_log2`` up to it, the next power of two
    up to ``2**pow2_log2``, then the next multiple of ``2**pow2_log2``."""
    log2 = max(0, (int(n) - 1).bit_length())  # ceil(log2 n)
    if log2 <= floor_log2:
        return 1 << floor_log2
    if log2 <= pow2_log2:
        return 1 << log2
    step = 1 << pow2_log2
    return -(-int(n) // step) * step


def te_max_tokens(num_tokens: int) -> int:
    """TE's token bucket for a ragged (thd) tensor: ``t <= 1024`` -> 1024; up to 32768 -> the next
    power of two; above -> the next multiple of 32768. TE 2.20.2 fused_attn/utils.cu,
    ``get_max_tokens`` (used by ``FusedAttnConfig::derive()`` for ``bucketed_num_tokens_q/kv``)."""
    return _te_bucket(num_tokens, 10, 15)


def te_max_batch_size(batch_size: int) -> int:
    """TE's batch bucket for ragged graphs: ``b <= 32`` -> 32; up to 512 -> the next power of two;
    above -> the next multiple of 512. TE 2.20.2 fused_attn/utils.cu, ``get_max_batch_size``."""
    return _te_bucket(batch_size, 5, 9)


def ragged_pieces(qkv_layout: str) -> tuple[bool, bool]:
    """Whether TE's C++ sees a ragged (thd) q and a ragged k/v in this layout: its
    ``nvte_get_q_format`` / ``nvte_get_kv_format`` (``thd_bshd_bshd``: q only;
    ``paged_kv_thd_bshd_bshd``: q only; ``t3hd``: both). TE 2.20.2 config_and_params.cpp,
    ``FusedAttnConfig::derive()``: ``is_ragged_q/kv``."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    return "t" in parts[0], "t" in (parts[1] if len(parts) > 1 else parts[0])


def _tokens(value: Any) -> int | None:
    """A token count read from TE's params: an int as given (validation names a bad one)."""
    if value is None or isinstance(value, bool):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    if text in DTYPES:
        return text
    if text.lower() in DTYPES:
        return text.lower()
    if text in _TORCH_DTYPES:
        return _TORCH_DTYPES[text]
    raise bad_value("dtype", text, "allowed: " + ", ".join(DTYPES) + " (or the torch dtypes)")


def classify_bias_shape(b: Any, h: Any, s_q: Any, batch: Any, heads: Any, sq: Any) -> str | None:
    """TE's label for a ``(b, h, s_q, skv)`` bias tensor, tried in TE's order (bhss, 1hss, b1ss,
    then 111s/11ss); ``None`` when it is none of them. Uses comparisons only (traceable)."""
    if b == batch and h == heads:
        return "bhss"
    if b == 1 and h == heads:
        return "1hss"
    if b == batch and h == 1:
        return "b1ss"
    if b == 1 and h == 1:
        return "111s" if s_q == 1 and sq != 1 else "11ss"
    return None


def _bias_shape_code(shape: Any, batch: int, heads: int, sq: int) -> str | None:
    """TE's bias shape, as a string code or a (b, h, sq, skv) tuple, -> one of BIAS_SHAPES."""
    if shape is None or isinstance(shape, str):
        return shape
    b, h, s_q, _ = (int(x) for x in shape)
    code = classify_bias_shape(b, h, s_q, batch, heads, sq)
    if code is None:
        allowed = "expected one of (b|1, h|1, sq|1, skv) shapes: " + ", ".join(BIAS_SHAPES)
        raise bad_value("core_attention_bias_shape", tuple(shape), allowed)
    return code


def canonical_bias_shape(code: str, batch: int, heads: int, sq: int) -> str:
    """One code per physical bias shape, labelled the way TE labels a ``(b, h, sq, skv)``
    tensor (it tries bhss, 1hss, b1ss, then 111s/11ss): e.g. with batch 1 a ``bhss`` bias is
    TE's ``bhss``, a ``1hss`` one too."""
    b = batch if code[0] == "b" else 1
    h = heads if code[1] == "h" else 1
    s_q = 1 if code == "111s" else sq
    return _bias_shape_code((b, h, s_q, 0), batch, heads, sq) or code


def from_attention_params(cls: type[C], params: Any) -> C:
    """Build from TE's ``AttentionParams`` (any TE 2.x field set; duck-typed, no TE import).

    Missing fields take TE's defaults. ``core_attention_bias_shape`` may be TE's string code
    (<= 2.19) or a ``(b, h, sq, skv)`` tuple (2.20+).
    """
    g = getattr
    fp8_meta = g(params, "fp8_meta", None) or {}
    recipe = fp8_meta.get("recipe") if isinstance(fp8_meta, Mapping) else None
    local = fp8_meta.get("local_recipes") if isinstance(fp8_meta, Mapping) else None
    if local:
        recipe = local[0]
    fp8 = (
        bool(g(params, "fp8", False))
        and recipe is not None
        and bool(
            getattr(fp8_meta.get("recipe"), "fp8_dpa", False)
            or getattr(recipe, "fp8_mha", False)
        )
    )
    fp8_recipe = "none"
    if fp8:
        rname = type(recipe).__name__
        if rname not in _RECIPE_CLASSES:
            raise bad_value("fp8_meta['recipe']", rname,
                           "known recipes: " + ", ".join(_RECIPE_CLASSES))  # fmt: skip
        fp8_recipe = _RECIPE_CLASSES[rname]
    dtype = _dtype_name(g(params, "qkv_dtype", "torch.bfloat16"))
    nominal = g(params, "nominal_dtype", None)
    if dtype in FP8_DTYPES and not fp8:
        # FP8 tensors outside an FP8 DPA region: TE treats them by their nominal dtype.
        dtype = _dtype_name(nominal) if nominal is not None else dtype
    inference = g(params, "inference_params", None)
    num_heads = int(g(params, "num_heads", 16))
    batch = int(g(params, "batch_size", 1))
    bias_type = g(params, "core_attention_bias_type", "no_bias")
    bias_shape = _bias_shape_code(
        g(params, "core_attention_bias_shape", None), batch, num_heads,
        int(g(params, "max_seqlen_q", 128)),
    )  # fmt: skip
    if bias_type == "no_bias":
        bias_shape = None
    elif bias_type in ("pre_scale_bias", "post_scale_bias") and bias_shape is None:
        bias_shape = "1hss"
    alibi = g(params, "alibi_slopes_shape", None)
    window = g(params, "window_size", None)
    scale = g(params, "softmax_scale", None)
    return cls(
        batch_size=batch,
        max_seqlen_q=int(g(params, "max_seqlen_q", 128)),
        max_seqlen_kv=int(g(params, "max_seqlen_kv", 128)),
        num_heads=num_heads,
        num_gqa_groups=int(g(params, "num_gqa_groups", 16)),
        head_dim_qk=int(g(params, "head_dim_qk", 64)),
        head_dim_v=int(g(params, "head_dim_v", 64)),
        dtype=dtype,
        qkv_layout=g(params, "qkv_layout", "sbh3d"),
        attn_mask_type=g(params, "attn_mask_type", "no_mask"),
        window_size=tuple(int(w) for w in window) if window is not None else None,
        bottom_right_diagonal=g(params, "bottom_right_diagonal", True),
        bias_type=bias_type,
        bias_shape=bias_shape,
        bias_requires_grad=bool(g(params, "core_attention_bias_requires_grad", False))
        and bias_shape is not None,
        alibi_slopes_shape=tuple(int(d) for d in alibi) if alibi is not None else None,
        dropout=float(g(params, "attention_dropout", 0.0)),
        softmax_type=g(params, "softmax_type", "vanilla"),
        softcap=float(g(params, "softcap", 0.0) or 0.0),
        is_training=bool(g(params, "is_training", True)),
        deterministic=bool(g(params, "deterministic", False)),
        fp8=fp8,
        fp8_recipe=fp8_recipe,
        fp8_mha=fp8 and bool(getattr(recipe, "fp8_mha", False)),
        fp8_output=fp8 and bool(g(params, "fp8_output", False)),
        context_parallel=bool(g(params, "context_parallel", False)),
        cp_comm_type=g(params, "cp_comm_type", "p2p"),
        cp_size=int(g(params, "cp_size", 1)),
        pad_between_seqs=bool(g(params, "pad_between_seqs", False)),
        kv_cache=inference is not None,
        paged=bool(getattr(inference, "is_paged", False)),
        page_size=int(getattr(inference, "page_size", 0) or 0)
        if getattr(inference, "is_paged", False)
        else 0,
        num_splits=int(g(params, "num_splits", 1)),
        return_max_logit=bool(g(params, "return_max_logit", False)),
        cuda_graph=bool(g(params, "cuda_graph", False)),
        has_score_mod=bool(g(params, "has_score_mod", False)),
        has_score_mod_bprop=bool(g(params, "has_score_mod_bprop", False)),
        checkpoint_core_attention=bool(g(params, "checkpoint_core_attention", False)),
        # TE's AttentionParams default is 1.0 ("not given"); we keep None for "default".
        softmax_scale=float(scale) if scale not in (None, 1.0) else None,
        # TE 2.20 passes q/k.shape[0] for a thd tensor (0 otherwise: normalized away); older
        # TE has no such field ("not given": the default count).
        num_tokens_q=_tokens(g(params, "num_tokens_q", None)),
        num_tokens_kv=_tokens(g(params, "num_tokens_kv", None)),
    )


def from_tensors(cls: type[C], q: Any, k: Any, v: Any, qkv_format: str = "bshd",
                 **kw: Any) -> C:  # fmt: skip
    """Build from q/k/v tensors in ``bshd``, ``sbhd`` or ``thd`` (needs ``cu_seqlens_q``).

    For ``thd``, pass ``cu_seqlens_q`` / ``cu_seqlens_kv`` (1-D int tensors); the batch is
    ``len(cu_seqlens_q) - 1`` and the max sequence lengths are read from them unless given;
    the token counts are ``q.shape[0]`` / ``k.shape[0]`` (as TE passes them).
    """
    fmt = check_choice("qkv_format", qkv_format, ("bshd", "sbhd", "thd"))
    cu_q = kw.pop("cu_seqlens_q", None)
    cu_kv = kw.pop("cu_seqlens_kv", None)
    dtype = _dtype_name(q.dtype)
    if fmt == "thd":
        if cu_q is None:
            raise bad_value("cu_seqlens_q", None, "qkv_format='thd' needs cu_seqlens_q")
        cu_kv = cu_q if cu_kv is None else cu_kv
        lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
        lens_kv = (cu_kv[1:] - cu_kv[:-1]).tolist()
        batch, sq, skv = len(lens_q), max(lens_q), max(lens_kv)
        kw.setdefault("attn_mask_type", "padding")
        kw.setdefault("num_tokens_q", int(q.shape[0]))
        kw.setdefault("num_tokens_kv", int(k.shape[0]))
    elif fmt == "bshd":
        batch, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    else:
        sq, batch, skv = q.shape[0], q.shape[1], k.shape[0]
    kw.setdefault("max_seqlen_q", int(sq))
    kw.setdefault("max_seqlen_kv", int(skv))
    return cls(
        batch_size=int(batch),
        num_heads=int(q.shape[-2]),
        num_gqa_groups=int(k.shape[-2]),
        head_dim_qk=int(q.shape[-1]),
        head_dim_v=int(v.shape[-1]),
        dtype=dtype,
        qkv_layout=f"{fmt}_{fmt}_{fmt}",
        **kw,
    )

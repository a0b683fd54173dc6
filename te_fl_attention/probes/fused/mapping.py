"""TE 2.20.2's graph parameters for a config: layouts and strides, what the probe can express,
``TEGraphConfig`` and ``derive`` (the values TE's ``fused_attn_f16_arbitrary_seqlen`` /
``fused_attn_fp8`` builders receive), and TE's pre-graph refusal."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config import FusedAttnConfig, layout_group, ragged_pieces, te_max_batch_size

#: FP8 recipes the probe can express with ``sdpa_fp8`` (per-tensor scales).
FP8_PROBED_RECIPES = ("delayed", "current")


# ---------------------------------------------------------------------------------------- layouts
def layout_pieces(qkv_layout: str) -> tuple[str, str, str]:
    """The memory format of q, k and v in a TE layout string: ``"bshd_bs2hd"`` ->
    ``("bshd", "bs2hd", "bs2hd")``; ``"sb3hd"`` -> three times ``"sb3hd"``; ``t`` stays."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    if len(parts) == 1:
        return parts[0], parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1], parts[1]
    return parts[0], parts[1], parts[2]


def strides_bhsd(fmt: str, sizes: Mapping[str, int], pack: int | None = None) -> list[int]:
    """Strides, in ``[b, h, s, d]`` order, of a tensor stored as ``fmt``.

    ``fmt`` lists the memory dims outermost first: ``b``, ``s``, ``h``, ``d``; ``t`` means
    ``b`` then ``s`` (packed tokens, addressed through ragged offsets); a digit is a packing dim
    holding q/k/v (``3``) or k/v (``2``). ``sizes`` gives ``b, s, h, d`` for this tensor.
    """
    dims: list[tuple[str, int]] = []
    for ch in fmt.replace("t", "bs"):
        if ch.isdigit():
            dims.append(("pack", int(ch) if pack is None else pack))
        else:
            dims.append((ch, int(sizes[ch])))
    stride: dict[str, int] = {}
    acc = 1
    for name, size in reversed(dims):
        stride[name] = acc
        acc *= size
    return [stride["b"], stride["h"], stride["s"], stride["d"]]


def _plain(fmt: str) -> str:
    return "".join(c for c in fmt if not c.isdigit())


# ---------------------------------------------------------------------------------------- mapping
# Everything below mirrors TE 2.20.2's C++ (transformer_engine/common/fused_attn/), as read from
# its sources and checked against the 2.20.2 binary (/work/notes/te_cpp_fused_attn.md). Files:
# config_and_params.cpp (FusedAttnConfig::derive), fused_attn.cpp (nvte_get_fused_attn_backend_v2),
# fused_attn_f16_arbitrary_seqlen.cu (create_graph_f16_fwd/bwd), fused_attn_fp8.cu
# (create_graph_fp8_fwd/bwd), utils.cu / utils.h (strides, buckets, offset multipliers),
# graph_cache.h (query_support). TE's code is paraphrased, never copied.
class Unsupported(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_expressible(c: FusedAttnConfig) -> None:
    """Features the probe cannot put into TE's cuDNN graphs: refuse honestly, undecided.
    (Context parallelism is built step by step: :func:`.cp.cp_steps`.)"""
    u = "cudnn.unsupported_by_probe"
    if c.softcap:
        raise Unsupported(u, f"softcap={c.softcap}: cuDNN's SDPA node has no softcap attribute")
    if c.has_score_mod or c.has_score_mod_bprop:
        raise Unsupported(u, "score_mod callbacks are not mapped by the probe")
    if c.paged and c.is_training:
        raise Unsupported(u, "a paged KV cache in training: TE builds no paged backward graph")
    if c.attn_mask_type == "arbitrary":
        raise Unsupported(u, "attn_mask_type=arbitrary: no cuDNN SDPA mask attribute for it")


def check_fp8_expressible(c: FusedAttnConfig) -> None:
    """FP8 recipes whose TE graph the probe does not build (after TE's own refusals)."""
    if c.fp8 and c.fp8_recipe not in FP8_PROBED_RECIPES:
        raise Unsupported(
            "cudnn.fp8_unsupported_by_probe",
            f"fp8_recipe={c.fp8_recipe}: the probe builds FP8 graphs only for per-tensor scaling "
            f"({', '.join(FP8_PROBED_RECIPES)}) with sdpa_fp8; TE's MXFP8 graph (FP8_E8M0 "
            "block descales, Q_t/K_t/dO_t) is not mapped",
        )


#: Offset-multiplier role -> the field TE's ``RaggedOffsetMultipliers`` keeps for it.
_MULT_ROLES = ("q", "k", "v", "o", "stats")


@dataclass(frozen=True)
class TEGraphConfig:
    """What TE 2.20.2's ``FusedAttnConfig::derive()`` (config_and_params.cpp; binary
    0x1c63880) computes from one config, i.e. everything its graph builders read.

    ``layout``: the layout the builders see (FP8 per-tensor scaling drops ``paged_kv_``:
    Python ``get_fused_attn_spec``). ``ragged_q``/``ragged_kv``: q / kv format is THD.
    ``padding``: a padding mask. ``bias``: POST_SCALE_BIAS reaches the C++ (also ALiBi with
    custom slopes, which TE's Python rewrites). ``alibi``: NVTE_ALIBI (standard slopes only).
    ``dropout``: the probability when ``is_training`` and non-zero, else 0.
    ``bottom_right_diagonal``: after derive's rewrite. ``uses_cu_seqlens_directly``: cuDNN >=
    9.24 (F16/BF16) / 9.25 (FP8) and no dropout. ``uses_ragged_graph``: sm >= 90 and sm != 120
    (2.20.2 binary). ``uses_ragged_stats``: ragged q on the ragged graph (TH1 stats).
    ``graph_batch_size_fwd/bwd``, ``graph_max_seqlen_q/kv``: the dims the graphs are built with.
    ``ragged_offset_type_fwd/bwd``: INT32 with ``uses_cu_seqlens_directly`` in the forward,
    INT64 otherwise (the backward always). ``offset_mults``: ``RaggedOffsetMultipliers``
    (utils.h). ``bias_dims``: the bias tensor's real ``(b, h, s_q, s_kv)``.
    """

    layout: str
    sm: int
    cudnn_version: int
    fp8: bool
    ragged_q: bool
    ragged_kv: bool
    paged: bool
    padding: bool
    causal: bool
    causal_bottom_right: bool
    bias: bool
    alibi: bool
    softmax_offset: bool
    dropout: float
    deterministic: bool
    return_max_logit: bool
    bottom_right_diagonal: bool
    window: tuple[int, int]
    uses_cu_seqlens_directly: bool
    uses_ragged_graph: bool
    uses_ragged_stats: bool
    batch_size: int
    bucketed_batch_size: int
    num_tokens_q: int | None
    num_tokens_kv: int | None
    graph_batch_size_fwd: int
    graph_batch_size_bwd: int
    graph_max_seqlen_q: int
    graph_max_seqlen_kv: int
    ragged_offset_type_fwd: str
    ragged_offset_type_bwd: str
    offset_mults: dict[str, int]
    kv_offsets_from_q: bool
    bias_dims: tuple[int, int, int, int] | None
    num_pages: int
    page_size: int
    max_pages_per_seq: int
    h: int
    hg: int
    d_qk: int
    d_v: int
    qkv_dtype: str
    o_dtype: str
    do_dtype: str
    dqkv_dtype: str
    fp8_delayed: bool
    fp8_current: bool
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (tuples become lists)."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out


def _bias_dims(c: FusedAttnConfig) -> tuple[int, int, int, int] | None:
    """The bias tensor's dims as TE's C++ receives them (``bias_batch_size, bias_num_heads,
    bias_seqlen_q, bias_seqlen_kv`` = the real tensor's shape; Python
    ``get_attention_backend``, dot_product_attention/utils.py). ALiBi with custom slopes is
    rewritten there to post_scale_bias ``(1, h, s_q, s_kv)`` for ``[h]`` slopes and ``(b, h,
    s_q, s_kv)`` for ``[b, h]`` slopes (no grad)."""
    b, h, sq, skv = c.batch_size, c.num_heads, c.max_seqlen_q, c.max_seqlen_kv
    assert skv is not None
    if c.bias_type == "alibi":
        if c.alibi_slopes_shape is None:
            return None
        return (1, h, sq, skv) if len(c.alibi_slopes_shape) == 1 else (b, h, sq, skv)
    if c.bias_type != "post_scale_bias" or c.bias_shape is None:
        return None
    code = c.bias_shape
    return (
        b if code[0] == "b" else 1,
        h if code[1] == "h" else 1,
        1 if code == "111s" else sq,
        skv,
    )


def _fp8_dtypes(c: FusedAttnConfig) -> tuple[str, str, str, str]:
    """``(qkv, o, dO, dQKV)`` dtypes of an FP8 graph: Python ``get_fused_attn_spec``
    (dot_product_attention/utils.py). Delayed: O in the forward FP8 type, dO/dQKV in the
    gradient FP8 type; current scaling: O (``NVTE_DPA_FP8CS_O_in_F16=1``, the default) and dQKV
    in the model dtype, dO in the gradient FP8 type. The recipe's ``fp8_format`` is not in the
    config: its default (``Format.HYBRID``: E4M3 forward, E5M2 gradients) is assumed."""
    qkv = "fp8_e5m2" if c.dtype == "fp8_e5m2" else "fp8_e4m3"
    model = c.dtype if c.dtype in ("fp16", "bf16") else "bf16"
    grad = "fp8_e5m2"
    if c.fp8_recipe == "current":
        return qkv, model, grad, model
    return qkv, qkv, grad, grad


def derive(c: FusedAttnConfig, sm: int, cudnn_version: int) -> TEGraphConfig:
    """TE 2.20.2's ``FusedAttnConfig::derive()`` (config_and_params.cpp) for ``c`` on ``sm``
    with the runtime cuDNN ``cudnn_version`` (``cudnnGetVersion()``, e.g. 92801)."""
    notes: list[str] = []
    fp8 = c.fp8
    layout = c.qkv_layout
    if c.paged and not layout.startswith("paged_kv_"):
        layout = "paged_kv_" + layout  # TE names a paged cache's layout paged_kv_*
    if fp8 and c.fp8_recipe in FP8_PROBED_RECIPES:
        layout = layout.replace("paged_kv_", "")  # get_fused_attn_spec: per-tensor scaling
    ragged_q, ragged_kv = ragged_pieces(layout)
    paged = layout.startswith("paged_kv_")
    m = c.attn_mask_type
    causal = m in ("causal", "padding_causal")
    causal_br = m in ("causal_bottom_right", "padding_causal_bottom_right")
    window = tuple(c.window_size)  # type: ignore[arg-type]
    # derive(): bottom-right masks force BOTTOM_RIGHT, top-left causal masks TOP_LEFT, and any
    # other mask without a window TOP_LEFT (2.20.2 binary 0x1c63cc0-0x1c63d2a).
    if causal_br:
        brd = True
    elif causal or window == (-1, -1):
        brd = False
    else:
        brd = bool(c.bottom_right_diagonal)
    dropout = c.dropout if c.is_training and c.dropout else 0.0
    # derive(): cu_seqlens go to cuDNN directly with runtime cuDNN >= 9.24 (F16) / 9.25 (FP8)
    # and no dropout, for every padding mask (2.20.2 binary 0x1c63a03-0x1c63a2d).
    uses_cu = cudnn_version >= (92500 if fp8 else 92400) and not dropout
    uses_ragged_graph = sm >= 90 and sm != 120
    ragged = ragged_q or ragged_kv
    b = c.batch_size
    bucketed_b = te_max_batch_size(b) if ragged else b
    if ragged and uses_ragged_graph:
        gb_bwd = bucketed_b
        gb_fwd = b if uses_cu else bucketed_b
    else:
        gb_fwd = gb_bwd = b
    assert c.max_seqlen_kv is not None
    sq = c.num_tokens_q if ragged_q and uses_ragged_graph else c.max_seqlen_q
    skv = c.num_tokens_kv if ragged_kv and uses_ragged_graph else c.max_seqlen_kv
    assert sq is not None and skv is not None
    h, hg = c.num_heads, c.num_gqa_groups
    dqk, dv = c.head_dim_qk, c.head_dim_v
    assert hg is not None and dv is not None
    # RaggedOffsetMultipliers (utils.h): per-token element counts of each tensor.
    group = layout_group(layout)
    mults = {"q": h * dqk, "k": hg * dqk, "v": hg * dv, "o": h * dv, "stats": h}
    kv_from_q = group in ("3hd", "h3d")
    if kv_from_q:
        mults["q"] = mults["k"] = mults["v"] = 3 * h * dqk
    elif group in ("hd_2hd", "hd_h2d"):
        mults["k"] = mults["v"] = 2 * hg * dqk
    num_pages = page_size = mpps = 0
    if paged:
        page_size = c.page_size
        mpps = -(-c.max_seqlen_kv // page_size)
        num_pages = b * mpps
        notes.append(
            f"paged KV: num_pages={num_pages} (batch * ceil(s_kv / page_size)) and "
            f"max_pages_per_seq={mpps} assumed; TE takes both from its KV cache manager"
        )
    if fp8:
        qkv_t, o_t, do_t, dqkv_t = _fp8_dtypes(c)
        if c.is_training:
            notes.append(
                "FP8: dO and dQKV types follow the recipe's default fp8_format (HYBRID: E5M2 "
                "gradients); the config does not carry fp8_format"
            )
    else:
        qkv_t = o_t = do_t = dqkv_t = c.dtype
    if c.num_splits > 1:
        notes.append(f"num_splits={c.num_splits} ignored (no cuDNN graph attribute)")
    return TEGraphConfig(
        layout=layout,
        sm=sm,
        cudnn_version=cudnn_version,
        fp8=fp8,
        ragged_q=ragged_q,
        ragged_kv=ragged_kv,
        paged=paged,
        padding="padding" in m,
        causal=causal,
        causal_bottom_right=causal_br,
        bias=_bias_dims(c) is not None,
        alibi=c.bias_type == "alibi" and c.alibi_slopes_shape is None,
        softmax_offset=c.softmax_type != "vanilla",
        dropout=dropout,
        deterministic=c.deterministic,
        return_max_logit=c.return_max_logit,
        bottom_right_diagonal=brd,
        window=(int(window[0]), int(window[1])),
        uses_cu_seqlens_directly=uses_cu,
        uses_ragged_graph=uses_ragged_graph,
        uses_ragged_stats=ragged_q and uses_ragged_graph,
        batch_size=b,
        bucketed_batch_size=bucketed_b,
        num_tokens_q=c.num_tokens_q,
        num_tokens_kv=c.num_tokens_kv,
        graph_batch_size_fwd=gb_fwd,
        graph_batch_size_bwd=gb_bwd,
        graph_max_seqlen_q=sq,
        graph_max_seqlen_kv=skv,
        ragged_offset_type_fwd="INT32" if uses_cu else "INT64",
        ragged_offset_type_bwd="INT64",
        offset_mults=mults,
        kv_offsets_from_q=kv_from_q,
        bias_dims=_bias_dims(c),
        num_pages=num_pages,
        page_size=page_size,
        max_pages_per_seq=mpps,
        h=h,
        hg=hg,
        d_qk=dqk,
        d_v=dv,
        qkv_dtype=qkv_t,
        o_dtype=o_t,
        do_dtype=do_t,
        dqkv_dtype=dqkv_t,
        fp8_delayed=fp8 and c.fp8_recipe == "delayed",
        fp8_current=fp8 and c.fp8_recipe == "current",
        notes=tuple(notes),
    )


def _te_qkv_format(layout: str) -> str:
    """``nvte_get_qkv_format``: one format when q and kv agree, else e.g. ``thd_2bshd``."""
    q, k, _ = layout_pieces(layout)
    q, k = _plain(q), _plain(k)
    return q if q == k else f"{q}_2{k}"


def te_refusal(c: FusedAttnConfig, d: TEGraphConfig) -> str | None:
    """What TE 2.20.2's ``nvte_get_fused_attn_backend_v2`` (fused_attn.cpp) refuses before it
    builds any graph, the first hit in TE's order; ``None`` when it goes on to ask cuDNN. Stated
    once, as the binding rules :data:`.cpp.CPP_RULES` (evaluated here for
    the device being planned), plus the C++'s own dtype check ("Unsupported QKV dtype"; TE's
    Python filter ``fused.dtype`` refuses such configs first)."""
    from ...device import DeviceProfile
    from ..base import evaluate
    from .cpp import CPP_RULES

    if not d.fp8 and c.dtype not in ("fp16", "bf16"):
        return f"Unsupported QKV dtype qkv_dtype={c.dtype} ."
    v = d.cudnn_version
    device = DeviceProfile("planned", sm=d.sm, cudnn=f"{v // 10000}.{v // 100 % 100}.{v % 100}",
                           source="catalog")  # fmt: skip
    reasons = evaluate(CPP_RULES, c, device)
    return f"{reasons[0].code}: {reasons[0].message}" if reasons else None


def te_matrix_strides(layout: str, matrix: str, b: int, h: int, s_q: int, s_kv: int, d: int
                      ) -> list[int]:  # fmt: skip
    """``[b, h, s, d]`` strides of the ``matrix`` ("Q", "K", "V", "O") of a layout: TE 2.20.2
    utils.cu ``generateMatrixStrides`` (and utils.h ``generateMatrixStridesWithLayout`` /
    ``WithFormat`` for FP8, which agree). BSHD/THD: b = s*h*d, h = d, s = h*d (s: the graph's
    seq dim, the bucketed token count for THD on the ragged graph); SBHD: b = h*d, s = b*h*d;
    packed 3/2 multiply by 3/2 (H3D/H2D: h = 3d/2d); BHSD: b = h*s*d, h = s*d, s = d. O uses
    the q format unpacked; q/k/v-packed (3) layouts take s_q for every matrix."""
    qf, kf, vf = layout_pieces(layout)
    if matrix in ("Q", "O"):
        fmt, s = (qf if matrix == "Q" else _plain(qf)), s_q
    else:
        fmt = kf if matrix == "K" else vf
        s = s_q if "3" in fmt else s_kv
    return strides_bhsd(fmt, {"b": b, "s": s, "h": h, "d": d})


__all__ = ["FP8_PROBED_RECIPES", "TEGraphConfig", "derive", "layout_pieces", "strides_bhsd",
           "te_matrix_strides", "te_refusal"]

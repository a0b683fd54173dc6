"""Flash attention in Triton (ours): forward + backward with online softmax, as autograd op.

Entry point :func:`flash_attention`; :data:`SUPPORTED` describes what it accepts.

Algorithm (FlashAttention-2 style, written for this project):

* Forward: one program per (query block, batch * head). Scores are kept in log2 units
  (``q.k * scale * log2(e)``) so the online softmax uses ``exp2``; the running max is made
  finite before subtraction so rows that see no key stay NaN-free (output 0, lse ``-inf``).
  Key blocks are visited in three loops: masked blocks before the fully visible range, unmasked
  blocks (no per-element mask), masked blocks after it. The range comes from the causal/window
  bounds of the query block, so blocks outside the window are never touched.
* Backward: ``delta = rowsum(dO * O)`` (preprocess kernel), then dQ with one program per
  (query block, batch * head) and dK/dV with one program per (key block, batch * kv head) that
  loops over the query heads of its GQA group. When that launches too few programs for the GPU
  (MQA, small batch), dK/dV are instead computed per query head as fp32 partials and summed
  over each group with ``torch.sum``. Every output element is written by exactly one program in
  a fixed order and no atomics are used: the backward is deterministic (bitwise reproducible)
  by default; ``deterministic=True`` is accepted for API compatibility and changes nothing.
* Masks: key ``j`` is visible to query ``i`` iff ``j < len_kv`` and
  ``i + off - left <= j <= i + off + right`` (``-1`` = unbounded, causal forces ``right = 0``),
  with ``off = len_kv - len_q`` (each sequence's actual lengths) for bottom-right alignment,
  else 0. Queries beyond ``len_q`` (padding) get output 0, lse ``-inf`` and zero gradients.
* Layouts: bshd ``[b, s, h, d]``, sbhd ``[s, b, h, d]`` and thd ``[t, h, d]`` are read through
  their strides (no copies); thd sequences start at ``cu_seqlens_*_padded[i]`` when given.
  lse is fp32 in natural-log units, ``[b, h, sq]`` (bshd/sbhd) or ``[h, total_q]`` (thd).

On GPU, block sizes are autotuned (key: head dims, dtype, causal). Under ``TRITON_INTERPRET=1``
(CPU) one small fixed configuration is used, and q/k/v tiles are upcast to fp32 before
``tl.dot`` (the interpreter multiplies raw bf16 bit patterns, triton issue 11584); the softmax
probabilities are still rounded to the input dtype before ``P @ V`` so the numerics match the
GPU path. fp32 inputs use ``input_precision="ieee"`` (no TF32).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NoReturn

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - SUPPORTED and validation stay importable without triton
    triton = None
    tl = None

__all__ = ["SUPPORTED", "flash_attention"]

QKV_FORMATS = ("bshd", "sbhd", "thd")
MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
MAX_HEAD_DIM = 256
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

SUPPORTED: dict[str, Any] = {
    "dtypes": ("fp16", "bf16", "fp32"),
    "accumulation": "fp32",
    "max_head_dim": MAX_HEAD_DIM,  # both head_dim_qk and head_dim_v
    "head_dim_qk_ne_v": True,
    "non_pow2_head_dim": True,
    "qkv_formats": QKV_FORMATS,
    "attn_mask_types": MASK_TYPES,
    "sliding_window": True,  # (left, right), -1 = unbounded
    "bottom_right_diagonal": True,  # windows aligned top-left or bottom-right
    "gqa": True,
    "mqa": True,
    "thd_padded_offsets": True,  # cu_seqlens_*_padded
    "bias_types": ("no_bias",),
    "softmax_types": ("vanilla",),
    "dropout": False,
    "fp8": False,
    "arbitrary_mask": False,
    "return_lse": True,
    "deterministic_backward": True,  # always: no atomics anywhere
    "min_sm": 80,
    "devices": ("cuda",),  # plus CPU tensors under TRITON_INTERPRET=1 (tests only)
}

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Fixed (BLOCK_M, BLOCK_N) for every kernel under the interpreter; tests may override it.
_INTERPRET_BLOCKS = (16, 16)
# GQA/MQA dK/dV strategy: None = automatic (split into per-q-head partials when the grouped
# kernel would launch too few programs for the GPU), True / False = force (tests).
_GQA_SPLIT: bool | None = None


def _interpreting() -> bool:
    if triton is None:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return bool(triton.knobs.runtime.interpret)


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@_jit
def _seq_info(
    CU_Q, START_Q, CU_KV, START_KV, bid, S_Q, S_KV,
    HAS_LENS: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
):  # fmt: skip
    """(len_q, len_kv, start_q, start_kv, store_len_q, store_len_kv, diagonal offset)."""
    if HAS_LENS:
        len_q = tl.load(CU_Q + bid + 1).to(tl.int32) - tl.load(CU_Q + bid).to(tl.int32)
        len_kv = tl.load(CU_KV + bid + 1).to(tl.int32) - tl.load(CU_KV + bid).to(tl.int32)
    else:
        len_q = S_Q + 0 * bid
        len_kv = S_KV + 0 * bid
    if VARLEN:
        start_q = tl.load(START_Q + bid).to(tl.int64)
        start_kv = tl.load(START_KV + bid).to(tl.int64)
        store_q = len_q
        store_kv = len_kv
    else:
        start_q = (0 * bid).to(tl.int64)
        start_kv = (0 * bid).to(tl.int64)
        store_q = S_Q + 0 * bid
        store_kv = S_KV + 0 * bid
    if BOTTOM_RIGHT:
        off = len_kv - len_q
    else:
        off = 0 * len_q
    return len_q, len_kv, start_q, start_kv, store_q, store_kv, off


@_jit
def _key_range(
    m0, len_q, len_kv, off, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key-block bounds for query rows [m0, m0 + BLOCK_M): masked [lo, b1), full [b1, b2),
    masked [b2, hi). Block starts are multiples of BLOCK_N."""
    m_last = tl.minimum(m0 + BLOCK_M, len_q) - 1
    lo = 0 * m0
    hi = len_kv
    full_lo = lo
    full_hi = len_kv
    if HAS_LEFT:
        lo = tl.maximum(lo, m0 + off - window_left)
        full_lo = m_last + off - window_left
    if HAS_RIGHT:
        hi = tl.minimum(hi, m_last + off + window_right + 1)
        full_hi = tl.minimum(full_hi, m0 + off + window_right + 1)
    hi = tl.where(m0 >= len_q, 0, hi)
    lo = tl.minimum(lo, hi)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(full_lo, lo)
    b1 = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
    b1 = tl.maximum(b1, lo)
    full_hi = tl.maximum(full_hi, b1)
    b2 = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, b1), hi)
    return lo, b1, b2, hi


@_jit
def _query_range(
    n0, len_q, len_kv, off, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query-block bounds for key rows [n0, n0 + BLOCK_N) (same shape as _key_range)."""
    n_last = tl.minimum(n0 + BLOCK_N, len_kv) - 1
    lo = 0 * n0
    hi = len_q
    full_lo = lo
    full_hi = len_q
    if HAS_RIGHT:  # j <= i + off + right  <=>  i >= j - off - right
        lo = tl.maximum(lo, n0 - off - window_right)
        full_lo = n_last - off - window_right
    if HAS_LEFT:  # j >= i + off - left  <=>  i <= j - off + left
        hi = tl.minimum(hi, n_last - off + window_left + 1)
        full_hi = tl.minimum(full_hi, n0 - off + window_left + 1)
    hi = tl.where(n0 >= len_kv, 0, hi)
    lo = tl.minimum(lo, hi)
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = tl.maximum(full_lo, lo)
    b1 = tl.minimum(((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, hi)
    b1 = tl.maximum(b1, lo)
    full_hi = tl.maximum(full_hi, b1)
    b2 = tl.minimum(tl.maximum((full_hi // BLOCK_M) * BLOCK_M, b1), hi)
    return lo, b1, b2, hi


@_jit
def _visible(
    offs_m, offs_n, len_kv, off, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] bool: key offs_n[j] is visible to query offs_m[i]."""
    diag = offs_m[:, None] + off - offs_n[None, :]  # > 0: key left of the diagonal
    ok = offs_n[None, :] < len_kv
    if HAS_RIGHT:
        ok = ok & (diag >= -window_right)
    if HAS_LEFT:
        ok = ok & (diag <= window_left)
    return ok


@_jit
def _fwd_block(
    acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks, stride_kd,
    stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
    D_QK: tl.constexpr, D_V: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_kv = offs_n < len_kv
    kt = tl.load(
        k_base + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd,
        mask=in_kv[None, :] & (offs_dqk[:, None] < D_QK),
        other=0.0,
    )
    v = tl.load(
        v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
        mask=in_kv[:, None] & (offs_dv[None, :] < D_V),
        other=0.0,
    )
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2
    if MASK:
        ok = _visible(offs_m, offs_n, len_kv, off, window_left, window_right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = p.to(v.dtype).to(tl.float32)
        v = v.to(tl.float32)
    else:
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@_jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, CU_Q, START_Q, CU_KV, START_KV,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    S_Q, S_KV, H, GROUP, window_left, window_right, scale_log2,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bid = pid_bh // H
    hid = pid_bh % H
    kvh = hid // GROUP
    len_q, len_kv, start_q, start_kv, store_q, store_kv, off = _seq_info(
        CU_Q, START_Q, CU_KV, START_KV, bid, S_Q, S_KV, HAS_LENS, VARLEN, BOTTOM_RIGHT
    )
    bid64 = bid.to(tl.int64)
    q_base = Q + bid64 * stride_qb + hid.to(tl.int64) * stride_qh + start_q * stride_qs
    k_base = K + bid64 * stride_kb + kvh.to(tl.int64) * stride_kh + start_kv * stride_ks
    v_base = V + bid64 * stride_vb + kvh.to(tl.int64) * stride_vh + start_kv * stride_vs
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
        mask=(offs_m[:, None] < len_q) & (offs_dqk[None, :] < D_QK),
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, b1, b2, hi = _key_range(
        m0, len_q, len_kv, off, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    for n0 in range(lo, b1, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    for n0 in range(b1, b2, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, False, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    for n0 in range(b2, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    live = (l_i > 0.0) & (offs_m < len_q)
    l_safe = tl.where(live, l_i, 1.0)
    out = tl.where(live[:, None], acc / l_safe[:, None], 0.0)
    m_fin = tl.where(live, m_i, 0.0)
    lse = tl.where(live, (m_fin + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    rows = offs_m < store_q
    o_base = OUT + bid64 * stride_ob + hid.to(tl.int64) * stride_oh + start_q * stride_os
    tl.store(
        o_base + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=rows[:, None] & (offs_dv[None, :] < D_V),
    )
    l_base = LSE + bid64 * stride_lb + hid.to(tl.int64) * stride_lh + start_q * stride_ls
    tl.store(l_base + offs_m * stride_ls, lse, mask=rows)


@_jit
def _bwd_delta_kernel(
    OUT, DO, DELTA, CU_Q, START_Q,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_db, stride_ds, stride_dh, stride_dd,
    stride_lb, stride_lh, stride_ls,
    S_Q, H,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LENS: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bid = pid_bh // H
    hid = pid_bh % H
    len_q, _len_kv, start_q, _start_kv, store_q, _store_kv, _off = _seq_info(
        CU_Q, START_Q, CU_Q, START_Q, bid, S_Q, S_Q, HAS_LENS, VARLEN, False
    )
    bid64 = bid.to(tl.int64)
    h64 = hid.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < len_q) & (offs_dv[None, :] < D_V)
    o = tl.load(
        OUT + bid64 * stride_ob + h64 * stride_oh + (start_q + offs_m[:, None]) * stride_os
        + offs_dv[None, :] * stride_od,
        mask=mask, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + bid64 * stride_db + h64 * stride_dh + (start_q + offs_m[:, None]) * stride_ds
        + offs_dv[None, :] * stride_dd,
        mask=mask, other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(
        DELTA + bid64 * stride_lb + h64 * stride_lh + (start_q + offs_m) * stride_ls,
        delta,
        mask=offs_m < store_q,
    )


@_jit
def _bwd_dq_block(
    dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks, stride_kd,
    stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
    D_QK: tl.constexpr, D_V: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_kv = offs_n < len_kv
    k = tl.load(
        k_base + offs_n[:, None] * stride_ks + offs_dqk[None, :] * stride_kd,
        mask=in_kv[:, None] & (offs_dqk[None, :] < D_QK),
        other=0.0,
    )
    vt = tl.load(
        v_base + offs_n[None, :] * stride_vs + offs_dv[:, None] * stride_vd,
        mask=in_kv[None, :] & (offs_dv[:, None] < D_V),
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        ok = _visible(offs_m, offs_n, len_kv, off, window_left, window_right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, vt, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    if UPCAST:
        ds = ds.to(k_base.dtype.element_ty).to(tl.float32)
    else:
        ds = ds.to(k.dtype)
    dq += tl.dot(ds, k, input_precision=DOT_PREC)
    return dq


@_jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_Q, START_Q, CU_KV, START_KV,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    stride_lb, stride_lh, stride_ls,
    S_Q, S_KV, H, GROUP, window_left, window_right, scale_log2, softmax_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bid = pid_bh // H
    hid = pid_bh % H
    kvh = hid // GROUP
    len_q, len_kv, start_q, start_kv, store_q, store_kv, off = _seq_info(
        CU_Q, START_Q, CU_KV, START_KV, bid, S_Q, S_KV, HAS_LENS, VARLEN, BOTTOM_RIGHT
    )
    bid64 = bid.to(tl.int64)
    h64 = hid.to(tl.int64)
    k_base = K + bid64 * stride_kb + kvh.to(tl.int64) * stride_kh + start_kv * stride_ks
    v_base = V + bid64 * stride_vb + kvh.to(tl.int64) * stride_vh + start_kv * stride_vs
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = offs_m < len_q
    q = tl.load(
        Q + bid64 * stride_qb + h64 * stride_qh + (start_q + offs_m[:, None]) * stride_qs
        + offs_dqk[None, :] * stride_qd,
        mask=in_q[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + bid64 * stride_dob + h64 * stride_doh + (start_q + offs_m[:, None]) * stride_dos
        + offs_dv[None, :] * stride_dod,
        mask=in_q[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )  # fmt: skip
    l_offs = bid64 * stride_lb + h64 * stride_lh + (start_q + offs_m) * stride_ls
    lse = tl.load(LSE + l_offs, mask=in_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + l_offs, mask=in_q, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    lo, b1, b2, hi = _key_range(
        m0, len_q, len_kv, off, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    for n0 in range(lo, b1, BLOCK_N):
        dq = _bwd_dq_block(
            dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    for n0 in range(b1, b2, BLOCK_N):
        dq = _bwd_dq_block(
            dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, False, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    for n0 in range(b2, hi, BLOCK_N):
        dq = _bwd_dq_block(
            dq, q, do, lse2, delta, k_base, v_base, n0, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_kd, stride_vs, stride_vd, len_kv, off, window_left, window_right, scale_log2,
            D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_N,
        )  # fmt: skip
    dq = tl.where(in_q[:, None], dq * softmax_scale, 0.0)
    tl.store(
        DQ + bid64 * stride_dqb + h64 * stride_dqh + (start_q + offs_m[:, None]) * stride_dqs
        + offs_dqk[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=(offs_m[:, None] < store_q) & (offs_dqk[None, :] < D_QK),
    )  # fmt: skip


@_jit
def _bwd_dkdv_block(
    dk, dv, k, v, q_base, do_base, l_base, d_base, m0, offs_n, offs_dqk, offs_dv,
    stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, len_q, len_kv, off,
    window_left, window_right, scale_log2,
    D_QK: tl.constexpr, D_V: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    offs_m = m0 + tl.arange(0, BLOCK_M)
    in_q = offs_m < len_q
    q = tl.load(
        q_base + offs_m[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
        mask=in_q[:, None] & (offs_dqk[None, :] < D_QK),
        other=0.0,
    )
    do = tl.load(
        do_base + offs_m[:, None] * stride_dos + offs_dv[None, :] * stride_dod,
        mask=in_q[:, None] & (offs_dv[None, :] < D_V),
        other=0.0,
    )
    lse = tl.load(l_base + offs_m * stride_ls, mask=in_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(d_base + offs_m * stride_ls, mask=in_q, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * scale_log2  # [BLOCK_N, BLOCK_M]
    pt = tl.math.exp2(st - lse2[None, :])
    if MASK:
        diag = offs_m[None, :] + off - offs_n[:, None]
        ok = offs_n[:, None] < len_kv
        if HAS_RIGHT:
            ok = ok & (diag >= -window_right)
        if HAS_LEFT:
            ok = ok & (diag <= window_left)
        pt = tl.where(ok, pt, 0.0)
    if UPCAST:
        pr = pt.to(q_base.dtype.element_ty).to(tl.float32)
    else:
        pr = pt.to(q.dtype)
    dv += tl.dot(pr, do, input_precision=DOT_PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    if UPCAST:
        dst = dst.to(q_base.dtype.element_ty).to(tl.float32)
    else:
        dst = dst.to(q.dtype)
    dk += tl.dot(dst, q, input_precision=DOT_PREC)
    return dk, dv


@_jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_Q, START_Q, CU_KV, START_KV,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    stride_lb, stride_lh, stride_ls,
    S_Q, S_KV, NPROG_H, LOOP, KV_DIV, window_left, window_right, scale_log2, softmax_scale,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # NPROG_H programs per sequence along heads; program pid_h reads kv head pid_h // KV_DIV,
    # handles q heads pid_h * LOOP ... + LOOP - 1 and writes dK/dV head pid_h. Grouped:
    # (h_kv, GROUP, 1), split into per-q-head partials: (h, 1, GROUP).
    bid = pid_bh // NPROG_H
    pid_h = pid_bh % NPROG_H
    len_q, len_kv, start_q, start_kv, store_q, store_kv, off = _seq_info(
        CU_Q, START_Q, CU_KV, START_KV, bid, S_Q, S_KV, HAS_LENS, VARLEN, BOTTOM_RIGHT
    )
    bid64 = bid.to(tl.int64)
    p64 = pid_h.to(tl.int64)
    g64 = (pid_h // KV_DIV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_kv = offs_n < len_kv
    k = tl.load(
        K + bid64 * stride_kb + g64 * stride_kh + (start_kv + offs_n[:, None]) * stride_ks
        + offs_dqk[None, :] * stride_kd,
        mask=in_kv[:, None] & (offs_dqk[None, :] < D_QK), other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + bid64 * stride_vb + g64 * stride_vh + (start_kv + offs_n[:, None]) * stride_vs
        + offs_dv[None, :] * stride_vd,
        mask=in_kv[:, None] & (offs_dv[None, :] < D_V), other=0.0,
    )  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, b1, b2, hi = _query_range(
        n0, len_q, len_kv, off, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    # The q heads of this program, in a fixed order: deterministic, no atomics.
    for i in range(0, LOOP):
        h64 = p64 * LOOP + i
        q_base = Q + bid64 * stride_qb + h64 * stride_qh + start_q * stride_qs
        do_base = DO + bid64 * stride_dob + h64 * stride_doh + start_q * stride_dos
        l_base = LSE + bid64 * stride_lb + h64 * stride_lh + start_q * stride_ls
        d_base = DELTA + bid64 * stride_lb + h64 * stride_lh + start_q * stride_ls
        for m0 in range(lo, b1, BLOCK_M):
            dk, dv = _bwd_dkdv_block(
                dk, dv, k, v, q_base, do_base, l_base, d_base, m0, offs_n, offs_dqk, offs_dv,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, len_q, len_kv, off,
                window_left, window_right, scale_log2,
                D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_M,
            )  # fmt: skip
        for m0 in range(b1, b2, BLOCK_M):
            dk, dv = _bwd_dkdv_block(
                dk, dv, k, v, q_base, do_base, l_base, d_base, m0, offs_n, offs_dqk, offs_dv,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, len_q, len_kv, off,
                window_left, window_right, scale_log2,
                D_QK, D_V, False, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_M,
            )  # fmt: skip
        for m0 in range(b2, hi, BLOCK_M):
            dk, dv = _bwd_dkdv_block(
                dk, dv, k, v, q_base, do_base, l_base, d_base, m0, offs_n, offs_dqk, offs_dv,
                stride_qs, stride_qd, stride_dos, stride_dod, stride_ls, len_q, len_kv, off,
                window_left, window_right, scale_log2,
                D_QK, D_V, True, HAS_LEFT, HAS_RIGHT, UPCAST, DOT_PREC, BLOCK_M,
            )  # fmt: skip
    dk = tl.where(in_kv[:, None], dk * softmax_scale, 0.0)
    dv = tl.where(in_kv[:, None], dv, 0.0)
    rows = offs_n < store_kv
    tl.store(
        DK + bid64 * stride_dkb + p64 * stride_dkh + (start_kv + offs_n[:, None]) * stride_dks
        + offs_dqk[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty),
        mask=rows[:, None] & (offs_dqk[None, :] < D_QK),
    )  # fmt: skip
    tl.store(
        DV + bid64 * stride_dvb + p64 * stride_dvh + (start_kv + offs_n[:, None]) * stride_dvs
        + offs_dv[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=rows[:, None] & (offs_dv[None, :] < D_V),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Configs that do not fit the device (shared memory)
# fail to launch and are skipped by the autotuner; the last one of each list is the small
# fallback that fits every case (head dim 256, fp32) on sm80 and newer.
_FWD_CONFIGS = (
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
    (32, 32, 4, 1),
)  # fmt: skip
_DQ_CONFIGS = ((128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1))
_DKDV_CONFIGS = ((64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 32, 4, 1))
_TUNE_KEY = ["D_QK", "D_V", "IS_CAUSAL"]  # the autotuner adds the tensors' dtypes itself


def _prune_configs(configs, named_args, **kwargs):
    """fp32 (no tensor cores with input_precision="ieee": big tiles spill heavily and take
    minutes to compile) gets the small fallback tile only; head dims > 128 keep tiles of at
    most 64 x 64 (bigger ones overflow shared memory)."""
    limit = None
    if named_args["Q"].dtype == torch.float32:
        limit = 32 * 32
    elif max(kwargs["BLOCK_DQK"], kwargs["BLOCK_DV"]) > 128:
        limit = 64 * 64
    if limit is None:
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= limit]
    return kept or list(configs[-1:])


@functools.cache
def _tuned(name: str):
    kernel, configs = {
        "fwd": (_fwd_kernel, _FWD_CONFIGS),
        "dq": (_bwd_dq_kernel, _DQ_CONFIGS),
        "dkdv": (_bwd_dkdv_kernel, _DKDV_CONFIGS),
    }[name]
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in configs
        ],
        key=_TUNE_KEY,
        prune_configs_by={"early_config_prune": _prune_configs},
    )(kernel)


def _launch(name: str, rows: int, batch_heads: int, args: tuple, consts: dict) -> None:
    """Launch kernel ``name`` over ``cdiv(rows, block) x batch_heads`` programs."""
    if rows <= 0 or batch_heads <= 0:
        return
    axis = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
    if _interpreting():
        kernel = {"fwd": _fwd_kernel, "dq": _bwd_dq_kernel, "dkdv": _bwd_dkdv_kernel}[name]
        blocks = {"BLOCK_M": _INTERPRET_BLOCKS[0], "BLOCK_N": _INTERPRET_BLOCKS[1]}
        kernel[(triton.cdiv(rows, blocks[axis]), batch_heads)](*args, **consts, **blocks)
        return
    with torch.cuda.device(args[0].device):
        _tuned(name)[lambda meta: (triton.cdiv(rows, meta[axis]), batch_heads)](*args, **consts)


def _bad(name: str, value: Any, expected: str) -> NoReturn:
    if isinstance(value, torch.Tensor):
        value = f"<tensor shape={tuple(value.shape)} dtype={value.dtype} device={value.device}>"
    raise ValueError(f"{name}={value!r} is not allowed: expected {expected}")


class _Plan:
    """Validated call: layout strides, sequence metadata and mask parameters."""

    __slots__ = (
        "fmt", "batch", "heads", "kv_heads", "rows_q", "rows_kv", "cu_q", "cu_kv", "start_q",
        "start_kv", "has_lens", "varlen", "bottom_right", "left", "right", "causal", "scale",
    )  # fmt: skip

    def strides(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, seq, head, dim) strides of a q/k/v-like tensor."""
        if self.fmt == "bshd":
            return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
        if self.fmt == "sbhd":
            return x.stride(1), x.stride(0), x.stride(2), x.stride(3)
        return 0, x.stride(0), x.stride(1), x.stride(2)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int, int]:
        if self.fmt == "thd":
            return 0, lse.stride(0), lse.stride(1)
        return lse.stride(0), lse.stride(1), lse.stride(2)

    def seq_args(self, dummy: torch.Tensor) -> tuple:
        cu_q = self.cu_q if self.cu_q is not None else dummy
        cu_kv = self.cu_kv if self.cu_kv is not None else dummy
        start_q = self.start_q if self.start_q is not None else cu_q
        start_kv = self.start_kv if self.start_kv is not None else cu_kv
        return cu_q, start_q, cu_kv, start_kv

    def consts(self, d_qk: int, d_v: int, dtype: torch.dtype) -> dict:
        upcast = _interpreting()
        return {
            "D_QK": d_qk,
            "D_V": d_v,
            "BLOCK_DQK": max(16, triton.next_power_of_2(d_qk)),
            "BLOCK_DV": max(16, triton.next_power_of_2(d_v)),
            "IS_CAUSAL": self.right == 0,
            "HAS_LENS": self.has_lens,
            "VARLEN": self.varlen,
            "BOTTOM_RIGHT": self.bottom_right,
            "HAS_LEFT": self.left >= 0,
            "HAS_RIGHT": self.right >= 0,
            "UPCAST": upcast,
            # fp32 operands: exact fp32 products (no TF32); 16-bit: the backend default.
            "DOT_PREC": "ieee" if (upcast or dtype == torch.float32) else None,
        }


def _check_cu(cu: Any, name: str, batch: int | None, device: torch.device) -> torch.Tensor:
    ok_types = (torch.int32, torch.int64)
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in ok_types:
        _bad(name, cu, "a 1-D int32/int64 tensor [b+1] of cumulative sequence lengths")
    if batch is not None and cu.numel() != batch + 1:
        _bad(name, cu, f"{batch + 1} entries (batch size + 1)")
    if cu.numel() < 1:
        _bad(name, cu, "at least one entry")
    if cu.device != device:
        _bad(name, cu, f"a tensor on {device} like q")
    return cu.contiguous()


def _plan(
    q: Any,
    k: Any,
    v: Any,
    qkv_format: Any,
    cu_seqlens_q: Any,
    cu_seqlens_kv: Any,
    cu_seqlens_q_padded: Any,
    cu_seqlens_kv_padded: Any,
    max_seqlen_q: Any,
    max_seqlen_kv: Any,
    attn_mask_type: Any,
    window_size: Any,
    bottom_right_diagonal: Any,
    softmax_scale: Any,
) -> _Plan:
    if triton is None:  # pragma: no cover
        raise ImportError("te_fl_attention.kernels.triton_flash needs triton (pip install triton)")
    if qkv_format not in QKV_FORMATS:
        _bad("qkv_format", qkv_format, f"one of {QKV_FORMATS}")
    ndim = 3 if qkv_format == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _bad(name, t, "a torch.Tensor")
        if t.dtype not in _DTYPES:
            _bad(f"{name}.dtype", t.dtype, "one of torch.float16, torch.bfloat16, torch.float32")
        if t.dtype != q.dtype:
            _bad(f"{name}.dtype", t.dtype, f"{q.dtype} like q")
        if t.device != q.device:
            _bad(f"{name}.device", t.device, f"{q.device} like q")
        if t.dim() != ndim:
            _bad(f"{name}.shape", tuple(t.shape), f"{ndim} dims for qkv_format={qkv_format!r}")
    if q.device.type != "cuda" and not _interpreting():
        _bad("q.device", q.device, "a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d_qk:
        _bad("k.shape", tuple(k.shape), f"head_dim_qk {d_qk} like q")
    for name, d in (("head_dim_qk", d_qk), ("head_dim_v", d_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            _bad(name, d, f"1..{MAX_HEAD_DIM}")
    h, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv or hkv < 1 or h % hkv != 0:
        _bad("k.shape", tuple(k.shape), f"kv heads equal in k and v and dividing q heads ({h})")
    if k.shape[:-1] != v.shape[:-1]:
        _bad("v.shape", tuple(v.shape), f"leading dims {tuple(k.shape[:-1])} like k")
    if attn_mask_type not in MASK_TYPES:
        _bad("attn_mask_type", attn_mask_type, f"one of {MASK_TYPES}")
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        _bad("window_size", window_size, "(left, right) ints >= -1 (-1 = unbounded)")
    top_left = attn_mask_type in ("causal", "padding_causal")
    if bottom_right_diagonal is None:
        bottom_right = not top_left
    elif not isinstance(bottom_right_diagonal, bool):
        _bad("bottom_right_diagonal", bottom_right_diagonal, "True, False or None")
    elif "causal" in attn_mask_type and bottom_right_diagonal == top_left:
        _bad(
            "bottom_right_diagonal",
            bottom_right_diagonal,
            f"{not top_left} or None for attn_mask_type={attn_mask_type!r}",
        )
    else:
        bottom_right = bottom_right_diagonal
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
    ):
        _bad("softmax_scale", softmax_scale, "a finite float or None")

    p = _Plan()
    p.fmt, p.heads, p.kv_heads = qkv_format, h, hkv
    p.left, p.right = int(window_size[0]), int(window_size[1])
    p.causal = "causal" in attn_mask_type
    if p.causal:
        p.right = 0
    p.bottom_right = bool(bottom_right)
    p.scale = 1.0 / math.sqrt(d_qk) if softmax_scale is None else float(softmax_scale)
    p.start_q = p.start_kv = None
    if qkv_format == "thd":
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is None:
                _bad(name, cu, "cumulative sequence lengths [b+1] for qkv_format='thd'")
        p.cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", None, q.device)
        p.batch = p.cu_q.numel() - 1
        p.cu_kv = _check_cu(cu_seqlens_kv, "cu_seqlens_kv", p.batch, q.device)
        if cu_seqlens_q_padded is not None:
            p.start_q = _check_cu(cu_seqlens_q_padded, "cu_seqlens_q_padded", p.batch, q.device)
        if cu_seqlens_kv_padded is not None:
            p.start_kv = _check_cu(cu_seqlens_kv_padded, "cu_seqlens_kv_padded", p.batch, q.device)
        p.has_lens = p.varlen = True
        rows = []
        for name, given, cu in (
            ("max_seqlen_q", max_seqlen_q, p.cu_q),
            ("max_seqlen_kv", max_seqlen_kv, p.cu_kv),
        ):
            if given is None:
                given = int((cu[1:] - cu[:-1]).max()) if p.batch > 0 else 0
            elif isinstance(given, bool) or not isinstance(given, int) or given < 0:
                _bad(name, given, "a non-negative int or None")
            rows.append(given)
        p.rows_q, p.rows_kv = rows
    else:
        for name, cu in (
            ("cu_seqlens_q_padded", cu_seqlens_q_padded),
            ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
        ):
            if cu is not None:
                _bad(name, cu, "None unless qkv_format='thd'")
        bdim = 0 if qkv_format == "bshd" else 1
        p.batch = q.shape[bdim]
        if k.shape[bdim] != p.batch:
            _bad("k.shape", tuple(k.shape), f"batch size {p.batch} like q")
        p.rows_q, p.rows_kv = q.shape[1 - bdim], k.shape[1 - bdim]
        p.varlen = False
        if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
            missing = "cu_seqlens_kv" if cu_seqlens_kv is None else "cu_seqlens_q"
            _bad(missing, None, "both cu_seqlens_q and cu_seqlens_kv, or neither")
        p.has_lens = cu_seqlens_q is not None
        if p.has_lens and "padding" not in attn_mask_type:
            _bad("attn_mask_type", attn_mask_type, "a padding* type when cu_seqlens are given")
        p.cu_q = p.cu_kv = None
        if p.has_lens:
            p.cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", p.batch, q.device)
            p.cu_kv = _check_cu(cu_seqlens_kv, "cu_seqlens_kv", p.batch, q.device)
    return p


def _forward(q, k, v, p: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    thd = p.fmt == "thd"
    out_shape = (*q.shape[:-1], v.shape[-1])
    if thd:  # tokens outside every sequence (padded offsets) stay 0 / -inf
        out = q.new_zeros(out_shape)
        lse = torch.full((p.heads, q.shape[0]), float("-inf"), device=q.device)
    else:
        out = q.new_empty(out_shape)
        lse = torch.empty((p.batch, p.heads, p.rows_q), device=q.device, dtype=torch.float32)
    args = (
        q, k, v, out, lse, *p.seq_args(lse),
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(out), *p.lse_strides(lse),
        p.rows_q, p.rows_kv, p.heads, p.heads // p.kv_heads, max(p.left, 0), max(p.right, 0),
        p.scale * _LOG2E,
    )  # fmt: skip
    _launch("fwd", p.rows_q, p.batch * p.heads, args, p.consts(q.shape[-1], v.shape[-1], q.dtype))
    return out, lse


def _split_gqa(p: _Plan, device: torch.device) -> bool:
    """Compute dK/dV as per-q-head fp32 partials summed over each group (more programs, more
    memory) instead of one program per kv head looping over its group (few programs for
    MQA / small batches)? Both are deterministic."""
    group = p.heads // p.kv_heads
    if group == 1:
        return False
    if _GQA_SPLIT is not None:
        return _GQA_SPLIT
    if device.type != "cuda":
        return False
    programs = p.batch * p.kv_heads * triton.cdiv(p.rows_kv, 64)
    return programs < 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _backward(q, k, v, out, lse, do, p: _Plan) -> tuple[torch.Tensor, ...]:
    thd = p.fmt == "thd"
    new = torch.zeros_like if thd else torch.empty_like
    dq = new(q)
    group = p.heads // p.kv_heads
    split = _split_gqa(p, q.device)
    if split:  # fp32 partials [..., h, d] in k's layout, reduced over the group below
        alloc = torch.zeros if thd else torch.empty
        dk = alloc((*k.shape[:-2], p.heads, k.shape[-1]), device=k.device, dtype=torch.float32)
        dv = alloc((*v.shape[:-2], p.heads, v.shape[-1]), device=v.device, dtype=torch.float32)
    else:
        dk, dv = new(k), new(v)
    delta = torch.empty_like(lse)
    seq = p.seq_args(lse)
    consts = p.consts(q.shape[-1], v.shape[-1], q.dtype)
    if p.rows_q > 0 and p.batch * p.heads > 0:
        block = _INTERPRET_BLOCKS[0] if _interpreting() else 64
        grid = (triton.cdiv(p.rows_q, block), p.batch * p.heads)
        delta_args = (
            out, do, delta, seq[0], seq[1], *p.strides(out), *p.strides(do),
            *p.lse_strides(lse), p.rows_q, p.heads,
        )  # fmt: skip
        delta_consts = {
            "D_V": v.shape[-1],
            "BLOCK_DV": consts["BLOCK_DV"],
            "HAS_LENS": p.has_lens,
            "VARLEN": p.varlen,
            "BLOCK_M": block,
        }
        if _interpreting():
            _bwd_delta_kernel[grid](*delta_args, **delta_consts)
        else:
            with torch.cuda.device(q.device):
                _bwd_delta_kernel[grid](*delta_args, **delta_consts)
    common = (p.rows_q, p.rows_kv)
    mask = (max(p.left, 0), max(p.right, 0), p.scale * _LOG2E, p.scale)
    dq_args = (
        q, k, v, do, dq, lse, delta, *seq,
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(do), *p.strides(dq),
        *p.lse_strides(lse), *common, p.heads, group, *mask,
    )  # fmt: skip
    _launch("dq", p.rows_q, p.batch * p.heads, dq_args, consts)
    heads = (p.heads, 1, group) if split else (p.kv_heads, group, 1)
    dkdv_args = (
        q, k, v, do, dk, dv, lse, delta, *seq,
        *p.strides(q), *p.strides(k), *p.strides(v), *p.strides(do), *p.strides(dk),
        *p.strides(dv), *p.lse_strides(lse), *common, *heads, *mask,
    )  # fmt: skip
    _launch("dkdv", p.rows_kv, p.batch * heads[0], dkdv_args, consts)
    if split:  # deterministic reduction over the q heads of each group
        dk = dk.unflatten(-2, (p.kv_heads, group)).sum(-2).to(k.dtype)
        dv = dv.unflatten(-2, (p.kv_heads, group)).sum(-2).to(v.dtype)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:  # pragma: no cover - only lse was used
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, ctx.plan)
        return dq, dk, dv, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    attn_mask_type: str = "no_mask",
    window_size: tuple[int, int] = (-1, -1),
    bottom_right_diagonal: bool | None = None,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused attention (Triton); differentiable in q, k and v. Returns ``out`` or ``(out, lse)``.

    Shapes: bshd ``[b, s, h, d]``, sbhd ``[s, b, h, d]``, thd ``[t, h, d]``; k/v may have fewer
    heads (GQA/MQA, ``h % h_kv == 0``) and v another head dim (each <= 256). thd needs
    ``cu_seqlens_q/kv`` ([b+1]); ``cu_seqlens_*_padded`` give each sequence's start offset;
    ``max_seqlen_*`` default to the longest sequence (one device sync each) and must not be
    smaller than it. With bshd/sbhd, ``cu_seqlens_q/kv`` give actual lengths (``padding*``
    masks); positions beyond are padding. Padding queries and fully masked rows get output 0,
    lse ``-inf`` and zero gradients. ``window_size=(left, right)``, ``-1`` = unbounded; causal
    masks force ``right = 0``. ``bottom_right_diagonal`` defaults to True except for
    ``causal``/``padding_causal``. lse is fp32 natural-log logsumexp, ``[b, h, sq]`` or
    ``[h, total_q]`` (thd), and is not differentiable. The backward never uses atomics and is
    always bitwise reproducible; ``deterministic`` is accepted for API compatibility.
    Raises ValueError naming the argument and the allowed values for unsupported inputs.
    """
    if not isinstance(deterministic, bool):
        _bad("deterministic", deterministic, "True or False")
    if not isinstance(return_lse, bool):
        _bad("return_lse", return_lse, "True or False")
    plan = _plan(
        q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
        cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
        bottom_right_diagonal, softmax_scale,
    )  # fmt: skip
    out, lse = _FlashAttention.apply(q, k, v, plan)
    return (out, lse) if return_lse else out

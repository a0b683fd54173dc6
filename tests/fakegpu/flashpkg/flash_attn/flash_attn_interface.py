"""``flash_attn.flash_attn_interface`` of the flash-attn 2.8.3 test double (see the package)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Every call, for tests: (entry point, {argument: shape or value}).
CALLS: list[tuple[str, dict]] = []


def _check(q, k, v, *, varlen: bool, dropout_p, softcap, alibi_slopes, window_size):
    """flash_api.cpp's mha_fwd / mha_varlen_fwd argument checks (after the wrapper's padding)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if q.dtype == torch.bfloat16:
        major = torch.cuda.get_device_properties(torch.cuda.current_device()).major
        if major < 8:
            raise RuntimeError("bfloat16 is only supported on Ampere GPUs or newer")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    dims = 3 if varlen else 4
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise RuntimeError(f"q, k, v must have {dims} dimensions")
    head_size = q.shape[-1]
    heads, heads_k = q.shape[-2], k.shape[-2]
    if not varlen and q.shape[0] <= 0:
        raise RuntimeError("batch size must be positive")
    if head_size > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if head_size % 8:
        raise RuntimeError("query, key, value, and out_ must have a head_size that is a multiple "
                           "of 8")
    if heads % heads_k:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if tuple(k.shape[-1:]) != (head_size,):
        raise RuntimeError(f"key must have shape (..., {heads_k}, {head_size})")
    if tuple(v.shape[-2:]) != (heads_k, head_size) or v.shape[:-1] != k.shape[:-1]:
        raise RuntimeError(f"value must have shape {tuple(k.shape[:-1])} + ({head_size},): got "
                           f"{tuple(v.shape)} (v must have the head size of q and k)")
    if softcap and dropout_p:
        raise RuntimeError("Softcapping does not support dropout for now")
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32:
            raise RuntimeError("ALiBi slopes must have dtype fp32")
        if alibi_slopes.stride(-1) != 1:
            raise RuntimeError("ALiBi slopes tensor must have contiguous last dimension")
    left, right = window_size
    if not (isinstance(left, int) and isinstance(right, int)):
        raise TypeError("window_size must be a pair of ints")


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """The 2.8.3 wrapper pads head dims to a multiple of 8 (and trims the output)."""
    d = x.shape[-1]
    return x if d % 8 == 0 else F.pad(x, [0, 8 - d % 8])


def _mask(causal: bool, window_size) -> tuple[str, tuple[int, int]]:
    left, right = window_size
    if causal:
        return "causal_bottom_right", (left, 0)
    return "no_mask", (left, right)


def _attention(q, k, v, fmt, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
               return_attn_probs, **lens):
    from te_fl_attention.kernels import reference

    mask, window = _mask(causal, window_size)
    if lens:
        mask = "padding_causal_bottom_right" if causal else "padding"
    kw = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window,
              bottom_right_diagonal=True, softmax_scale=softmax_scale, dropout_p=dropout_p,
              return_lse=True, **lens)
    if alibi_slopes is not None:
        kw.update(bias_type="alibi", alibi_slopes=alibi_slopes)
    out, lse = reference.attention(q, k, v, **kw)
    return out, lse


def _prepare(q, k, v, softmax_scale, dropout_p, softcap, alibi_slopes, window_size, varlen):
    """The wrapper's padding to a multiple of 8, then the C++ checks; returns the padded tensors
    and the scale of the unpadded head dim."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)
    _check(qp, kp, vp, varlen=varlen, dropout_p=dropout_p, softcap=softcap,
           alibi_slopes=alibi_slopes, window_size=window_size)
    return qp, kp, vp, scale


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    CALLS.append(("flash_attn_func", {"q": tuple(q.shape), "k": tuple(k.shape),
                                      "v": tuple(v.shape), "causal": causal,
                                      "window_size": tuple(window_size)}))
    qp, kp, vp, scale = _prepare(q, k, v, softmax_scale, dropout_p, softcap, alibi_slopes,
                                 window_size, varlen=False)
    out, lse = _attention(qp, kp, vp, "bshd", dropout_p, scale, causal, window_size,
                          alibi_slopes, return_attn_probs)
    out = out[..., :q.shape[-1]]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    CALLS.append(("flash_attn_varlen_func", {"q": tuple(q.shape), "k": tuple(k.shape),
                                             "v": tuple(v.shape), "causal": causal,
                                             "max_seqlen_q": max_seqlen_q}))
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    qp, kp, vp, scale = _prepare(q, k, v, softmax_scale, dropout_p, softcap, alibi_slopes,
                                 window_size, varlen=True)
    out, lse = _attention(qp, kp, vp, "thd", dropout_p, scale, causal, window_size,
                          alibi_slopes, return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_kv=cu_seqlens_k)
    out = out[..., :q.shape[-1]]
    return (out, lse, None) if return_attn_probs else out


def _not_in_double(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name}: the flash-attn test double implements "
                                  "flash_attn_func / flash_attn_varlen_func only")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


_flash_attn_forward = _not_in_double("flash_attn.flash_attn_interface._flash_attn_forward")
_flash_attn_backward = _not_in_double("flash_attn.flash_attn_interface._flash_attn_backward")
_flash_attn_varlen_forward = _not_in_double(
    "flash_attn.flash_attn_interface._flash_attn_varlen_forward")
_flash_attn_varlen_backward = _not_in_double(
    "flash_attn.flash_attn_interface._flash_attn_varlen_backward")

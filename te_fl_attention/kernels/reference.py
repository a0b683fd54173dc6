"""Unfused reference attention in plain torch with autograd: the oracle for every fused backend.

Conventions follow TransformerEngine:

* ``attention_mask`` and :func:`build_mask` use ``True`` = masked *out*.
* Diagonal offset ``off = skv_b - sq_b`` (each sequence's actual lengths) when the diagonal is
  bottom-right aligned, else ``0``. Key ``j`` is in query ``i``'s window iff
  ``i + off - left <= j <= i + off + right`` (``-1`` = unbounded); causal types force
  ``right = 0``; top-left causal types ("causal", "padding_causal") use ``off = 0``.
* ALiBi is a post-scale bias ``-slope_h * |i + off - j|`` (0 on the diagonal, negative elsewhere).
* ``lse`` is the natural-log logsumexp of the scaled, biased logits over the unmasked keys plus
  the sink term (``exp(0)`` for off-by-one, ``exp(sink_h)`` for learnable), in the compute dtype
  (fp32, or fp64 for fp64 inputs). It is ``-inf`` for rows with nothing to attend to and for
  padding queries (a row with a sink but no key gets ``lse = sink`` and output 0).
  Shape: ``[b, h, sq]`` for bshd/sbhd, ``[h, total_q]`` for thd.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch

__all__ = ["attention", "build_mask", "default_alibi_slopes"]

QKV_FORMATS = ("bshd", "sbhd", "thd")
MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def _bad(name: str, value: Any, expected: str) -> NoReturn:
    if isinstance(value, torch.Tensor):
        value = f"<tensor shape={tuple(value.shape)} dtype={value.dtype}>"
    raise ValueError(f"{name}={value!r} is not allowed: expected {expected}")


def default_alibi_slopes(num_heads: int) -> torch.Tensor:
    """Standard ALiBi slopes [h] (fp32): geometric in ``2**(-8/n)``, interleaved if h != 2**k."""
    if not isinstance(num_heads, int) or num_heads < 1:
        _bad("num_heads", num_heads, "a positive int")
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def is_bottom_right(attn_mask_type: str, bottom_right_diagonal: bool | None) -> bool:
    top_left = attn_mask_type in ("causal", "padding_causal")
    if bottom_right_diagonal is None:
        return not top_left
    if "causal" in attn_mask_type and bool(bottom_right_diagonal) == top_left:
        _bad(
            "bottom_right_diagonal",
            bottom_right_diagonal,
            f"{not top_left} or None for attn_mask_type={attn_mask_type!r}",
        )
    return bool(bottom_right_diagonal)


def _check_window(window_size: Any) -> tuple[int, int]:
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        _bad("window_size", window_size, "(left, right) ints >= -1 (-1 = unbounded)")
    return int(window_size[0]), int(window_size[1])


def build_mask(
    sq: int,
    skv: int,
    *,
    attn_mask_type: str = "no_mask",
    window_size: tuple[int, int] = (-1, -1),
    bottom_right_diagonal: bool | None = None,
    seqlens_q: torch.Tensor | None = None,
    seqlens_kv: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool mask broadcastable to [b, h, sq, skv]; ``True`` = masked out (TE convention).

    ``seqlens_q``/``seqlens_kv`` ([b]) are actual lengths; rows/columns beyond them are masked and
    they set the per-sequence bottom-right offset. ``attention_mask`` is OR-ed in.
    """
    if attn_mask_type not in MASK_TYPES:
        _bad("attn_mask_type", attn_mask_type, f"one of {MASK_TYPES}")
    left, right = _check_window(window_size)
    if "causal" in attn_mask_type:
        right = 0
    bottom_right = is_bottom_right(attn_mask_type, bottom_right_diagonal)
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    lq = torch.tensor(sq, device=device) if seqlens_q is None else seqlens_q.to(device).long()
    lkv = torch.tensor(skv, device=device) if seqlens_kv is None else seqlens_kv.to(device).long()
    lq, lkv = lq.view(-1, 1, 1, 1), lkv.view(-1, 1, 1, 1)
    diag = i - j + (lkv - lq if bottom_right else 0)  # > 0: key left of the diagonal
    masked = (i >= lq) | (j >= lkv)
    if left >= 0:
        masked = masked | (diag > left)
    if right >= 0:
        masked = masked | (diag < -right)
    if attention_mask is not None:
        masked = masked | attention_mask.to(device=masked.device, dtype=torch.bool)
    return masked


def _seqlens(cu: Any, name: str, batch: int | None, limit: int) -> torch.Tensor:
    """Validate cumulative lengths ([b+1], int, starting at 0, non-decreasing) -> diffs [b]."""
    if (
        not isinstance(cu, torch.Tensor)
        or cu.dim() != 1
        or cu.dtype
        not in (
            torch.int32,
            torch.int64,
        )
    ):
        _bad(name, cu, "a 1-D int32/int64 tensor [b+1]")
    if batch is not None and cu.numel() != batch + 1:
        _bad(name, cu, f"{batch + 1} entries (batch size + 1)")
    if cu.numel() < 1 or int(cu[0]) != 0:
        _bad(name, cu, "cumulative lengths starting at 0")
    lens = (cu[1:] - cu[:-1]).long()
    if bool((lens < 0).any()) or int(cu[-1]) > limit:
        _bad(name, cu, f"non-decreasing values <= {limit}")
    return lens


def _check_padded(cu_padded: Any, name: str, lens: torch.Tensor, total: int) -> torch.Tensor:
    """Validate thd start offsets so each sequence fits before the next -> starts [b]."""
    if cu_padded is None:
        return torch.cat([lens.new_zeros(1), lens.cumsum(0)])[:-1]
    _seqlens(cu_padded, name, lens.numel(), total)
    starts = cu_padded[:-1].long()
    if bool((starts + lens > cu_padded[1:].long()).any()):
        _bad(name, cu_padded, "offsets leaving room for each sequence (padded[i]+len[i] <= [i+1])")
    return starts


def _pack(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, smax: int) -> torch.Tensor:
    """[t, h, d] packed tokens -> [b, h, smax, d] zero-padded batch."""
    pos = torch.arange(smax, device=x.device)
    idx = (starts.to(x.device)[:, None] + pos).clamp(max=max(x.shape[0] - 1, 0))
    valid = (pos < lens.to(x.device)[:, None])[..., None, None]
    return torch.where(valid, x[idx], 0).transpose(1, 2)


def _unpack(
    y: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, total: int, fill: float
) -> torch.Tensor:
    """[b, smax, ...] -> [total, ...] packed tokens; positions outside sequences get ``fill``."""
    pos = torch.arange(y.shape[1], device=y.device)
    idx = starts.to(y.device)[:, None] + pos
    valid = pos < lens.to(y.device)[:, None]
    out = y.new_full((total, *y.shape[2:]), fill)
    return out.index_put((idx[valid],), y[valid])


def _check_broadcast(t: torch.Tensor, name: str, full: tuple[int, ...], strict: bool) -> None:
    ok = t.dim() == len(full) and all(
        d == f or (d == 1 and not (strict and k == len(full) - 1))
        for k, (d, f) in enumerate(zip(t.shape, full, strict=True))
    )
    if not ok:
        dims = ", ".join(f"1|{f}" for f in full[:-1]) + f", {full[-1]}"
        _bad(name, t, f"shape [{dims}]" if strict else f"broadcastable to {list(full)}")


def _check_scalars(
    q: Any,
    k: Any,
    v: Any,
    qkv_format: str,
    attn_mask_type: str,
    bias_type: str,
    softmax_type: str,
    dropout_p: Any,
    softmax_scale: Any,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            _bad(name, t, "a floating-point torch.Tensor")
        if t.dtype != q.dtype or t.device != q.device:
            _bad(name, t, f"dtype {q.dtype} and device {q.device} like q")
        ndim = 3 if qkv_format == "thd" else 4
        if qkv_format in QKV_FORMATS and t.dim() != ndim:
            _bad(f"{name}.shape", tuple(t.shape), f"{ndim} dims for qkv_format={qkv_format!r}")
    for name, value, allowed in (
        ("qkv_format", qkv_format, QKV_FORMATS),
        ("attn_mask_type", attn_mask_type, MASK_TYPES),
        ("bias_type", bias_type, BIAS_TYPES),
        ("softmax_type", softmax_type, SOFTMAX_TYPES),
    ):
        if value not in allowed:
            _bad(name, value, f"one of {allowed}")
    h, hg = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hg or h % hg != 0:
        _bad("k.shape", tuple(k.shape), f"kv heads equal in k and v and dividing q heads ({h})")
    if k.shape[-1] != q.shape[-1]:
        _bad("k.shape", tuple(k.shape), f"head_dim_qk {q.shape[-1]} like q")
    if k.shape[:-2] != v.shape[:-2]:
        _bad("v.shape", tuple(v.shape), f"leading dims {tuple(k.shape[:-2])} like k")
    batch_dim = {"bshd": 0, "sbhd": 1}.get(qkv_format)
    if batch_dim is not None and k.shape[batch_dim] != q.shape[batch_dim]:
        _bad("k.shape", tuple(k.shape), f"batch size {q.shape[batch_dim]} like q")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        _bad("dropout_p", dropout_p, "a float in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        _bad("dropout_p", dropout_p, "a float in [0, 1)")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
    ):
        _bad("softmax_scale", softmax_scale, "a finite float or None")


def _beyond(lens: torch.Tensor | None, s: int, dev: torch.device) -> torch.Tensor | None:
    """[b, s] True where a position lies beyond its sequence length (None if no lengths)."""
    return None if lens is None else torch.arange(s, device=dev) >= lens.to(dev)[:, None]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    attn_mask_type: str = "no_mask",
    attention_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    bottom_right_diagonal: bool | None = None,
    bias_type: str = "no_bias",
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    softmax_type: str = "vanilla",
    softmax_offset: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Unfused attention in fp32 (fp64 for fp64 inputs); output in ``q``'s format and dtype.

    Shapes: bshd ``[b, s, h, d]``, sbhd ``[s, b, h, d]``, thd ``[t, h, d]``. ``cu_seqlens_*``
    ([b+1]) are required for thd (which always means padding); with bshd/sbhd they give actual
    lengths and need a ``padding*`` mask type. ``cu_seqlens_*_padded`` (thd only) are the
    sequence start offsets when sequences are padded apart. k/v may have fewer heads (GQA/MQA)
    and v another head dim. ``bias`` is ``[1|b, 1|h, 1|sq, skv]`` (max lengths for thd);
    ``alibi_slopes`` is ``[h]`` or ``[b, h]`` (default :func:`default_alibi_slopes`).
    Padding queries and fully masked rows give zeros. Returns ``out`` or ``(out, lse)``; the
    module docstring has the mask, ALiBi and lse conventions.
    """
    _check_scalars(
        q, k, v, qkv_format, attn_mask_type, bias_type, softmax_type, dropout_p, softmax_scale
    )
    _check_window(window_size)
    bottom_right = is_bottom_right(attn_mask_type, bottom_right_diagonal)
    thd = qkv_format == "thd"
    if attn_mask_type == "arbitrary":
        if attention_mask is None or thd:
            _bad("attention_mask", attention_mask, "a bool mask with bshd/sbhd for 'arbitrary'")
    elif attention_mask is not None:
        _bad("attention_mask", attention_mask, "None unless attn_mask_type='arbitrary'")
    if not thd:
        for name, cu in (
            ("cu_seqlens_q_padded", cu_seqlens_q_padded),
            ("cu_seqlens_kv_padded", cu_seqlens_kv_padded),
        ):
            if cu is not None:
                _bad(name, cu, "None unless qkv_format='thd'")
        if (cu_seqlens_q is not None or cu_seqlens_kv is not None) and (
            "padding" not in attn_mask_type
        ):
            _bad("attn_mask_type", attn_mask_type, "a padding* type when cu_seqlens are given")

    # Bring q/k/v to [b, h, s, d] with optional actual lengths lq/lkv [b].
    lq = lkv = None
    if thd:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is None:
                _bad(name, cu, "cumulative sequence lengths [b+1] for qkv_format='thd'")
        lq = _seqlens(cu_seqlens_q, "cu_seqlens_q", None, q.shape[0])
        lkv = _seqlens(cu_seqlens_kv, "cu_seqlens_kv", lq.numel(), k.shape[0])
        starts_q = _check_padded(cu_seqlens_q_padded, "cu_seqlens_q_padded", lq, q.shape[0])
        starts_kv = _check_padded(cu_seqlens_kv_padded, "cu_seqlens_kv_padded", lkv, k.shape[0])
        sq = int(lq.max()) if lq.numel() else 0
        skv = int(lkv.max()) if lkv.numel() else 0
        qb = _pack(q, starts_q, lq, sq)
        kb, vb = (_pack(x, starts_kv, lkv, skv) for x in (k, v))
    else:
        perm = (0, 2, 1, 3) if qkv_format == "bshd" else (1, 2, 0, 3)
        qb, kb, vb = (x.permute(*perm) for x in (q, k, v))
        b, sq, skv = qb.shape[0], qb.shape[2], kb.shape[2]
        if cu_seqlens_q is not None:
            lq = _seqlens(cu_seqlens_q, "cu_seqlens_q", b, b * sq)
            if bool((lq > sq).any()):
                _bad("cu_seqlens_q", cu_seqlens_q, f"sequence lengths <= {sq}")
        if cu_seqlens_kv is not None:
            lkv = _seqlens(cu_seqlens_kv, "cu_seqlens_kv", b, b * skv)
            if bool((lkv > skv).any()):
                _bad("cu_seqlens_kv", cu_seqlens_kv, f"sequence lengths <= {skv}")
    b, h = qb.shape[:2]
    full = (b, h, sq, skv)
    dev = qb.device

    # Remaining tensor arguments, checked against the batched shape.
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            _bad("attention_mask", attention_mask, "dtype torch.bool (True = masked out)")
        _check_broadcast(attention_mask, "attention_mask", full, strict=False)
    if bias_type in ("pre_scale_bias", "post_scale_bias"):
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            _bad("bias", bias, f"a floating-point tensor for bias_type={bias_type!r}")
        _check_broadcast(bias, "bias", full, strict=True)
    elif bias is not None:
        _bad("bias", bias, f"None for bias_type={bias_type!r}")
    if bias_type == "alibi":
        slopes = default_alibi_slopes(h) if alibi_slopes is None else alibi_slopes
        if not isinstance(slopes, torch.Tensor) or tuple(slopes.shape) not in ((h,), (b, h)):
            _bad("alibi_slopes", slopes, f"a tensor of shape [{h}] or [{b}, {h}]")
    elif alibi_slopes is not None:
        _bad("alibi_slopes", alibi_slopes, "None unless bias_type='alibi'")
    if softmax_type == "learnable":
        if not isinstance(softmax_offset, torch.Tensor) or (
            tuple(softmax_offset.shape) not in ((h,), (1, h, 1, 1))
        ):
            _bad("softmax_offset", softmax_offset, f"a tensor of shape [{h}] or [1, {h}, 1, 1]")
    elif softmax_offset is not None:
        _bad("softmax_offset", softmax_offset, "None unless softmax_type='learnable'")

    # Scaled, biased, masked logits in the compute dtype; padding rows of q/k/v zeroed.
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb, kb, vb = (x.to(ct) for x in (qb, kb, vb))
    kb, vb = (x.repeat_interleave(h // kb.shape[1], dim=1) for x in (kb, vb))
    pad_q, pad_kv = _beyond(lq, sq, dev), _beyond(lkv, skv, dev)
    if pad_q is not None:
        qb = qb.masked_fill(pad_q[:, None, :, None], 0)
    if pad_kv is not None:
        kb, vb = (x.masked_fill(pad_kv[:, None, :, None], 0) for x in (kb, vb))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    s = torch.einsum("bhqd,bhkd->bhqk", qb, kb)
    if bias_type == "pre_scale_bias":
        s = (s + bias.to(dev, ct)) * scale
    else:
        s = s * scale
    if bias_type == "post_scale_bias":
        s = s + bias.to(dev, ct)
    if bias_type == "alibi":
        i = torch.arange(sq, device=dev).view(1, 1, sq, 1)
        j = torch.arange(skv, device=dev).view(1, 1, 1, skv)
        off = 0
        if bottom_right:
            lq_ = torch.tensor([sq], device=dev) if lq is None else lq.to(dev)
            lkv_ = torch.tensor([skv], device=dev) if lkv is None else lkv.to(dev)
            off = (lkv_ - lq_).view(-1, 1, 1, 1)
        s = s - slopes.to(dev, ct).view(-1, h, 1, 1) * (i + off - j).abs().to(ct)
    masked = build_mask(
        sq,
        skv,
        attn_mask_type=attn_mask_type,
        window_size=window_size,
        bottom_right_diagonal=bottom_right_diagonal,
        seqlens_q=lq,
        seqlens_kv=lkv,
        attention_mask=attention_mask,
        device=dev,
    )
    s = s.masked_fill(masked, float("-inf"))

    # Softmax with an optional sink logit; rows with nothing to attend to stay finite (0).
    sink = None
    if softmax_type == "learnable":
        sink = softmax_offset.to(dev, ct).view(1, h, 1, 1)
    elif softmax_type == "off-by-one":
        sink = s.new_zeros(1, h, 1, 1)
    m = s.amax(-1, keepdim=True) if skv else s.new_full((b, h, sq, 1), float("-inf"))
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, 0).detach()
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    live = denom > 0
    safe = torch.where(live, denom, 1)
    probs = p / safe
    lse = torch.where(live, torch.log(safe) + m, float("-inf")).squeeze(-1)
    if pad_q is not None:
        lse = lse.masked_fill(pad_q[:, None, :], float("-inf"))
    if dropout_p > 0:
        gen_dev = generator.device if generator is not None else dev
        noise = torch.rand(probs.shape, generator=generator, device=gen_dev, dtype=ct).to(dev)
        probs = probs * (noise >= dropout_p) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, vb).to(q.dtype)

    if thd:
        out = _unpack(out.transpose(1, 2), starts_q, lq, q.shape[0], 0.0)
        lse = _unpack(lse.transpose(1, 2), starts_q, lq, q.shape[0], float("-inf")).t()
    else:
        out = out.transpose(1, 2) if qkv_format == "bshd" else out.permute(2, 0, 1, 3)
    return (out.contiguous(), lse.contiguous()) if return_lse else out.contiguous()

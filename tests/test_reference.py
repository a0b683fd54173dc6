"""Tests for the unfused reference attention (the numerical oracle)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from te_fl_attention.kernels.reference import (  # noqa: E402
    attention,
    build_mask,
    default_alibi_slopes,
)

F64 = torch.float64
NEG_INF = float("-inf")
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}


def rand(*shape: int, dtype: torch.dtype = F64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def qkv(b: int, sq: int, skv: int, h: int = 2, hg: int = 2, d: int = 4, dv: int = 4, **kw):
    """Random bshd q [b, sq, h, d], k [b, skv, hg, d], v [b, skv, hg, dv]."""
    return (
        rand(b, sq, h, d, seed=1, **kw),
        rand(b, skv, hg, d, seed=2, **kw),
        rand(b, skv, hg, dv, seed=3, **kw),
    )


def naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: Callable[[int, int, int], bool] = lambda hh, i, j: True,
    *,
    scale: float | None = None,
    bias: Callable[[int, int, int], float] | None = None,
    pre_scale: bool = False,
    sink: Callable[[int], float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence with explicit loops: q [sq, h, d], k/v [skv, hg, d] -> out [sq, h, dv], lse."""
    sq, h, d = q.shape
    skv, hg, dv = v.shape
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(sq, h, dv, dtype=F64)
    lse = torch.full((h, sq), NEG_INF, dtype=F64)
    for hh in range(h):
        g = hh // (h // hg)
        for i in range(sq):
            js = [j for j in range(skv) if keep(hh, i, j)]
            logits = []
            for j in js:
                dot = float(q[i, hh].double() @ k[j, g].double())
                extra = bias(hh, i, j) if bias else 0.0
                logits.append((dot + extra) * scale if pre_scale else dot * scale + extra)
            terms = logits + ([sink(hh)] if sink else [])
            if not terms:
                continue
            top = max(terms)
            lse[hh, i] = top + math.log(sum(math.exp(t - top) for t in terms))
            for j, t in zip(js, logits, strict=True):
                out[i, hh] += math.exp(t - lse[hh, i]) * v[j, g].double()
    return out, lse


def window_keep(left: int, right: int, off: int) -> Callable[[int, int, int], bool]:
    def keep(hh: int, i: int, j: int) -> bool:
        return (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)

    return keep


def sdpa(q, k, v, **kw):  # bshd in and out
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw
        )
    return o.transpose(1, 2)


# ---------------------------------------------------------------- against torch SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("case", ["plain", "causal", "arbitrary", "gqa", "mqa", "scale"])
def test_matches_sdpa(case: str, fmt: str, dtype: torch.dtype) -> None:
    hg = {"gqa": 2, "mqa": 1}.get(case, 4)
    q, k, v = qkv(2, 5, 7, h=4, hg=hg, d=8, dv=8, dtype=dtype)
    kw: dict = {}
    skw: dict = {"enable_gqa": hg != 4}
    if case == "causal":
        kw["attn_mask_type"], skw["is_causal"] = "causal", True
    elif case == "arbitrary":
        mask = rand(2, 4, 5, 7, seed=9) > 0.3
        mask[..., 0] = False  # every row keeps a key
        kw["attn_mask_type"], kw["attention_mask"], skw["attn_mask"] = "arbitrary", mask, ~mask
    elif case == "scale":
        kw["softmax_scale"] = skw["scale"] = 0.77
    expected = sdpa(q, k, v, **skw)
    if fmt == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        expected = expected.transpose(0, 1)
    out = attention(q, k, v, qkv_format=fmt, **kw)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_float64_stays_float64_and_lse_shape() -> None:
    q, k, v = qkv(2, 3, 4)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.dtype == F64 and lse.dtype == F64 and lse.shape == (2, 2, 3)
    out, lse = attention(q.float(), k.float(), v.float(), return_lse=True)
    assert lse.dtype == torch.float32


# ---------------------------------------------------------------- hand computations


def check_batch(out, lse, q, k, v, keep_for, **kw) -> None:
    """Compare every batch entry of a bshd result to :func:`naive`."""
    for b in range(q.shape[0]):
        ref_out, ref_lse = naive(q[b], k[b], v[b], keep_for(b), **kw)
        torch.testing.assert_close(out[b], ref_out)
        torch.testing.assert_close(lse[b], ref_lse)


@pytest.mark.parametrize(("sq", "skv"), [(3, 6), (6, 3), (4, 4)])
@pytest.mark.parametrize("bottom_right", [True, False])
def test_causal_both_alignments(sq: int, skv: int, bottom_right: bool) -> None:
    q, k, v = qkv(2, sq, skv)
    mask_type = "causal_bottom_right" if bottom_right else "causal"
    out, lse = attention(q, k, v, attn_mask_type=mask_type, return_lse=True)
    off = skv - sq if bottom_right else 0
    check_batch(out, lse, q, k, v, lambda b: window_keep(-1, 0, off))


@pytest.mark.parametrize("window", [(1, 0), (2, 1), (0, 2), (-1, 1), (1, -1), (0, 0)])
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize(("sq", "skv"), [(4, 6), (6, 4)])
def test_sliding_window(window, bottom_right: bool, sq: int, skv: int) -> None:
    q, k, v = qkv(1, sq, skv)
    out, lse = attention(
        q, k, v, window_size=window, bottom_right_diagonal=bottom_right, return_lse=True
    )
    off = skv - sq if bottom_right else 0
    check_batch(out, lse, q, k, v, lambda b: window_keep(*window, off))


@pytest.mark.parametrize("mask_type", ["causal", "causal_bottom_right"])
def test_causal_forces_right_zero(mask_type: str) -> None:
    q, k, v = qkv(1, 4, 6)
    out, lse = attention(q, k, v, attn_mask_type=mask_type, window_size=(1, 3), return_lse=True)
    off = 2 if mask_type.endswith("bottom_right") else 0
    check_batch(out, lse, q, k, v, lambda b: window_keep(1, 0, off))


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_padding_bshd(mask_type: str, fmt: str) -> None:
    lq, lkv = [3, 5, 0, 2], [4, 2, 6, 6]
    q, k, v = qkv(4, 5, 6, h=4, hg=2)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k, v) if fmt == "bshd" else tuple(x.transpose(0, 1) for x in (q, k, v))
    out, lse = attention(
        *args,
        qkv_format=fmt,
        attn_mask_type=mask_type,
        cu_seqlens_q=cu(lq),
        cu_seqlens_kv=cu(lkv),
        window_size=(3, -1),
        return_lse=True,
    )
    if fmt == "sbhd":
        out = out.transpose(0, 1)
    for b in range(4):
        off = 0 if mask_type == "padding_causal" else lkv[b] - lq[b]
        keep = window_keep(3, -1 if mask_type == "padding" else 0, off)
        ref_out, ref_lse = naive(q[b, : lq[b]], k[b, : lkv[b]], v[b, : lkv[b]], keep)
        torch.testing.assert_close(out[b, : lq[b]], ref_out)
        torch.testing.assert_close(lse[b, :, : lq[b]], ref_lse)
        assert (out[b, lq[b] :] == 0).all() and (lse[b, :, lq[b] :] == NEG_INF).all()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal_bottom_right", "causal"])
def test_thd_varlen(padded: bool, mask_type: str) -> None:
    lq, lkv = [3, 1, 4, 0], [2, 5, 4, 3]
    gap_q, gap_kv = ([1, 0, 2, 1], [0, 2, 1, 1]) if padded else ([0] * 4, [0] * 4)
    h, hg = 4, 2

    def offsets(lens, gaps):
        starts, pos = [], 0
        for n, g in zip(lens, gaps, strict=True):
            starts.append(pos)
            pos += n + g
        return starts, pos

    sq_starts, tq = offsets(lq, gap_q)
    skv_starts, tkv = offsets(lkv, gap_kv)
    q, k, v = rand(tq + 1, h, 4, seed=1), rand(tkv, hg, 4, seed=2), rand(tkv, hg, 3, seed=3)
    if padded:
        k[skv_starts[1] + lkv[1]] = float("nan")  # garbage in the padding must not leak
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    kw = {}
    if padded:
        kw = {
            "cu_seqlens_q_padded": torch.tensor([*sq_starts, tq]),
            "cu_seqlens_kv_padded": torch.tensor([*skv_starts, tkv]),
        }
    out, lse = attention(
        q,
        k,
        v,
        qkv_format="thd",
        cu_seqlens_q=cu(lq),
        cu_seqlens_kv=cu(lkv),
        attn_mask_type=mask_type,
        return_lse=True,
        **kw,
    )
    assert out.shape == (tq + 1, h, 3) and lse.shape == (h, tq + 1)
    covered = torch.zeros(tq + 1, dtype=torch.bool)
    for b in range(4):
        qs, ks = (
            slice(sq_starts[b], sq_starts[b] + lq[b]),
            slice(skv_starts[b], skv_starts[b] + lkv[b]),
        )
        off = lkv[b] - lq[b] if mask_type.endswith("bottom_right") else 0
        keep = window_keep(-1, -1 if mask_type == "padding" else 0, off)
        ref_out, ref_lse = naive(q[qs], k[ks], v[ks], keep)
        torch.testing.assert_close(out[qs], ref_out)
        torch.testing.assert_close(lse[:, qs], ref_lse)
        covered[qs] = True
    assert (out[~covered] == 0).all() and (lse[:, ~covered] == NEG_INF).all()
    assert not out.isnan().any()


@pytest.mark.parametrize("shape", ["1hss", "b1ss", "bhss", "11ss", "111s"])
@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
def test_bias_shapes(shape: str, bias_type: str) -> None:
    b, h, sq, skv = 2, 3, 4, 5
    q, k, v = qkv(b, sq, skv, h=h, hg=h)
    dims = {
        "1hss": (1, h, sq, skv),
        "b1ss": (b, 1, sq, skv),
        "bhss": (b, h, sq, skv),
        "11ss": (1, 1, sq, skv),
        "111s": (1, 1, 1, skv),
    }[shape]
    bias = rand(*dims, seed=5)
    out, lse = attention(q, k, v, bias_type=bias_type, bias=bias, return_lse=True)
    full = bias.expand(b, h, sq, skv)
    for bb in range(b):
        ref_out, ref_lse = naive(
            q[bb],
            k[bb],
            v[bb],
            bias=lambda hh, i, j, bb=bb: float(full[bb, hh, i, j]),
            pre_scale=bias_type == "pre_scale_bias",
        )
        torch.testing.assert_close(out[bb], ref_out)
        torch.testing.assert_close(lse[bb], ref_lse)


def test_default_alibi_slopes() -> None:
    assert default_alibi_slopes(8).tolist() == [2.0**-n for n in range(1, 9)]
    six = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert default_alibi_slopes(6).tolist() == six


@pytest.mark.parametrize("slopes_shape", ["default", "h", "bh"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_alibi(slopes_shape: str, mask_type: str) -> None:
    b, h, sq, skv = 2, 3, 3, 5
    q, k, v = qkv(b, sq, skv, h=h, hg=h)
    slopes = {"default": None, "h": rand(h, seed=6).abs(), "bh": rand(b, h, seed=6).abs()}[
        slopes_shape
    ]
    out, lse = attention(
        q,
        k,
        v,
        attn_mask_type=mask_type,
        bias_type="alibi",
        alibi_slopes=slopes,
        return_lse=True,
    )
    full = (default_alibi_slopes(h) if slopes is None else slopes).double().expand(b, h)
    off = 0 if mask_type == "causal" else skv - sq
    right = -1 if mask_type == "no_mask" else 0
    for bb in range(b):
        ref_out, ref_lse = naive(
            q[bb],
            k[bb],
            v[bb],
            window_keep(-1, right, off),
            bias=lambda hh, i, j, bb=bb: -float(full[bb, hh]) * abs(i + off - j),
        )
        torch.testing.assert_close(out[bb], ref_out)
        torch.testing.assert_close(lse[bb], ref_lse)


def test_alibi_uses_actual_lengths_with_padding() -> None:
    lq, lkv = [2, 3], [4, 3]
    q, k, v = qkv(2, 3, 4, h=2, hg=1)
    out, lse = attention(
        q,
        k,
        v,
        attn_mask_type="padding_causal_bottom_right",
        bias_type="alibi",
        cu_seqlens_q=torch.tensor([0, 2, 5]),
        cu_seqlens_kv=torch.tensor([0, 4, 7]),
        return_lse=True,
    )
    slopes = default_alibi_slopes(2)
    for b in range(2):
        off = lkv[b] - lq[b]
        ref_out, ref_lse = naive(
            q[b, : lq[b]],
            k[b, : lkv[b]],
            v[b, : lkv[b]],
            window_keep(-1, 0, off),
            bias=lambda hh, i, j, off=off: -float(slopes[hh]) * abs(i + off - j),
        )
        torch.testing.assert_close(out[b, : lq[b]], ref_out)
        torch.testing.assert_close(lse[b, :, : lq[b]], ref_lse)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("offset_shape", [(3,), (1, 3, 1, 1)])
def test_sink_softmax(softmax_type: str, offset_shape: tuple[int, ...]) -> None:
    q, k, v = qkv(2, 4, 5, h=3, hg=3)
    sinks = rand(*offset_shape, seed=8)
    offset = sinks if softmax_type == "learnable" else None
    out, lse = attention(
        q,
        k,
        v,
        softmax_type=softmax_type,
        softmax_offset=offset,
        attn_mask_type="causal_bottom_right",
        window_size=(0, 0),
        return_lse=True,
    )
    flat = sinks.flatten() if offset is not None else torch.zeros(3, dtype=F64)
    check_batch(out, lse, q, k, v, lambda b: window_keep(0, 0, 1), sink=lambda hh: float(flat[hh]))


def test_sink_on_fully_masked_row_gives_zero_out_and_sink_lse() -> None:
    q, k, v = qkv(1, 4, 2)  # bottom-right causal: rows 0 and 1 see no key
    offset = torch.tensor([0.5, -1.0], dtype=F64)
    out, lse = attention(
        q,
        k,
        v,
        attn_mask_type="causal_bottom_right",
        softmax_type="learnable",
        softmax_offset=offset,
        return_lse=True,
    )
    assert (out[0, :2] == 0).all()
    torch.testing.assert_close(lse[0, :, :2], offset[:, None].expand(2, 2))


def test_fully_masked_rows_zero_and_finite_grads() -> None:
    q, k, v = qkv(2, 5, 3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = torch.zeros(2, 1, 5, 3, dtype=torch.bool)
    mask[:, :, 1] = True  # row 1 fully masked by the arbitrary mask
    out, lse = attention(q, k, v, attn_mask_type="arbitrary", attention_mask=mask, return_lse=True)
    out2, lse2 = attention(q, k, v, attn_mask_type="causal_bottom_right", return_lse=True)
    assert (out[:, 1] == 0).all() and (lse[:, :, 1] == NEG_INF).all()
    assert (out2[:, :2] == 0).all() and (lse2[:, :, :2] == NEG_INF).all()
    (out.sum() + out2.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, 1] == 0).all() and not out.isnan().any() and not out2.isnan().any()


def test_padding_positions_get_zero_grads() -> None:
    q, k, v = qkv(2, 4, 4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, 2, 5])
    out = attention(q, k, v, attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out.pow(2).sum().backward()
    assert (q.grad[0, 2:] == 0).all() and (k.grad[0, 2:] == 0).all() and (v.grad[1, 3:] == 0).all()
    assert q.grad[0, :2].abs().sum() > 0


def test_lse_matches_logsumexp() -> None:
    q, k, v = qkv(2, 4, 6, h=4, hg=2)
    _, lse = attention(q, k, v, softmax_scale=0.3, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


@given(
    sq=st.integers(1, 6),
    skv=st.integers(1, 6),
    left=st.integers(-1, 4),
    right=st.integers(-1, 4),
    mask_type=st.sampled_from(["no_mask", "causal", "causal_bottom_right", "padding"]),
)
@settings(max_examples=40, deadline=None)
def test_build_mask_rule(sq: int, skv: int, left: int, right: int, mask_type: str) -> None:
    masked = build_mask(sq, skv, attn_mask_type=mask_type, window_size=(left, right))
    assert masked.shape == (1, 1, sq, skv)
    off = 0 if mask_type == "causal" else skv - sq
    right = 0 if "causal" in mask_type else right
    keep = window_keep(left, right, off)
    for i in range(sq):
        for j in range(skv):
            assert bool(masked[0, 0, i, j]) == (not keep(0, i, j))


# ---------------------------------------------------------------- dropout


def test_dropout_reproducible_and_unbiased() -> None:
    q, k, v = qkv(1, 3, 4)
    run = lambda p, seed: attention(
        q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(seed)
    )
    torch.testing.assert_close(run(0.3, 7), run(0.3, 7), rtol=0, atol=0)
    assert not torch.equal(run(0.3, 7), run(0.3, 8))
    torch.testing.assert_close(run(0.0, 7), attention(q, k, v), rtol=0, atol=0)
    # Many independent batch entries: the mean approaches the no-dropout output.
    n = 4000
    big = [x.expand(n, *x.shape[1:]) for x in (q, k, v)]
    dropped = attention(*big, dropout_p=0.3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(dropped.mean(0), attention(q, k, v)[0], atol=0.05, rtol=0)


def test_dropout_kept_fraction() -> None:
    skv = 8192  # uniform attention over ones: out = kept fraction / (1 - p)
    q, k, v = torch.zeros(1, 1, 1, 2), torch.zeros(1, skv, 1, 2), torch.ones(1, skv, 1, 2)
    out = attention(q, k, v, dropout_p=0.25, generator=torch.Generator().manual_seed(3))
    assert abs(float(out.mean()) - 1.0) < 0.03


# ---------------------------------------------------------------- gradients


def _gradcheck(fn, *inputs: torch.Tensor) -> None:
    inputs = tuple(x.detach().requires_grad_() for x in inputs)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_gradcheck_plain() -> None:
    _gradcheck(lambda q, k, v: attention(q, k, v), *qkv(1, 3, 4, d=3, dv=3))


def test_gradcheck_causal_bottom_right_with_lse() -> None:
    _gradcheck(
        lambda q, k, v: attention(q, k, v, attn_mask_type="causal_bottom_right", return_lse=True),
        *qkv(1, 3, 4, d=3, dv=3),
    )


def test_gradcheck_gqa() -> None:
    _gradcheck(lambda q, k, v: attention(q, k, v), *qkv(1, 3, 3, h=4, hg=2, d=2, dv=2))


def test_gradcheck_post_scale_bias() -> None:
    fn = lambda q, k, v, bias: attention(q, k, v, bias_type="post_scale_bias", bias=bias)
    _gradcheck(fn, *qkv(1, 3, 4, d=2, dv=2), rand(1, 2, 3, 4, seed=4))


def test_gradcheck_learnable_sink() -> None:
    fn = lambda q, k, v, s: attention(
        q, k, v, softmax_type="learnable", softmax_offset=s, return_lse=True
    )
    _gradcheck(fn, *qkv(1, 3, 3, d=2, dv=2), rand(2, seed=4))


def test_gradcheck_thd_varlen() -> None:
    cu_q, cu_kv = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 4])
    fn = lambda q, k, v: attention(
        q,
        k,
        v,
        qkv_format="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        attn_mask_type="padding_causal_bottom_right",
    )
    _gradcheck(fn, rand(5, 2, 2, seed=1), rand(4, 1, 2, seed=2), rand(4, 1, 2, seed=3))


def test_gradcheck_mla() -> None:
    _gradcheck(
        lambda q, k, v: attention(q, k, v, attn_mask_type="causal"), *qkv(1, 3, 3, d=3, dv=2)
    )


# ---------------------------------------------------------------- bad inputs


def _bad_cases() -> list[tuple[str, dict, str]]:
    return [
        ("format", {"qkv_format": "bhsd"}, "qkv_format"),
        ("mask", {"attn_mask_type": "top_left"}, "attn_mask_type"),
        ("bias type", {"bias_type": "alibi2"}, "bias_type"),
        ("softmax", {"softmax_type": "sparse"}, "softmax_type"),
        ("window", {"window_size": (-2, 0)}, "window_size"),
        ("window len", {"window_size": (1,)}, "window_size"),
        ("dropout", {"dropout_p": 1.0}, "dropout_p"),
        ("scale", {"softmax_scale": float("nan")}, "softmax_scale"),
        ("diag", {"attn_mask_type": "causal", "bottom_right_diagonal": True}, "bottom_right"),
        ("no bias", {"bias_type": "post_scale_bias"}, "bias"),
        ("bias shape", {"bias_type": "pre_scale_bias", "bias": torch.zeros(1, 1, 4, 4)}, "bias"),
        ("stray bias", {"bias": torch.zeros(1, 1, 3, 5)}, "bias"),
        ("slopes", {"bias_type": "alibi", "alibi_slopes": torch.ones(3)}, "alibi_slopes"),
        ("stray slopes", {"alibi_slopes": torch.ones(2)}, "alibi_slopes"),
        ("no offset", {"softmax_type": "learnable"}, "softmax_offset"),
        (
            "offset shape",
            {"softmax_type": "learnable", "softmax_offset": torch.ones(3)},
            "softmax_offset",
        ),
        ("stray offset", {"softmax_offset": torch.ones(2)}, "softmax_offset"),
        ("no mask", {"attn_mask_type": "arbitrary"}, "attention_mask"),
        (
            "stray mask",
            {"attention_mask": torch.ones(1, 1, 3, 5, dtype=torch.bool)},
            "attention_mask",
        ),
        (
            "mask dtype",
            {"attn_mask_type": "arbitrary", "attention_mask": torch.ones(1, 1, 3, 5)},
            "attention_mask",
        ),
        ("cu without padding", {"cu_seqlens_q": torch.tensor([0, 2])}, "attn_mask_type"),
        (
            "cu dtype",
            {"attn_mask_type": "padding", "cu_seqlens_q": torch.tensor([0.0, 2.0])},
            "cu_seqlens_q",
        ),
        (
            "cu len",
            {"attn_mask_type": "padding", "cu_seqlens_kv": torch.tensor([0, 2, 4])},
            "cu_seqlens_kv",
        ),
        (
            "cu too long",
            {"attn_mask_type": "padding", "cu_seqlens_q": torch.tensor([0, 4])},
            "cu_seqlens_q",
        ),
        ("padded bshd", {"cu_seqlens_q_padded": torch.tensor([0, 3])}, "cu_seqlens_q_padded"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "arg"), [c[1:] for c in _bad_cases()], ids=[c[0] for c in _bad_cases()]
)
def test_bad_inputs_raise(kwargs: dict, arg: str) -> None:
    q, k, v = qkv(1, 3, 5)
    with pytest.raises(ValueError, match=arg):
        attention(q, k, v, **kwargs)


def test_bad_tensors_raise() -> None:
    q, k, v = qkv(1, 3, 5, h=4, hg=3)
    with pytest.raises(ValueError, match="k.shape"):
        attention(q, k, v)
    q, k, v = qkv(1, 3, 5)
    with pytest.raises(ValueError, match="k"):
        attention(q, k.float(), v)
    with pytest.raises(ValueError, match="k.shape"):
        attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="v.shape"):
        attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match="q.shape"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        attention(q[0], k[0], v[0], qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3]))
    bad_padded = {"cu_seqlens_q_padded": torch.tensor([0, 1, 3])}
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        attention(
            q[0],
            k[0],
            v[0],
            qkv_format="thd",
            cu_seqlens_q=torch.tensor([0, 2, 3]),
            cu_seqlens_kv=torch.tensor([0, 2, 5]),
            **bad_padded,
        )

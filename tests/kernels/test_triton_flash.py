"""Our Triton flash-attention kernel (forward + backward) against the unfused reference.

Runs on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set below before triton is
imported), which is ~3000x slower than torch: shapes are tiny (seq <= 64, 1-4 heads, batch <= 3)
and the interpreter uses one fixed block configuration (16 x 16; a few tests change it to check
the block-range logic with BLOCK_M != BLOCK_N). Every case compares the output, the lse and all
three gradients with :func:`te_fl_attention.kernels.reference.attention` evaluated in fp32 on the
same (rounded) inputs; a few cases also check out/lse against a tiny fp64 reference written here
from the mask formula, as a second opinion. Errors are measured as ``max|got - want|`` relative
to ``max(1, max|want|)`` and must stay under ``TOL[dtype]``.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from te_fl_attention.kernels import triton_flash as tf  # noqa: E402
from te_fl_attention.kernels.reference import attention as reference  # noqa: E402

# Max error relative to max(1, max|reference|), per input dtype (output, lse and gradients).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

pytestmark = pytest.mark.skipif(
    not tf.interpreting(), reason="these CPU tests need TRITON_INTERPRET=1 at triton import"
)


# ------------------------------------------------------------------------------------------------
# Inputs and comparison
# ------------------------------------------------------------------------------------------------


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def make_case(
    *,
    dtype=F32,
    fmt="bshd",
    b=2,
    sq=24,
    skv=24,
    h=2,
    hkv=None,
    dqk=32,
    dv=None,
    lens_q=None,
    lens_kv=None,
    gaps=False,
    seed=0,
):
    """Random q/k/v (+ grad) in ``fmt`` and the keyword arguments describing their layout.

    bshd/sbhd: ``lens_*`` (if given) are actual lengths -> cu_seqlens (padding masks).
    thd: ``lens_*`` are the sequence lengths; ``gaps`` leaves 1-3 unused tokens after each
    sequence (cu_seqlens_*_padded).
    """
    g = torch.Generator().manual_seed(seed)
    hkv = h if hkv is None else hkv
    dv = dqk if dv is None else dv
    kw = {"qkv_format": fmt}

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if fmt == "thd":
        lens_q = lens_q or [sq] * b
        lens_kv = lens_kv or [skv] * b
        kw["cu_seqlens_q"], kw["cu_seqlens_kv"] = _cu(lens_q), _cu(lens_kv)
        totals = []
        for name, lens in (("q", lens_q), ("kv", lens_kv)):
            if gaps:
                pads = [1 + (3 * i + len(name)) % 3 for i in range(len(lens))]
                padded = _cu([n + p for n, p in zip(lens, pads, strict=True)])
                kw[f"cu_seqlens_{name}_padded"] = padded
                totals.append(int(padded[-1]))
            else:
                totals.append(sum(lens))
        q = rnd(totals[0], h, dqk)
        k, v = rnd(totals[1], hkv, dqk), rnd(totals[1], hkv, dv)
    else:

        def shape(s, hh, d):
            return (b, s, hh, d) if fmt == "bshd" else (s, b, hh, d)

        q = rnd(*shape(sq, h, dqk))
        k, v = rnd(*shape(skv, hkv, dqk)), rnd(*shape(skv, hkv, dv))
        if lens_q is not None:
            kw["cu_seqlens_q"], kw["cu_seqlens_kv"] = _cu(lens_q), _cu(lens_kv)
    do = torch.randn(*q.shape[:-1], dv, generator=g).to(dtype)
    return q, k, v, do, kw


def close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.double(), want.double()
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want), f"{name}: -inf positions differ"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    if inf_want.any():
        assert torch.equal(got[inf_want], want[inf_want]), f"{name}: inf signs differ"
        got, want = got[~inf_want], want[~inf_want]
    if want.numel() == 0:
        return
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{name}: max err {err:.3g} > {TOL[dtype]:g} * {scale:.3g}"


def run_ours(q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = tf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out, lse, grads


def run_reference(q, k, v, do, **kw):
    kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("max_seqlen_q", "max_seqlen_kv")}
    kw.pop("deterministic", None)
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, lse = reference(q, k, v, return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do.float())
    return out, lse, grads


def check(q, k, v, do, **kw):
    """Compare out, lse, dq, dk, dv with the reference; returns our results."""
    ours = run_ours(q, k, v, do, **kw)
    want = run_reference(q, k, v, do, **kw)
    dtype = q.dtype
    close("out", ours[0], want[0], dtype)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    close("lse", ours[1], want[1], dtype)
    for name, got, ref in zip(("dq", "dk", "dv"), ours[2], want[2], strict=True):
        assert got.dtype == dtype, name
        close(name, got, ref, dtype)
    return ours


def dense_lse_out(q, k, v, *, mask, window, bottom_right, scale, lens_q=None, lens_kv=None):
    """Second-opinion reference (bshd, fp64): a direct loop over the visibility formula."""
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    left, right = window
    if "causal" in mask:
        right = 0
    for bi in range(b):
        lq = sq if lens_q is None else lens_q[bi]
        lkv = skv if lens_kv is None else lens_kv[bi]
        off = lkv - lq if bottom_right else 0
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(lq):
                js = [
                    j
                    for j in range(lkv)
                    if (right == -1 or j <= i + off + right) and (left == -1 or j >= i + off - left)
                ]
                if not js:
                    continue
                s = torch.stack([q[bi, i, hi].double() @ k[bi, j, kh].double() for j in js])
                s = s * scale
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                w = torch.softmax(s, 0)
                out[bi, i, hi] = (w[:, None] * v[bi, js, kh].double()).sum(0)
    return out, lse


@pytest.fixture
def blocks(request):
    """Run with other interpreter block sizes (BLOCK_M, BLOCK_N)."""
    saved = tf._INTERPRET_BLOCKS
    tf._INTERPRET_BLOCKS = request.param
    yield request.param
    tf._INTERPRET_BLOCKS = saved


# ------------------------------------------------------------------------------------------------
# Every mask type x every dtype
# ------------------------------------------------------------------------------------------------

MASKS = [
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mask", MASKS)
def test_masks_and_dtypes(mask, dtype):
    pad = "padding" in mask
    q, k, v, do, kw = make_case(
        dtype=dtype,
        sq=20,
        skv=37,
        h=2,
        hkv=1,
        lens_q=[20, 13] if pad else None,
        lens_kv=[29, 37] if pad else None,
        seed=MASKS.index(mask),
    )
    check(q, k, v, do, attn_mask_type=mask, **kw)


@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right", "padding_causal_bottom_right"])
@pytest.mark.parametrize("sq,skv", [(40, 17), (17, 40)], ids=["sq>skv", "sq<skv"])
def test_causal_lengths(mask, sq, skv):
    pad = "padding" in mask
    q, k, v, do, kw = make_case(
        dtype=BF16,
        b=2,
        sq=sq,
        skv=skv,
        lens_q=[sq, sq - 7] if pad else None,
        lens_kv=[skv - 5, skv] if pad else None,
        seed=sq,
    )
    check(q, k, v, do, attn_mask_type=mask, **kw)


# ------------------------------------------------------------------------------------------------
# Formats: bshd / sbhd / thd (varlen, with and without padded offsets)
# ------------------------------------------------------------------------------------------------

FORMATS = [("bshd", False), ("sbhd", False), ("thd", False), ("thd", True)]


@pytest.mark.parametrize("fmt,gaps", FORMATS, ids=["bshd", "sbhd", "thd", "thd_padded"])
@pytest.mark.parametrize(
    "dtype,mask",
    [(F32, "padding"), (F32, "padding_causal"), (BF16, "padding_causal_bottom_right")],
    ids=["fp32-padding", "fp32-padding_causal", "bf16-padding_causal_br"],
)
def test_formats(fmt, gaps, dtype, mask):
    lens_q, lens_kv = [9, 30, 17], [33, 12, 24]
    if fmt == "thd":
        q, k, v, do, kw = make_case(
            dtype=dtype, fmt=fmt, b=3, lens_q=lens_q, lens_kv=lens_kv, gaps=gaps, h=2, hkv=1
        )
    else:
        q, k, v, do, kw = make_case(
            dtype=dtype, fmt=fmt, b=3, sq=30, skv=33, lens_q=lens_q, lens_kv=lens_kv, h=2, hkv=1
        )
    check(q, k, v, do, attn_mask_type=mask, **kw)


@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
def test_thd_without_padding_names_and_empty_sequence(mask):
    """thd always means padding; a zero-length sequence and max_seqlen_* given explicitly."""
    q, k, v, do, kw = make_case(
        fmt="thd", b=3, lens_q=[11, 0, 21], lens_kv=[19, 5, 8], gaps=True, seed=3
    )
    kw.update(max_seqlen_q=21, max_seqlen_kv=19)
    check(q, k, v, do, attn_mask_type=mask, **kw)


def test_sbhd_unpadded_and_non_contiguous_strides():
    """Inputs are read through their strides: q/k/v as views of one packed tensor."""
    g = torch.Generator().manual_seed(5)
    s, b, h, d = 26, 2, 2, 24
    qkv = torch.randn(s, b, h, 3, d, generator=g)
    q, k, v = qkv.unbind(3)
    assert not q.is_contiguous()
    do = torch.randn(b, h, s, d, generator=g).permute(2, 0, 1, 3)  # non-contiguous grad
    check(q, k, v, do, qkv_format="sbhd", attn_mask_type="causal")
    bq = torch.randn(b, h, s, d, generator=g).transpose(1, 2)  # bhsd memory seen as bshd
    check(bq, bq.flip(1), bq * 0.5, do.transpose(0, 1), attn_mask_type="no_mask")


# ------------------------------------------------------------------------------------------------
# Head dims, GQA / MQA, scale
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dqk,dv,dtype",
    [(40, 72, F32), (72, 40, BF16), (8, 24, F16), (64, 64, BF16), (256, 256, F32), (256, 96, F16)],
)
def test_head_dims(dqk, dv, dtype):
    sq = 16 if max(dqk, dv) > 128 else 24
    q, k, v, do, kw = make_case(dtype=dtype, b=1, sq=sq, skv=sq + 5, h=2, dqk=dqk, dv=dv)
    check(q, k, v, do, attn_mask_type="causal_bottom_right", **kw)


@pytest.fixture
def gqa_split(request):
    """Force the GQA dK/dV strategy: per-q-head partials + sum (True) or group loop (False)."""
    saved = tf._GQA_SPLIT
    tf._GQA_SPLIT = request.param
    yield request.param
    tf._GQA_SPLIT = saved


@pytest.mark.parametrize(
    "hkv,gqa_split",
    [(4, None), (2, False), (2, True), (1, False), (1, True)],
    indirect=["gqa_split"],
    ids=["mha", "gqa-loop", "gqa-split", "mqa-loop", "mqa-split"],
)
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_gqa_mqa(hkv, fmt, gqa_split):
    lens = {"lens_q": [14, 25], "lens_kv": [21, 9]} if fmt == "thd" else {}
    q, k, v, do, kw = make_case(
        dtype=BF16, fmt=fmt, b=2, sq=25, skv=21, h=4, hkv=hkv, dqk=16, **lens
    )
    check(q, k, v, do, attn_mask_type="padding_causal", **kw)


@pytest.mark.parametrize("scale", [0.05, 1.0, 0.3])
def test_custom_softmax_scale(scale):
    q, k, v, do, kw = make_case(sq=19, skv=23, dqk=20, seed=int(scale * 100))
    check(q, k, v, do, attn_mask_type="no_mask", softmax_scale=scale, **kw)


# ------------------------------------------------------------------------------------------------
# Sliding windows, both alignments
# ------------------------------------------------------------------------------------------------

WINDOWS = [(4, 0), (3, 5), (-1, 2), (6, -1), (0, 0), (20, 20)]


@pytest.mark.parametrize("sq,skv", [(34, 21), (21, 34)], ids=["sq>skv", "sq<skv"])
@pytest.mark.parametrize("bottom_right", [True, False], ids=["br", "tl"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}_{b}" for a, b in WINDOWS])
def test_windows(window, bottom_right, sq, skv):
    q, k, v, do, kw = make_case(sq=sq, skv=skv, b=1, h=1, dqk=16, seed=window[0] + 7)
    check(q, k, v, do, window_size=window, bottom_right_diagonal=bottom_right, **kw)


@pytest.mark.parametrize(
    "fmt,dtype,window,bottom_right",
    [
        ("thd", F32, (5, 2), True),
        ("thd", F16, (3, -1), False),
        ("sbhd", BF16, (-1, 4), True),
        ("sbhd", F32, (6, 1), False),
    ],
)
def test_windows_formats_gqa(fmt, dtype, window, bottom_right):
    lens_q, lens_kv = [19, 6, 27], [25, 14, 3]
    if fmt == "thd":
        q, k, v, do, kw = make_case(
            dtype=dtype, fmt=fmt, b=3, lens_q=lens_q, lens_kv=lens_kv, gaps=True, h=4, hkv=2
        )
    else:
        q, k, v, do, kw = make_case(
            dtype=dtype, fmt=fmt, b=3, sq=27, skv=25, lens_q=lens_q, lens_kv=lens_kv, h=4, hkv=2
        )
    mask = "padding"
    check(
        q,
        k,
        v,
        do,
        attn_mask_type=mask,
        window_size=window,
        bottom_right_diagonal=bottom_right,
        **kw,
    )


@pytest.mark.parametrize(
    "sq,skv,mask", [(1, 37, "causal_bottom_right"), (1, 37, "causal"), (29, 1, "no_mask")]
)
def test_single_query_or_key(sq, skv, mask):
    q, k, v, do, kw = make_case(dtype=F16, b=2, sq=sq, skv=skv, h=2, hkv=1, seed=sq + skv)
    check(q, k, v, do, attn_mask_type=mask, **kw)


@pytest.mark.parametrize(
    "mask,window", [("causal", (5, -1)), ("padding_causal_bottom_right", (7, 0))]
)
def test_windows_with_causal_and_padding(mask, window):
    pad = "padding" in mask
    q, k, v, do, kw = make_case(
        dtype=F16,
        sq=29,
        skv=40,
        lens_q=[29, 11] if pad else None,
        lens_kv=[18, 40] if pad else None,
        seed=11,
    )
    check(q, k, v, do, attn_mask_type=mask, window_size=window, **kw)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], indirect=True, ids=["m16n32", "m32n16"])
@pytest.mark.parametrize(
    "mask,window,sq,skv",
    [
        ("causal_bottom_right", (9, 0), 45, 64),
        ("causal", (-1, -1), 64, 40),
        ("no_mask", (13, 3), 50, 50),
    ],
)
def test_block_shapes(blocks, mask, window, sq, skv):
    q, k, v, do, kw = make_case(b=1, h=1, sq=sq, skv=skv, dqk=16, seed=sq)
    check(q, k, v, do, attn_mask_type=mask, window_size=window, **kw)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], indirect=True, ids=["m16n32", "m32n16"])
def test_block_shapes_thd_gqa(blocks):
    q, k, v, do, kw = make_case(
        dtype=BF16, fmt="thd", b=3, lens_q=[45, 0, 17], lens_kv=[38, 9, 50], gaps=True, h=2,
        hkv=1, dqk=24, dv=40,
    )  # fmt: skip
    check(q, k, v, do, attn_mask_type="padding_causal_bottom_right", window_size=(11, 0), **kw)


# ------------------------------------------------------------------------------------------------
# Fully masked rows, second-opinion reference, determinism
# ------------------------------------------------------------------------------------------------


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    # bottom-right causal with sq > skv: the first sq - skv queries see no key.
    q, k, v, do, kw = make_case(dtype=BF16, b=1, sq=30, skv=12, h=2, seed=2)
    out, lse, grads = check(q, k, v, do, attn_mask_type="causal_bottom_right", **kw)
    assert torch.equal(out[:, :18], torch.zeros_like(out[:, :18]))
    assert torch.isneginf(lse[:, :, :18]).all() and torch.isfinite(lse[:, :, 18:]).all()
    assert torch.equal(grads[0][:, :18], torch.zeros_like(grads[0][:, :18]))
    assert all(torch.isfinite(g_).all() for g_ in grads)
    # a window that leaves queries without keys in the middle of the sequence
    q, k, v, do, kw = make_case(b=1, sq=20, skv=20, h=1, seed=4)
    out, lse, grads = check(q, k, v, do, window_size=(2, -1), bottom_right_diagonal=False)
    # no_mask + window (2, -1) top-left: query i sees keys >= i - 2, all rows live
    assert torch.isfinite(lse).all()
    out, lse, grads = check(q, k, v, do, window_size=(0, 0), bottom_right_diagonal=True)
    assert torch.isfinite(lse).all()


def test_padding_rows_zero_and_keys_without_grad():
    q, k, v, do, kw = make_case(dtype=F16, b=2, sq=20, skv=20, lens_q=[7, 20], lens_kv=[20, 3])
    out, lse, (dq, dk, dv) = check(q, k, v, do, attn_mask_type="padding", **kw)
    assert torch.equal(out[0, 7:], torch.zeros_like(out[0, 7:]))
    assert torch.isneginf(lse[0, :, 7:]).all()
    assert not dq[0, 7:].any() and not dk[1, 3:].any() and not dv[1, 3:].any()
    # a sequence without keys: every row fully masked
    q, k, v, do, kw = make_case(b=2, sq=9, skv=12, lens_q=[9, 4], lens_kv=[0, 12], seed=8)
    out, lse, (dq, dk, dv) = check(q, k, v, do, attn_mask_type="padding_causal", **kw)
    assert not out[0].any() and torch.isneginf(lse[0]).all() and not dq[0].any()


@pytest.mark.parametrize(
    "mask,window,bottom_right,lens",
    [
        ("causal_bottom_right", (-1, -1), None, None),
        ("padding_causal", (3, -1), None, ([12, 5], [17, 9])),
        ("no_mask", (2, 4), False, None),
    ],
)
def test_second_opinion_lse(mask, window, bottom_right, lens):
    lens_q, lens_kv = lens if lens else (None, None)
    q, k, v, do, kw = make_case(sq=12, skv=17, h=2, hkv=1, dqk=8, lens_q=lens_q, lens_kv=lens_kv)
    out, lse = tf.flash_attention(
        q,
        k,
        v,
        attn_mask_type=mask,
        window_size=window,
        bottom_right_diagonal=bottom_right,
        return_lse=True,
        **kw,
    )
    br = (mask not in ("causal", "padding_causal")) if bottom_right is None else bottom_right
    want_out, want_lse = dense_lse_out(
        q, k, v, mask=mask, window=window, bottom_right=br, scale=8**-0.5,
        lens_q=lens_q, lens_kv=lens_kv,
    )  # fmt: skip
    close("out", out, want_out, F32)
    close("lse", lse, want_lse, F32)


@pytest.mark.parametrize("gqa_split", [False, True], indirect=True, ids=["loop", "split"])
@pytest.mark.parametrize("fmt,hkv", [("bshd", 1), ("thd", 2)])
def test_backward_is_bitwise_deterministic(fmt, hkv, gqa_split):
    lens = {"lens_q": [23, 31], "lens_kv": [30, 17]} if fmt == "thd" else {}
    q, k, v, do, kw = make_case(
        dtype=BF16, fmt=fmt, b=2, sq=31, skv=30, h=4, hkv=hkv, seed=9, **lens
    )
    runs = [
        run_ours(q, k, v, do, attn_mask_type="causal_bottom_right", deterministic=det, **kw)
        for det in (True, True, False)
    ]
    for other in runs[1:]:
        assert torch.equal(runs[0][0], other[0]) and torch.equal(runs[0][1], other[1])
        for a, b in zip(runs[0][2], other[2], strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# API surface
# ------------------------------------------------------------------------------------------------


def test_return_lse_false_returns_tensor_and_lse_is_not_differentiable():
    q, k, v, do, _ = make_case(b=1, sq=8, skv=8, h=1, dqk=16)
    out = tf.flash_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 8, 1, 16)
    q.requires_grad_()
    out, lse = tf.flash_attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_supported_dict_describes_the_kernel():
    s = tf.SUPPORTED
    assert s["dtypes"] == ("fp16", "bf16", "fp32") and s["max_head_dim"] == 256
    assert set(s["attn_mask_types"]) == set(MASKS)
    assert s["qkv_formats"] == ("bshd", "sbhd", "thd")
    assert s["deterministic_backward"] is True and s["dropout"] is False


def _small():
    return make_case(b=1, sq=4, skv=4, h=2, dqk=16)[:3]


@pytest.mark.parametrize(
    "change,arg",
    [
        (lambda q, k, v: {"q": q.new_zeros(1, 4, 2, 264), "k": k.new_zeros(1, 4, 2, 264)}, "head"),
        (lambda q, k, v: {"v": v.new_zeros(1, 4, 2, 257)}, "head_dim_v"),
        (
            lambda q, k, v: {
                x: t.to(torch.float8_e4m3fn) for x, t in zip("qkv", (q, k, v), strict=True)
            },
            "q.dtype",
        ),
        (lambda q, k, v: {x: t.double() for x, t in zip("qkv", (q, k, v), strict=True)}, "q.dtype"),
        (lambda q, k, v: {"k": k.half()}, "k.dtype"),
        (lambda q, k, v: {"attn_mask_type": "arbitrary"}, "attn_mask_type"),
        (lambda q, k, v: {"attn_mask_type": "causal_top_left"}, "attn_mask_type"),
        (lambda q, k, v: {"qkv_format": "bhsd"}, "qkv_format"),
        (lambda q, k, v: {"qkv_format": "thd"}, "q.shape"),
        (lambda q, k, v: {"window_size": (-2, 0)}, "window_size"),
        (lambda q, k, v: {"window_size": 5}, "window_size"),
        (
            lambda q, k, v: {"attn_mask_type": "causal", "bottom_right_diagonal": True},
            "bottom_right_diagonal",
        ),
        (lambda q, k, v: {"softmax_scale": float("nan")}, "softmax_scale"),
        (lambda q, k, v: {"k": k[:, :, :1].repeat(1, 1, 3, 1)}, "k.shape"),
        (lambda q, k, v: {"cu_seqlens_q": _cu([4]), "cu_seqlens_kv": _cu([4])}, "attn_mask_type"),
        (lambda q, k, v: {"attn_mask_type": "padding", "cu_seqlens_q": _cu([4])}, "cu_seqlens_kv"),
        (lambda q, k, v: {"cu_seqlens_q_padded": _cu([4])}, "cu_seqlens_q_padded"),
        (lambda q, k, v: {"deterministic": 1}, "deterministic"),
    ],
)
def test_unsupported_inputs_raise_value_error_naming_the_argument(change, arg):
    q, k, v = _small()
    kw = change(q, k, v)
    args = {"q": q, "k": k, "v": v}
    for name in "qkv":
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises(ValueError, match=arg):
        tf.flash_attention(args["q"], args["k"], args["v"], **kw)


def test_thd_requires_cu_seqlens():
    q = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        tf.flash_attention(q, q, q, qkv_format="thd")
    with pytest.raises(ValueError, match="max_seqlen_q"):
        tf.flash_attention(
            q, q, q, qkv_format="thd", cu_seqlens_q=_cu([8]), cu_seqlens_kv=_cu([8]),
            max_seqlen_q=-1,
        )  # fmt: skip


def test_lse_shapes_follow_the_format():
    q, k, v, do, kw = make_case(fmt="sbhd", b=2, sq=5, skv=7, h=3, hkv=1, dqk=16)
    _, lse = tf.flash_attention(q, k, v, return_lse=True, **kw)
    assert lse.shape == (2, 3, 5)
    q, k, v, do, kw = make_case(fmt="thd", b=2, lens_q=[3, 4], lens_kv=[2, 6], h=3, dqk=16)
    _, lse = tf.flash_attention(q, k, v, return_lse=True, **kw)
    assert lse.shape == (3, 7)


def test_math_constants():
    assert tf._LOG2E == pytest.approx(1 / math.log(2)) and tf._LN2 == pytest.approx(math.log(2))


def test_tile_lists_keep_small_tiles_for_fp32_and_big_head_dims():
    for kernel in ("fwd", "dq", "dkdv"):
        assert len(tf.configs(kernel, BF16, 128, 128)) > 1  # something to tune
        assert [(c.block_m, c.block_n) for c in tf.configs(kernel, F32, 128, 128)] == [(32, 32)]
        assert all(c.block_m * c.block_n <= 64 * 64 for c in tf.configs(kernel, F16, 256, 64))
        for d in (64, 128, 256):  # dropped (over the spill target) never comes back
            assert not set(tf.DROPPED.get(kernel, {}).get(d, ())) & set(
                tf.configs(kernel, BF16, d, d))

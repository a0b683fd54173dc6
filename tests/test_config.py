"""FusedAttnConfig: normalization as TE does it, validation, round trips, key stability."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from te_fl_attention.config import (
    BIAS_SHAPES,
    BIAS_TYPES,
    CP_COMM_TYPES,
    DTYPES,
    FP8_RECIPES,
    MASK_TYPES,
    QKV_LAYOUTS,
    SOFTMAX_TYPES,
    FusedAttnConfig,
    layout_formats,
    te_max_batch_size,
    te_max_tokens,
)

C = FusedAttnConfig


# ----------------------------------------------------------------------------- normalization
@pytest.mark.parametrize(
    "given_mask, mask",
    [("causal,padding", "padding_causal"), ("padding,causal", "padding_causal"),
     ("causal_padding", "padding_causal"), ("causal", "causal")],
)  # fmt: skip
def test_mask_spellings(given_mask, mask):
    assert C(attn_mask_type=given_mask).attn_mask_type == mask
    assert C(attn_mask_type=given_mask).key() == C(attn_mask_type=mask).key()


@pytest.mark.parametrize(
    "mask, window, expected",
    [
        ("causal", None, (-1, 0)),
        ("causal", (-1, -1), (-1, 0)),
        ("causal", (128, 128), (128, 0)),
        ("causal_bottom_right", (4, -1), (4, 0)),
        ("no_mask", None, (-1, -1)),
        ("no_mask", (-1, 0), (-1, -1)),
        ("padding", (4, 4), (4, 4)),
        ("arbitrary", None, (-1, -1)),
    ],
)
def test_window_normalization_mirrors_check_set_window_size(mask, window, expected):
    assert C(attn_mask_type=mask, window_size=window).window_size == expected


@pytest.mark.parametrize("mask, window", [("causal", (-2, 0)), ("causal", (-1, 3)),
                                          ("no_mask", (-1, 4)), ("padding", (3, -2))])  # fmt: skip
def test_window_invalid(mask, window):
    with pytest.raises(ValueError, match="window_size"):
        C(attn_mask_type=mask, window_size=window)


def test_bottom_right_diagonal_follows_mask():
    assert C(attn_mask_type="causal", bottom_right_diagonal=True).bottom_right_diagonal is False
    assert C(attn_mask_type="causal_bottom_right", bottom_right_diagonal=False
             ).bottom_right_diagonal is True  # fmt: skip
    # Only matters for windows and ALiBi: elsewhere it is normalized away (one key).
    assert C(bottom_right_diagonal=False).key() == C(bottom_right_diagonal=True).key()
    w = dict(window_size=(8, 8), max_seqlen_kv=256)
    assert C(bottom_right_diagonal=False, **w).bottom_right_diagonal is False
    assert C(bottom_right_diagonal=False, **w).key() != C(bottom_right_diagonal=True, **w).key()


def test_kv_cache_turns_padding_causal_bottom_right():
    c = C(qkv_layout="paged_kv_bshd_bshd_bshd", page_size=64, attn_mask_type="padding_causal")
    assert c.paged and c.kv_cache and c.attn_mask_type == "padding_causal_bottom_right"
    with pytest.raises(ValueError, match="padding"):
        C(kv_cache=True, attn_mask_type="causal")


def test_irrelevant_fields_do_not_split_the_key():
    base = C()
    assert C(cp_comm_type="a2a").key() == base.key()  # no context parallelism
    assert C(pad_between_seqs=True).key() == base.key()  # not thd
    assert C(fp8_output=True).key() == base.key()  # not fp8
    assert C(bias_requires_grad=True).key() == base.key()  # no bias tensor
    assert C(page_size=64).key() == base.key()  # not paged
    assert C(max_seqlen_kv=None).key() == C(max_seqlen_kv=128).key()
    assert C(num_gqa_groups=None).key() == C(num_gqa_groups=16).key()


def test_bias_shapes_labelled_as_te_labels_the_tensor():
    pb = dict(bias_type="post_scale_bias")
    assert C(**pb).bias_shape == "bhss"  # batch 1: a [1, h, s, s] tensor is TE's bhss
    assert C(**pb, batch_size=4).bias_shape == "1hss"
    assert C(**pb, bias_shape="bhss", batch_size=4).bias_shape == "bhss"
    assert C(**pb, bias_shape="b1ss", batch_size=4).bias_shape == "b1ss"
    assert C(**pb, bias_shape="b1ss", batch_size=4, num_heads=1).bias_shape == "bhss"
    assert C(**pb, bias_shape="111s", batch_size=4).bias_shape == "111s"
    # one head: TE reads a [1, 1, 1, skv] tensor as 1hss (so no 111s dbias refusal)
    assert C(**pb, bias_shape="111s", batch_size=4, num_heads=1).bias_shape == "1hss"
    assert C(**pb, bias_shape="111s", batch_size=4, max_seqlen_q=1).bias_shape == "11ss"
    assert C(bias_type="no_bias", bias_shape="bhss").bias_shape is None
    assert C(**pb, bias_shape="1hss").key() == C(**pb, bias_shape="bhss").key()


def test_fp8_normalization():
    assert C(fp8_recipe="current", dtype="fp8_e4m3").fp8 is True
    assert C(fp8=True).fp8_recipe == "delayed"
    with pytest.raises(ValueError, match="dtype='fp8_e4m3'"):
        C(dtype="fp8_e4m3")


def test_context_parallel_from_cp_size():
    c = C(cp_size=4, cp_comm_type="a2a")
    assert c.context_parallel and c.cp_comm_type == "a2a"


@pytest.mark.parametrize(
    "layout, fmt",
    [("sbh3d", ("sbhd", "sbhd", "sbhd")), ("bshd_bs2hd", ("bshd", "bshd", "bshd")),
     ("thd_thd_thd", ("thd", "thd", "thd"))],
)  # fmt: skip
def test_layout_formats(layout, fmt):
    assert layout_formats(layout) == fmt


def test_layout_formats_with_kv_cache():
    assert layout_formats("paged_kv_thd_bshd_bshd", kv_cache=True) == ("thd_2bshd", "thd", "bshd")
    c = C(qkv_layout="paged_kv_thd_bshd_bshd", page_size=16, attn_mask_type="padding_causal")
    assert (c.qkv_format, c.q_format, c.kv_format) == ("thd_2bshd", "thd", "bshd")


@pytest.mark.parametrize(
    "tokens, bucket",
    [(1, 1024), (1000, 1024), (1024, 1024), (1025, 2048), (4096, 4096), (5000, 8192),
     (32768, 32768), (32769, 65536), (70000, 98304)],
)  # fmt: skip
def test_te_token_bucket(tokens, bucket):
    # TE 2.20.2 utils.cu get_max_tokens: <= 1024 -> 1024, powers of two to 32768, then
    # multiples of 32768.
    assert te_max_tokens(tokens) == bucket


@pytest.mark.parametrize("batch, bucket", [(1, 32), (32, 32), (33, 64), (300, 512), (512, 512),
                                           (513, 1024), (1100, 1536)])  # fmt: skip
def test_te_batch_bucket(batch, bucket):
    assert te_max_batch_size(batch) == bucket


def test_num_tokens_bucketed_for_thd_and_dropped_otherwise():
    thd = dict(qkv_layout="thd_thd_thd", attn_mask_type="padding", batch_size=4,
               max_seqlen_q=512, max_seqlen_kv=300)  # fmt: skip
    c = C(**thd)  # default: batch * max_seqlen, bucketed
    assert (c.num_tokens_q, c.num_tokens_kv) == (2048, 2048)
    c = C(**thd, num_tokens_q=1500, num_tokens_kv=3000)
    assert (c.num_tokens_q, c.num_tokens_kv) == (2048, 4096)
    # one graph, one key: every count in a bucket normalizes alike, a new bucket splits it
    assert C(**thd, num_tokens_q=1100).key() == C(**thd, num_tokens_q=2048).key()
    assert C(**thd, num_tokens_q=2049).key() != C(**thd, num_tokens_q=2048).key()
    # q thd, kv not (TE's C++ reads kv as bshd): only the q count is kept
    c = C(qkv_layout="thd_bshd_bshd", attn_mask_type="padding", num_tokens_kv=77)
    assert (c.num_tokens_q, c.num_tokens_kv) == (1024, None)
    c = C(qkv_layout="paged_kv_thd_bshd_bshd", page_size=16, attn_mask_type="padding",
          num_tokens_q=5000)  # fmt: skip
    assert (c.num_tokens_q, c.num_tokens_kv) == (8192, None)
    assert C(num_tokens_q=5000, num_tokens_kv=9).key() == C().key()  # bshd: no token counts
    assert C(**thd, num_tokens_q=3000).to_dict()["num_tokens_q"] == 4096
    assert C.from_dict(C(**thd, num_tokens_q=3000).to_dict()) == C(**thd, num_tokens_q=4096)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_heads=12, num_gqa_groups=5),
         "num_heads=12 is not divisible by num_gqa_groups=5"),
        (dict(dtype="float16"), "dtype='float16'"),
        (dict(qkv_layout="bhsd"), "qkv_layout='bhsd'"),
        (dict(attn_mask_type="sliding"), "attn_mask_type='sliding'"),
        (dict(head_dim_qk=0), "head_dim_qk=0"),
        (dict(batch_size=True), "batch_size=True"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(dropout=-0.1), "dropout=-0.1"),
        (dict(softmax_type="sparsemax"), "softmax_type='sparsemax'"),
        (dict(bias_type="post_scale_bias", bias_shape="hbss"), "bias_shape='hbss'"),
        (dict(qkv_layout="sb3hd", num_gqa_groups=4), "packs q, k and v"),
        (dict(qkv_layout="bshd_bs2hd", head_dim_v=32), "packs k and v"),
        (dict(alibi_slopes_shape=(16,)), "only allowed with bias_type='alibi'"),
        (dict(bias_type="alibi", alibi_slopes_shape=(7,)), "alibi_slopes_shape=(7,)"),
        (dict(fp8_recipe="fp4"), "fp8_recipe='fp4'"),
        (dict(cp_comm_type="ring", cp_size=2), "cp_comm_type='ring'"),
        (dict(softmax_scale=0.0), "softmax_scale"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(num_tokens_q=-1),
         "num_tokens_q=-1 is not valid: expected an integer in [0, 2147483647]"),
        (dict(num_tokens_kv=-5, qkv_layout="thd_thd_thd", attn_mask_type="padding"),
         "num_tokens_kv=-5 is not valid: expected an integer in [0, 2147483647]"),
        (dict(num_tokens_q=True), "num_tokens_q=True"),
        (dict(num_tokens_q=12.5), "num_tokens_q=12.5"),
        (dict(num_tokens_kv="1024"), "num_tokens_kv='1024'"),
    ],
)  # fmt: skip
def test_bad_values_name_field_value_and_allowed(kw, message):
    with pytest.raises(ValueError) as err:
        C(**kw)
    assert message in str(err.value)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown config field.*heads"):
        C.from_dict({"heads": 4})


# ----------------------------------------------------------------------------- properties
def _valid_kwargs():
    @st.composite
    def build(draw):
        hg = draw(st.sampled_from([1, 2, 4, 8]))
        h = hg * draw(st.integers(1, 4))
        dqk = draw(st.sampled_from([32, 64, 72, 128, 192, 256]))
        dv = draw(st.sampled_from([dqk, 128, 64]))
        layout = draw(st.sampled_from(QKV_LAYOUTS))
        group = layout.replace("paged_kv_", "").replace("b", "").replace("s", "").replace("t", "")
        if "3" in group:
            hg, dv = h, dqk
        if "2" in group:
            dv = dqk
        paged = layout.startswith("paged_kv_") or draw(st.booleans()) and False
        kv_cache = paged or draw(st.booleans())
        mask = draw(st.sampled_from(MASK_TYPES))
        if kv_cache and "padding" not in mask:
            mask = "padding"
        left = draw(st.sampled_from([-1, 0, 16, 128]))
        right = draw(st.sampled_from([-1, 0, 16]))
        if left == -1 or right == -1:
            left = right = -1
        bias_type = draw(st.sampled_from(BIAS_TYPES))
        b = draw(st.integers(1, 8))
        alibi = None
        if bias_type == "alibi":
            alibi = draw(st.sampled_from([None, (h,), (b, h)]))
        fp8_recipe = draw(st.sampled_from(FP8_RECIPES))
        dtype = draw(st.sampled_from(DTYPES))
        if dtype.startswith("fp8") and fp8_recipe == "none":
            fp8_recipe = "delayed"
        return dict(
            batch_size=b,
            max_seqlen_q=draw(st.integers(1, 8192)),
            max_seqlen_kv=draw(st.integers(1, 8192)),
            num_heads=h, num_gqa_groups=hg, head_dim_qk=dqk, head_dim_v=dv,
            dtype=dtype, qkv_layout=layout, attn_mask_type=mask,
            window_size=draw(st.sampled_from([None, (left, right)])),
            bias_type=bias_type,
            bias_shape=draw(st.sampled_from(BIAS_SHAPES)) if bias_type != "no_bias" else None,
            alibi_slopes_shape=alibi,
            dropout=draw(st.sampled_from([0.0, 0.1, 0.5])),
            softmax_type=draw(st.sampled_from(SOFTMAX_TYPES)),
            is_training=draw(st.booleans()), deterministic=draw(st.booleans()),
            fp8_recipe=fp8_recipe,
            cp_size=draw(st.sampled_from([1, 2, 4])),
            cp_comm_type=draw(st.sampled_from(CP_COMM_TYPES)),
            pad_between_seqs=draw(st.booleans()),
            kv_cache=kv_cache, page_size=draw(st.sampled_from([16, 64, 256])) if paged else 0,
            num_splits=draw(st.sampled_from([1, 4])),
            softmax_scale=draw(st.sampled_from([None, 0.125, 0.0884])),
            num_tokens_q=draw(st.sampled_from([None, 1, 1500, 40000])),
            num_tokens_kv=draw(st.sampled_from([None, 7, 1024, 70000])),
        )  # fmt: skip

    return build()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_valid_kwargs())
def test_valid_configs_round_trip_and_keep_their_key(kw):
    try:
        c = C(**kw)
    except ValueError as exc:  # only window/mask and KV-cache/packing combinations can clash
        assert "window_size" in str(exc) or "KV cache needs separate" in str(exc)
        return
    again = C.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.key() == c.key()
    assert C.from_json(c.to_json()) == c
    assert C(**c.to_dict()) == c  # normalization is idempotent


def _json_key(c: C) -> str:
    """The key as json.dumps defines it (the reference the orjson fast path must equal)."""
    import hashlib

    return hashlib.sha256(c._canonical_json().encode()).hexdigest()


_FLOATS = st.one_of(st.sampled_from([0.0, 1e-05, 0.0001, 9.99e-05, 1e16, 9999999999999998.0,
                                     1e30, 0.5, 0.125]),
                    st.floats(0.0, 1e30, exclude_min=True), st.floats(1e-12, 1e-3))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_valid_kwargs(), _FLOATS, _FLOATS, st.floats(0.0, 0.999))
def test_fast_key_equals_the_json_key(kw, scale, softcap, dropout):
    """``key()``'s orjson path hashes exactly json.dumps' bytes (floats with an exponent, which
    the two write differently, fall back to json)."""
    from te_fl_attention.config import _fast_canonical

    kw = {**kw, "softmax_scale": scale, "softcap": softcap, "dropout": dropout}
    try:
        c = C(**kw)
    except ValueError:
        return
    fast = _fast_canonical(c)
    assert fast is None or fast == c._canonical_json().encode()
    if all("e" not in repr(v) for v in (c.softmax_scale or 0.0, c.softcap, c.dropout)):
        assert fast is not None  # the fast path is taken for ordinary configs
    assert c.key() == _json_key(c) == _json_key(C(**c.to_dict()))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([f for f in C.__dataclass_fields__]),
       st.one_of(st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(-(2**70), 2**70), st.tuples(st.integers(-(2**70), 2**70)),
                 st.tuples(st.floats(allow_nan=False)), st.booleans(), st.none()))
def test_fast_key_never_differs_even_off_validation(name, value):
    """A field holding what validation would refuse (non-ASCII or control characters, DEL,
    NaN, huge ints, tuples of floats): the fast path falls back or writes json's bytes."""
    import math

    from te_fl_attention.config import _fast_canonical

    c = C()
    object.__setattr__(c, name, value)
    fast = _fast_canonical(c)
    if isinstance(value, float) and not math.isfinite(value):
        assert fast is None
        return
    if isinstance(value, tuple) and any(isinstance(x, float) and not math.isfinite(x)
                                        for x in value):  # fmt: skip
        assert fast is None
        return
    assert fast is None or fast == c._canonical_json().encode()


def test_fast_key_fallbacks():
    from te_fl_attention.config import _fast_canonical

    for name, value in (("dtype", "bf16\u00e9"), ("dtype", "a\x7f"), ("dtype", 'a"b'),
                        ("dtype", "a\\b"), ("dtype", "a\nb"), ("dropout", 1e-05),
                        ("softcap", 1e16), ("batch_size", 2**64), ("window_size", (1.5, 2))):
        c = C()
        object.__setattr__(c, name, value)
        fast = _fast_canonical(c)
        assert fast is None or fast == c._canonical_json().encode(), (name, value)
    assert _fast_canonical(C()) == C()._canonical_json().encode()


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=True),
                 st.text(max_size=12), st.lists(st.integers(-3, 300), max_size=3))  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from([f for f in C.__dataclass_fields__]), _ANY, max_size=6))
def test_arbitrary_input_raises_only_value_error(kw):
    try:
        c = C.from_dict(kw)
    except ValueError:
        return
    assert C.from_dict(c.to_dict()) == c


def test_key_is_stable_across_processes():
    c = C(num_heads=32, num_gqa_groups=8, head_dim_qk=128, attn_mask_type="causal",
          window_size=(128, 0), dropout=0.1, softmax_scale=0.088)  # fmt: skip
    code = (
        "from te_fl_attention.config import FusedAttnConfig as C;"
        "print(C(num_heads=32, num_gqa_groups=8, head_dim_qk=128, attn_mask_type='causal',"
        "window_size=(128, 0), dropout=0.1, softmax_scale=0.088).key())"
    )
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True).stdout.strip()
            for seed in ("0", "1", "random")}  # fmt: skip
    assert keys == {c.key()}


def test_from_attention_params_te_2_20_fields():
    recipe = type("DelayedScaling", (), {"fp8_dpa": True, "fp8_mha": False})()
    params = SimpleNamespace(
        qkv_dtype="torch.float8_e4m3fn", qkv_layout="bshd_bshd_bshd", batch_size=2,
        num_heads=16, num_gqa_groups=4, max_seqlen_q=256, max_seqlen_kv=512, head_dim_qk=128,
        head_dim_v=128, attn_mask_type="causal_bottom_right", window_size=(-1, 0),
        core_attention_bias_type="post_scale_bias", core_attention_bias_shape=(2, 16, 256, 512),
        core_attention_bias_requires_grad=True, fp8=True, fp8_meta={"recipe": recipe},
        softmax_scale=1.0, inference_params=None, softcap=0.0,
    )  # fmt: skip
    c = C.from_attention_params(params)
    assert (c.dtype, c.fp8, c.fp8_recipe) == ("fp8_e4m3", True, "delayed")
    assert c.bias_shape == "bhss" and c.bias_requires_grad
    assert c.softmax_scale is None  # TE's 1.0 default means "not given"


def test_from_attention_params_reads_te_token_counts():
    base = dict(qkv_dtype="torch.bfloat16", qkv_layout="thd_thd_thd", batch_size=3,
                max_seqlen_q=256, max_seqlen_kv=256, attn_mask_type="padding_causal")
    c = C.from_attention_params(SimpleNamespace(**base, num_tokens_q=700, num_tokens_kv=5000))
    assert (c.num_tokens_q, c.num_tokens_kv) == (1024, 8192)
    # a thd tensor with a token count of 0 stays 0 (TE's C++ refuses it: fused_cpp.thd_num_tokens)
    c = C.from_attention_params(SimpleNamespace(**base, num_tokens_q=0, num_tokens_kv=0))
    assert (c.num_tokens_q, c.num_tokens_kv) == (0, 0)
    # TE < 2.20 has no such field: the default count
    assert C.from_attention_params(SimpleNamespace(**base)).num_tokens_q == 1024
    c = C.from_attention_params(SimpleNamespace(**{**base, "qkv_layout": "bshd_bshd_bshd"},
                                                num_tokens_q=0, num_tokens_kv=0))  # fmt: skip
    assert (c.num_tokens_q, c.num_tokens_kv) == (None, None)


def test_from_attention_params_older_te_missing_fields():
    params = SimpleNamespace(qkv_dtype="torch.bfloat16", qkv_layout="sbh3d",
                             core_attention_bias_type="post_scale_bias",
                             core_attention_bias_shape="b1ss", batch_size=4)  # fmt: skip
    c = C.from_attention_params(params)
    assert c.qkv_layout == "sbh3d" and c.bias_shape == "b1ss" and c.num_heads == 16
    assert c.window_size == (-1, -1) and c.softcap == 0.0


def test_from_attention_params_kv_cache():
    inf = SimpleNamespace(is_paged=True, page_size=256)
    c = C.from_attention_params(SimpleNamespace(
        qkv_layout="paged_kv_bshd_bshd_bshd", attn_mask_type="padding_causal",
        inference_params=inf))  # fmt: skip
    assert c.kv_cache and c.paged and c.page_size == 256


def test_from_tensors_bshd_and_thd():
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 96, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(2, 96, 2, 64, dtype=torch.bfloat16)
    c = C.from_tensors(q, k, v, attn_mask_type="causal_bottom_right")
    assert (c.batch_size, c.max_seqlen_q, c.max_seqlen_kv) == (2, 64, 96)
    assert (c.num_heads, c.num_gqa_groups, c.head_dim_qk, c.head_dim_v) == (8, 2, 128, 64)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    t = torch.zeros(20, 4, 64, dtype=torch.float16)
    c = C.from_tensors(t, t, t, qkv_format="thd", cu_seqlens_q=cu)
    assert (c.batch_size, c.max_seqlen_q, c.qkv_format, c.dtype) == (3, 8, "thd", "fp16")
    assert c.attn_mask_type == "padding"
    # TE's num_tokens_q/kv are q.shape[0] / k.shape[0]; 20 and 2000 tokens fall in 1024, 2048
    k = torch.zeros(2000, 4, 64, dtype=torch.float16)
    c = C.from_tensors(t, k, k, qkv_format="thd", cu_seqlens_q=cu,
                       cu_seqlens_kv=torch.tensor([0, 700, 1400, 2000], dtype=torch.int32))
    assert (c.num_tokens_q, c.num_tokens_kv, c.max_seqlen_kv) == (1024, 2048, 700)


# ----------------------------------------------------------------- issue 12: input validation
from te_fl_attention import config as _config  # noqa: E402
from te_fl_attention import device as _device  # noqa: E402

# Issue 12's names are looked up inside the tests, so each test fails on its own on older code.
RANGES = getattr(_config, "RANGES", {"batch_size": (1, 2**31 - 1, ""),
                                     "max_seqlen_q": (1, 2**31 - 1, ""),
                                     "max_seqlen_kv": (1, 2**31 - 1, ""),
                                     "num_heads": (1, 2**16, ""), "head_dim_qk": (1, 1024, ""),
                                     "head_dim_v": (1, 1024, ""), "cp_size": (1, 2**16, ""),
                                     "num_splits": (1, 2**16, "")})  # fmt: skip


def parse_json_object(text, what):
    return _config.parse_json_object(text, what)


def ranges_table():
    return _config.ranges_table()


class _Switches:
    def __getattr__(self, name):
        import importlib

        return getattr(importlib.import_module("te_fl_attention.switches"), name)


_switches = _Switches()


@pytest.mark.parametrize("name", ["batch_size", "max_seqlen_q", "max_seqlen_kv", "num_heads",
                                  "head_dim_qk", "head_dim_v", "cp_size", "num_splits"])
def test_every_numeric_field_has_a_range_named_in_the_error(name):
    lo, hi, _ = RANGES[name]
    for bad in (hi + 1, 10**20, lo - 1):
        kw = {name: bad}
        if name == "num_heads":
            kw["num_gqa_groups"] = 1
        with pytest.raises(ValueError) as err:
            FusedAttnConfig(**kw)
        text = str(err.value)
        assert name in text and str(bad)[:15] in text and f"[{lo}, {hi}]" in text


def test_ranges_table_lists_every_field():
    table = ranges_table()
    assert all(f"`{name}`" in table for name in RANGES)
    assert "2147483647" in table and "65536" in table and "1024" in table


@pytest.mark.parametrize("text, what", [
    ("null", "null"), ("42", "a number"), ("[1,2]", "an array"), ('"ab"', "a string"),
    ('[["num_heads",8]]', "an array"), ("true", "a boolean")])
def test_config_must_be_a_json_object(text, what):
    with pytest.raises(ValueError, match=f"must hold a JSON object.*not {what}"):
        parse_json_object(text, "--config c.json")


@pytest.mark.parametrize("text, why", [
    ("[" * 100_000 + "]" * 100_000, "nested more than"),
    ('{"a":' * 40 + "1" + "}" * 40, "nested more than"),
    ('{"dropout": NaN}', "strict JSON"), ('{"softcap": Infinity}', "strict JSON"),
    ('{"num_heads": 8, "num_heads": 16}', "appears twice"), ("{", "not valid JSON")],
    ids=["deep-array", "deep-object", "nan", "infinity", "duplicate", "truncated"])
def test_config_json_is_strict_and_depth_limited(text, why):
    with pytest.raises(ValueError, match=why):
        parse_json_object(text, "--config c.json")


def test_names_are_case_insensitive():
    c = FusedAttnConfig(dtype="BF16", qkv_layout="BSHD_BSHD_BSHD", attn_mask_type="Causal")
    assert (c.dtype, c.qkv_layout, c.attn_mask_type) == ("bf16", "bshd_bshd_bshd", "causal")
    assert _device.profile("H100:CUDNN=9.10.2,FA4=4.0.0").flash_attn_4 == "4.0.0"
    from te_fl_attention.policy import canonical
    from te_fl_attention.presets import preset

    assert canonical("FA3") == "fa3" and canonical("FusedAttention") == "fused"
    assert preset("LLAMA3-8B")["num_heads"] == 32


@pytest.mark.parametrize("spec, field", [
    ("h100:cudnn=banana", "cudnn"), ("h100:sm=-5", "sm"), ("h100:sm=91", "sm"),
    ("h100:sm_count=-1", "sm_count"), ("h100:sm_count=0", "sm_count"),
    ("h100:memory_gib=-3", "memory_gib"), ("h100:memory_gib=nan", "memory_gib"),
    ("h100:flash_attn_4=", "flash_attn_4"), ("h100:bogus=1", "bogus"),
    ("h100:cudnn=9.10.2,cudnn=9.1.0", "cudnn"), (":cudnn=9.10.2", "device"),
    ("h100:sm=١٠٠", "sm")])
def test_device_overrides_are_parsed_and_range_checked(spec, field):
    with pytest.raises(ValueError) as err:
        _device.profile(spec)
    assert field in str(err.value)


def test_device_overrides_accepted():
    d = _device.profile("h100:sm=100,sm_count=148,memory_gib=180,fa3=none,te=2.20.2")
    assert (d.sm, d.sm_count, d.memory_gib, d.flash_attn_3) == (100, 148, 180.0, None)


@pytest.mark.parametrize("raw", ["2", "-1", "1 ", " 0", "false", "true", "maybe", "", "١",
                                 "\x1b[0m", "01"])
def test_our_switches_accept_exactly_0_or_1(raw):
    for var in ("TE_FL_ATTN_TRITON", "TE_FL_ATTN_VERIFY", "TE_FL_ATTN_MEASURE",
                "TE_FL_ATTN_CUDNN_PROBE", "TE_FL_ATTN_CACHE_READONLY", "TE_FL_ATTN_SEED_ENV"):
        with pytest.raises(ValueError) as err:
            _switches.switch(var, {var: raw})
        assert var in str(err.value) and "exactly 0 or 1" in str(err.value)
        assert "\x1b" not in str(err.value)
    assert _switches.switch("TE_FL_ATTN_VERIFY", {"TE_FL_ATTN_VERIFY": "1"}) is True
    assert _switches.switch("TE_FL_ATTN_CUDNN_PROBE", {}) is True


@pytest.mark.parametrize("raw, on", [("1", True), ("0", False), (" 1", True), ("2", True),
                                     ("-1", True), ("00", False), ("١", True)])
def test_nvte_switches_parse_as_te_parses_them(raw, on):
    # TE 2.20.2 utils.py: int(os.environ.get("NVTE_FLASH_ATTN", "1")), truthy when non-zero.
    assert _switches.nvte_int("NVTE_FLASH_ATTN", {"NVTE_FLASH_ATTN": raw}) is on
    assert _switches.nvte_int("NVTE_FLASH_ATTN", {"NVTE_FLASH_ATTN": raw}) is bool(int(raw))


@pytest.mark.parametrize("raw", ["abc", "", "1.0", "true"])
def test_nvte_switches_te_cannot_read_raise(raw):
    with pytest.raises(ValueError) as err:
        int(raw)  # what TE does
    with pytest.raises(ValueError, match="NVTE_FUSED_ATTN=.*TransformerEngine 2.20.2"):
        _switches.nvte_int("NVTE_FUSED_ATTN", {"NVTE_FUSED_ATTN": raw})
    assert err.value


def test_readme_lists_the_ranges_and_env_rules():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert ranges_table() in text  # regenerate the table from config.ranges_table()
    assert "exactly as TE 2.20.2 parses them" in text and "exactly the ASCII strings `0` and `1`" \
        in text

"""The one runner (kernels/run.py): parity of the reference and our Triton kernel (interpreter),
feature refusals, where backends can run, and the flash-attn / SDPA adapters on CPU (flash-attn
faked by the reference; SDPA with its math backend instead of cuDNN)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.kernels import reference
from te_fl_attention.kernels import run as runner
from te_fl_attention.verify import build, error, small_shape

# Before triton is imported (collection time), without exporting TRITON_INTERPRET.
INTERP = not torch.cuda.is_available() and runner.use_interpreter()
needs_interpreter = pytest.mark.skipif(not INTERP, reason="needs the Triton interpreter")
LOCAL = profile("local")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")


def problem(seed=0, **kw):
    config = FusedAttnConfig(**{"num_heads": 4, "num_gqa_groups": 2, "head_dim_qk": 32,
                                "max_seqlen_q": 24, "dtype": "fp32", **kw})  # fmt: skip
    return build(config, small_shape(config), seed=seed)


PARITY = [
    {},
    {"attn_mask_type": "causal"},
    {"attn_mask_type": "causal_bottom_right", "max_seqlen_kv": 40},
    {"attn_mask_type": "padding_causal", "qkv_layout": "thd_thd_thd", "pad_between_seqs": True},
    {"attn_mask_type": "padding", "qkv_layout": "sbhd_sbhd_sbhd", "max_seqlen_kv": 30},
    {"window_size": (5, 3), "head_dim_v": 16},
    {"num_gqa_groups": 1, "attn_mask_type": "causal", "window_size": (4, 0), "dtype": "bf16"},
]


@needs_interpreter
@pytest.mark.parametrize("kw", PARITY, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "plain")  # fmt: skip
def test_reference_and_triton_agree(kw):
    p = problem(**kw)
    feats = {**p.features, "return_lse": True}
    want, want_lse = runner.run("reference", p.q, p.k, p.v, **feats)
    got, got_lse = runner.run("triton", p.q, p.k, p.v, **feats)
    tol = 2e-2 if p.q.dtype == torch.bfloat16 else 1e-5
    assert got.shape == want.shape and error(got, want) < tol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    assert error(got_lse[finite], want_lse[finite]) < tol


def test_unfused_is_the_reference_and_ignores_hints():
    p = problem(attn_mask_type="causal")
    out = runner.run("unfused", p.q, p.k, p.v, **p.features)
    feats = {k: v for k, v in p.features.items() if k not in runner.HINTS}
    assert torch.equal(out, reference.attention(p.q, p.k, p.v, **feats))
    assert torch.equal(out, runner.run("reference", p.q, p.k, p.v, **p.features))


@pytest.mark.parametrize("backend, feats, named", [
    ("triton", {"bias_type": "post_scale_bias", "bias": torch.zeros(1, 1, 4, 4)}, "bias_type"),
    ("triton", {"dropout_p": 0.1}, "dropout_p"),
    ("triton", {"softmax_type": "off-by-one"}, "softmax_type"),
    ("fa3", {"bias_type": "alibi"}, "bias_type"),
    ("fa4", {"dropout_p": 0.1}, "dropout_p"),
    ("fa2", {"softmax_type": "learnable", "softmax_offset": torch.zeros(2)}, "softmax_type"),
    ("fused", {"qkv_format": "thd"}, "qkv_format"),
    ("fused", {"window_size": (4, 4)}, "window_size"),
    ("fused", {"return_lse": True}, "return_lse"),
])  # fmt: skip
def test_unsupported_feature_names_it(backend, feats, named):
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(runner.Unsupported, match=named):
        runner.run(backend, q, q, q, **feats)


def test_unknown_backend_and_feature():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="not known"):
        runner.run("xformers", q, q, q)
    with pytest.raises(ValueError, match="unknown feature.*causal"):
        runner.run("unfused", q, q, q, causal=True)


def test_missing_flash_attn_is_a_clear_runtime_error(monkeypatch):
    def broken(name, *a):
        raise ImportError("libflash_attn_2_cuda.so: cannot open shared object file")

    monkeypatch.setattr(runner.importlib, "import_module", broken)
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fa2 \\(flash-attn\\) cannot be imported.*shared obj"):
        runner.run("fa2", q, q, q)
    with pytest.raises(RuntimeError, match="no flash-attn flavour can be imported"):
        runner.run("flash", q, q, q)


@CPU_ONLY
def test_can_run_here_on_cpu(monkeypatch):
    c = FusedAttnConfig()
    assert runner.can_run_here("unfused", c, LOCAL) == (True, "the torch reference runs on any "
                                                               "device")  # fmt: skip
    ok, why = runner.can_run_here("triton", c, LOCAL, interpret=False)
    assert not ok and why == "no GPU; set TRITON_INTERPRET=1 to run the kernel on CPU (slow)"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runner.can_run_here("triton", c, LOCAL)[0]  # interpret=None reads the env
    assert runner.can_run_here("triton", c, LOCAL, interpret=True)[0] == INTERP
    for name in ("fa2", "fa4", "flash", "fused"):
        ok, why = runner.can_run_here(name, c, LOCAL)
        assert not ok and "CUDA GPU" in why
    ok, why = runner.can_run_here("unfused", c, profile("h100"))
    assert not ok and "what-if" in why
    ok, why = runner.can_run_here("unfused", FusedAttnConfig(fp8=True), LOCAL)
    assert not ok and "FP8" in why
    monkeypatch.setattr(runner, "interpreter_ready", lambda: False)
    ok, why = runner.can_run_here("triton", c, LOCAL, interpret=True)
    assert not ok and "before Python starts" in why


# -------------------------------------------------------------- flash-attn adapter, faked on CPU
def _fake_attention(q, k, v, causal, window, scale, slopes=None):
    """flash-attn semantics on one sequence ([1, s, h, d]): bottom-right masks, ALiBi."""
    left, right = (-1 if w is None else w for w in window)
    mask = "causal_bottom_right" if causal else "no_mask"
    feats = dict(attn_mask_type=mask, window_size=(left, 0 if causal else right),
                 softmax_scale=scale, return_lse=True)  # fmt: skip
    if slopes is not None:
        feats.update(bias_type="alibi", alibi_slopes=slopes)
    out, lse = reference.attention(q.float(), k.float(), v.float(), **feats)
    return out.to(q.dtype), lse


def fake_flash(flavour):
    """A module with flash-attn's two entry points, computing with the reference."""

    def dense(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
              dropout_p=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
        assert dropout_p == 0.0
        assert (None in window_size) == (flavour == "fa4" and window_size == (None, None))
        return _fake_attention(q, k, v, causal, window_size, softmax_scale, alibi_slopes)

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
               dropout_p=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
        assert cu_seqlens_q.dtype == torch.int32
        outs, lses = [], []
        for i in range(cu_seqlens_q.numel() - 1):
            sq = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
            sk = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
            o, lse = _fake_attention(q[None, sq], k[None, sk], v[None, sk], causal, window_size,
                                     softmax_scale, alibi_slopes)  # fmt: skip
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    return types.SimpleNamespace(flash_attn_func=dense, flash_attn_varlen_func=varlen)


FLASH_CASES = [
    ("fa2", {"attn_mask_type": "causal"}),
    ("fa2", {"bias_type": "alibi", "attn_mask_type": "causal_bottom_right", "max_seqlen_kv": 40}),
    ("fa3", {"attn_mask_type": "padding_causal", "qkv_layout": "thd_thd_thd",
             "pad_between_seqs": True}),
    ("fa4", {"attn_mask_type": "padding", "qkv_layout": "sbhd_sbhd_sbhd", "max_seqlen_kv": 30}),
    ("fa4", {"window_size": (6, 2)}),
]  # fmt: skip


@pytest.mark.parametrize("flavour, kw", FLASH_CASES, ids=lambda x: str(x))
def test_flash_adapter_matches_reference_with_a_fake_flash_attn(monkeypatch, flavour, kw):
    """Packing, unpacking, layout and mask translation of the flash-attn adapter (the real
    kernels never ran on a GPU here)."""
    monkeypatch.setattr(runner, "_flash_module", fake_flash)
    p = problem(dtype="bf16", **kw)
    feats = {**p.features, "return_lse": True}
    want, want_lse = runner.run("reference", p.q, p.k, p.v, **feats)
    got, got_lse = runner.run(flavour, p.q, p.k, p.v, **feats)
    assert got.shape == want.shape and error(got, want) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    assert error(got_lse[finite], want_lse[finite]) < 2e-2


def test_flash_adapter_refuses_top_left_cross_attention():
    p = problem(dtype="bf16", attn_mask_type="causal", max_seqlen_kv=40)
    with pytest.raises(runner.Unsupported, match="bottom_right_diagonal=False"):
        runner.run("fa2", p.q, p.k, p.v, **p.features)


# ------------------------------------------------------------------------ SDPA adapter on CPU
@pytest.mark.parametrize("kw", [
    {"attn_mask_type": "causal"},
    {"attn_mask_type": "causal_bottom_right", "max_seqlen_kv": 40},
    {"bias_type": "post_scale_bias", "bias_shape": "1hss", "attn_mask_type": "causal"},
    {"bias_type": "pre_scale_bias", "bias_shape": "b1ss"},
    {"bias_type": "alibi", "max_seqlen_kv": 40},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))  # fmt: skip
def test_fused_adapter_matches_reference_with_sdpa_math(monkeypatch, kw):
    """Mask / bias / ALiBi / GQA translation of the ``fused`` adapter, with SDPA's math backend
    standing in for cuDNN (which needs a GPU)."""
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a: contextlib.nullcontext())
    p = problem(**kw)
    want = runner.run("reference", p.q, p.k, p.v, **p.features)
    got = runner.run("fused", p.q, p.k, p.v, **p.features)
    assert error(got, want) < 1e-5

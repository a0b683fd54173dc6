"""The one runner (kernels/run.py): parity of the reference and our Triton kernel (interpreter),
feature refusals, where backends can run, and the flash-attn / SDPA adapters on CPU (flash-attn
faked by the reference; SDPA with its math backend instead of cuDNN)."""

from __future__ import annotations

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
    ("fa2", {"bias_type": "post_scale_bias"}, "bias_type='post_scale_bias'"),
])  # fmt: skip
def test_unsupported_feature_names_it(backend, feats, named):
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(runner.Unsupported, match=named):
        runner.run(backend, q, q, q, **feats)


@pytest.mark.parametrize("flavour", ["fa2", "fa3", "fa4"])
def test_flash_attn_takes_fp16_and_bf16_only(flavour):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(runner.Unsupported, match="dtype=torch.float32 \\(fp16/bf16 only\\)"):
        runner.run(flavour, q, q, q)


def test_a_flash_attn_without_lse_is_a_clear_error(monkeypatch):
    module = types.SimpleNamespace(flash_attn_func=lambda q, k, v, **kw: q,
                                   flash_attn_varlen_func=None)  # fmt: skip
    monkeypatch.setattr(runner, "_flash_module", lambda flavour: module)
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fa3 returned no lse"):
        runner.run("fa3", q, q, q, return_lse=True)


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


# ------------------------------------------------------------------- FA2's MLA padding (defect 5)
MLA = {"qkv_layout": "sbhd_sbhd_sbhd", "attn_mask_type": "causal", "head_dim_qk": 192,
       "head_dim_v": 128, "num_heads": 2, "num_gqa_groups": 2, "dtype": "bf16"}  # fmt: skip


@pytest.mark.parametrize("dims", [(192, 128), (64, 128)], ids=["qk>v", "qk<v"])
def test_fa2_pads_head_dims_as_te_and_trims_the_output(fake_gpu, fake_flash, dims):
    """flash-attn 2 wants v's head size equal to q's (the double enforces flash_api.cpp's
    check): the runner pads q/k/v to max(d_qk, d_v) as TE does, trims out, keeps lse, and the
    gradients flow back through the padding."""
    p = problem(**{**MLA, "head_dim_qk": dims[0], "head_dim_v": dims[1]})
    feats = {**p.features, "return_lse": True}
    q, k, v = p.inputs(grad=True)
    got, got_lse = runner.run("fa2", q, k, v, **feats)
    qr, kr, vr = p.inputs(grad=True, dtype=torch.float64)
    want, want_lse = runner.run("reference", qr, kr, vr, **feats)
    assert got.shape == want.shape and got.shape[-1] == dims[1]
    assert error(got, want) < 2e-2 and error(got_lse, want_lse) < 2e-2
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    got.backward(grad.to(got.dtype))
    want.backward(grad.double())
    for mine, ref in ((q, qr), (k, kr), (v, vr)):
        assert mine.grad.shape == ref.grad.shape and error(mine.grad, ref.grad) < 5e-2
    (entry, shapes), = fake_flash
    d = max(dims)
    assert entry == "flash_attn_func" and shapes["q"][-1] == shapes["v"][-1] == d


def test_fa2_without_padding_is_what_flash_attn_refuses(fake_gpu, fake_flash):
    """The double is strict: unpadded MLA inputs are refused as flash_api.cpp refuses them."""
    from flash_attn import flash_attn_func

    p = problem(**MLA)
    q, k, v = (x.transpose(0, 1) for x in (p.q, p.k, p.v))
    with pytest.raises(RuntimeError, match="value must have shape"):
        flash_attn_func(q, k, v, causal=True)


# ------------------------------------------------- SDPA's cuDNN backend, on a fake GPU (defect 6)
class CudnnSDPA:
    """Stands for torch SDPA on a GPU with only the cuDNN backend enabled: refuses like
    sdp_utils.cpp's cuDNN gates ("No available kernel"), else computes SDPA's math on CPU."""

    def __init__(self) -> None:
        self.calls = 0
        self.refuse: str | None = None  # a gate the runner does not mirror, for the test
        self.fault: str | None = None  # a kernel error that is not a refusal

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):  # fmt: skip
        self.calls += 1
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        dqk, dv = q.shape[-1], v.shape[-1]
        gates = [dropout_p * 16 != int(dropout_p * 16), k.shape[2] == 1,
                 grad and not ((dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128),
                                                                            (256, 256))),
                 q.dtype not in (torch.float16, torch.bfloat16), self.refuse is not None]
        if any(gates):
            raise RuntimeError("No available kernel. Aborting execution.")
        if self.fault:
            raise RuntimeError(self.fault)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


REAL_SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.fixture
def cudnn_sdpa(fake_gpu, monkeypatch):
    double = CudnnSDPA()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", double)
    return double


@pytest.mark.parametrize("kw", [
    {"attn_mask_type": "causal"},
    {"attn_mask_type": "causal_bottom_right", "max_seqlen_kv": 40},
    {"bias_type": "post_scale_bias", "bias_shape": "1hss", "attn_mask_type": "causal"},
    {"bias_type": "pre_scale_bias", "bias_shape": "b1ss"},
    {"bias_type": "alibi", "max_seqlen_kv": 40},
    {"qkv_layout": "sbhd_sbhd_sbhd", "attn_mask_type": "causal", "head_dim_v": 16},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))  # fmt: skip
def test_fused_adapter_matches_reference_on_a_fake_gpu(cudnn_sdpa, kw):
    """Mask / bias / ALiBi / GQA / sbhd translation of the ``fused`` adapter; only the final
    SDPA call is replaced (by SDPA's math on CPU behind cuDNN's gates)."""
    p = problem(dtype="bf16", **kw)
    want = runner.run("reference", *p.inputs(dtype=torch.float64), **p.features)
    got = runner.run("fused", p.q, p.k, p.v, **p.features)
    assert cudnn_sdpa.calls == 1 and got.shape == want.shape and error(got, want) < 2e-2


@pytest.mark.parametrize("kw, grad, named", [
    ({"dropout": 0.1}, False, "dropout_p=0.1"),
    ({"max_seqlen_q": 16, "max_seqlen_kv": 1}, False, "s_kv=1"),
    ({"head_dim_qk": 160, "head_dim_v": 128}, True, r"backward with head dims \(160, 128\)"),
    ({"head_dim_qk": 136}, True, r"backward with head dims \(136, 136\)"),
    ({"dtype": "fp32"}, False, "fp16/bf16"),
    ({"head_dim_qk": 264}, False, "at most 256"),
], ids=["dropout", "skv1", "mla-bwd", "bwd-d136", "fp32", "d264"])  # fmt: skip
def test_fused_refuses_what_cudnn_sdpa_cannot_run_before_calling_it(cudnn_sdpa, kw, grad, named):
    """torch's cuDNN gates (sdp_utils.cpp) raise Unsupported before SDPA is called."""
    p = problem(**{"dtype": "bf16", **kw})
    q, k, v = p.inputs(grad=grad)
    with pytest.raises(runner.Unsupported, match=named):
        runner.run("fused", q, k, v, **p.features)
    assert cudnn_sdpa.calls == 0


@pytest.mark.parametrize("kw", [{"dropout": 0.125}, {"head_dim_qk": 192, "head_dim_v": 128},
                                {"head_dim_qk": 160, "head_dim_v": 128}],
                         ids=["dropout-2/16", "mla-192-128-bwd", "mla-160-128-fwd"])
def test_fused_runs_what_cudnn_sdpa_takes(cudnn_sdpa, kw):
    p = problem(**{"dtype": "bf16", "attn_mask_type": "no_mask", **kw})
    grad = kw.get("head_dim_qk") == 192
    q, k, v = p.inputs(grad=grad)
    out = runner.run("fused", q, k, v, **p.features)
    if grad:
        out.sum().backward()
    assert cudnn_sdpa.calls == 1 and out.shape[-1] == p.v.shape[-1]


def test_fused_sdpa_refusal_is_unsupported(cudnn_sdpa):
    """A gate we do not mirror: SDPA's own "No available kernel" also means "cannot express"."""
    cudnn_sdpa.refuse = "a gate the runner does not know"
    p = problem(dtype="bf16")
    with pytest.raises(runner.Unsupported, match="refused the inputs: No available kernel"):
        runner.run("fused", p.q, p.k, p.v, **p.features)
    assert cudnn_sdpa.calls == 1


@pytest.mark.parametrize("fake_gpu, named", [("a100", "at most 128 on sm80"),
                                              ("t4", r"sm75 \(cuDNN SDPA runs on sm80..sm121\)")],
                         indirect=["fake_gpu"])  # fmt: skip
def test_fused_gates_follow_the_device(cudnn_sdpa, named):
    """On sm80 cuDNN SDPA takes head dims up to 128 only (192 and 256 need sm90/sm10x); below
    sm80 nothing."""
    p = problem(dtype="bf16", head_dim_qk=192, head_dim_v=128)
    with pytest.raises(runner.Unsupported, match=named):
        runner.run("fused", p.q, p.k, p.v, **p.features)


def test_fused_dropout_needs_a_cudnn_torch_allows_it_on(cudnn_sdpa, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91200)
    p = problem(dtype="bf16", dropout=0.125)
    with pytest.raises(runner.Unsupported, match="dropout with cuDNN 91200"):
        runner.run("fused", p.q, p.k, p.v, **p.features)


def test_fused_kernel_errors_are_errors_not_refusals(cudnn_sdpa):
    cudnn_sdpa.fault = "CUDA error: an illegal memory access was encountered"
    p = problem(dtype="bf16")
    with pytest.raises(RuntimeError, match="illegal memory access") as err:
        runner.run("fused", p.q, p.k, p.v, **p.features)
    assert not isinstance(err.value, runner.Unsupported)


# ------------------------------------------------------------ preparation and launch (defect 10)
def test_prepare_separates_host_work_from_the_launch(fake_gpu, fake_flash):
    p = problem(dtype="bf16", attn_mask_type="padding", max_seqlen_kv=30)
    launch = runner.prepare("fa2", p.q, p.k, p.v, **p.features)
    assert fake_flash == []  # preparing launches nothing
    raw = launch.launch()
    assert [c[0] for c in fake_flash] == ["flash_attn_varlen_func"]
    assert raw.shape[0] == launch.args[0].shape[0]  # packed tokens, as the kernel returns them
    want = runner.run("reference", p.q, p.k, p.v, **p.features)
    assert error(launch.finish(raw), want) < 2e-2
    assert error(runner.run("fa2", p.q, p.k, p.v, **p.features), want) < 2e-2


def test_a_plain_kernel_in_runners_is_its_own_launch(monkeypatch):
    seen = []

    def kernel(q, k, v, f):
        seen.append(f["attn_mask_type"])
        return q

    monkeypatch.setitem(runner.RUNNERS, "unfused", kernel)
    q = torch.randn(1, 4, 2, 16)
    launch = runner.prepare("unfused", q, q, q, attn_mask_type="causal")
    assert seen == [] and launch() is q and seen == ["causal"]


# ------------------------------------------------------------- where things run, on a fake GPU
def test_can_run_here_on_a_gpu(fake_gpu, fake_flash):
    c = FusedAttnConfig()
    local = profile("local")
    assert runner.can_run_here("triton", c, local) == (True, "Triton on the local CUDA GPU")
    assert runner.can_run_here("fa2", c, local) == (True, "fa2 imports")
    assert runner.can_run_here("flash", c, local) == (True, "fa2 imports")
    ok, why = runner.can_run_here("fa3", c, local)
    assert not ok and "fa3 (flash-attn-3) cannot be imported" in why
    assert runner.can_run_here("fused", c, local) == (True, "torch SDPA with the cuDNN backend")


def test_nothing_runs_while_a_cuda_graph_is_captured(fake_gpu):
    from te_fl_attention import problems

    fake_gpu.capturing = True
    assert runner.busy() == "a CUDA graph is being captured"
    ok, why = runner.can_run_here("unfused", FusedAttnConfig(), profile("local"))
    assert not ok and "captured" in why
    note, exc = problems.tiny_run("unfused", FusedAttnConfig())
    assert exc is None and note == "tiny run skipped: a CUDA graph is being captured"
    fake_gpu.capturing = False
    assert runner.busy() is None

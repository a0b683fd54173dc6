"""TE's own DotProductAttention, forward and backward, through our router on CPU.

The real TE 2.20.2 is imported with the NVTE_PLUGIN hook (see ``te_boot``); the decision is made
for an H100 profile with ``TE_FL_ATTN_FORCE=triton``, so TE takes its flash path and our router
runs our Triton kernel in the Triton interpreter (``TRITON_INTERPRET=1``). Results are compared
with the reference implementation (``kernels.reference``).

TE refuses to run without CUDA in three places, none of them attention logic; the scenario
answers them from the test side, without patching TE:

* ``TransformerEngineBaseModule.__init__`` checks ``torch.cuda.is_available()``, and TE's
  ``get_device_compute_capability()`` calls ``torch.cuda.current_device()`` /
  ``torch.cuda.get_device_properties()``: those three torch functions are mocked (an sm90
  device) while the module is built and run;
* ``DotProductAttention.forward`` asserts ``query_layer.is_cuda``: q/k/v are a ``torch.Tensor``
  subclass whose ``is_cuda`` property is True (the data stays on the CPU).
"""

from __future__ import annotations

SCENARIO = """
import io, logging, types
from unittest import mock
import te_boot
te_boot.boot()
utils, dpa_mod = te_boot.modules()
import torch
import transformer_engine.pytorch as te
from te_fl_attention.kernels import reference
from te_fl_attention.plugin.te_backend import TRITON_VERSION

log = io.StringIO()
logging.getLogger("te_fl_attention.plugin").addHandler(logging.StreamHandler(log))

class CudaLooking(torch.Tensor):
    @property
    def is_cuda(self):
        return True

props = types.SimpleNamespace(major=9, minor=0, name="H100 (mocked)",
                              multi_processor_count=132, total_memory=80 << 30)
cuda = [mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.current_device", return_value=0),
        mock.patch("torch.cuda.get_device_properties", return_value=props)]
for patch in cuda:
    patch.start()

def tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.Tensor._make_subclass(CudaLooking, t, True)

def plain(x):
    return x.detach().as_subclass(torch.Tensor).requires_grad_()

def case(name, fmt, b, s, h, hg, d, dtype, mask, window=None, cu=None):
    shape = {"bshd": (b, s, h, d), "sbhd": (s, b, h, d)}[fmt] if cu is None else (cu[-1], h, d)
    kv_shape = (*shape[:-2], hg, d)
    q, k, v = tensor(shape, dtype, 1), tensor(kv_shape, dtype, 2), tensor(kv_shape, dtype, 3)
    layer = te.DotProductAttention(num_attention_heads=h, kv_channels=d, num_gqa_groups=hg,
                                   attention_dropout=0.0, qkv_format=fmt, attn_mask_type=mask,
                                   window_size=window)
    kw = {}
    if cu is not None:
        kw = dict(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32),
                  max_seqlen_q=s, max_seqlen_kv=s)
    out = layer(q, k, v, **kw)
    chosen = dpa_mod._attention_backends
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    rq, rk, rv = plain(q), plain(k), plain(v)
    rkw = {} if cu is None else dict(cu_seqlens_q=kw["cu_seqlens_q"],
                                     cu_seqlens_kv=kw["cu_seqlens_kv"])
    win = window if window is not None else (-1, 0 if "causal" in mask else -1)
    ref = reference.attention(rq, rk, rv, qkv_format=fmt, attn_mask_type=mask, window_size=win,
                              **rkw)
    ref = ref.reshape(*ref.shape[:-2], -1)
    gq, gk, gv = torch.autograd.grad(ref, (rq, rk, rv), grad)
    def err(a, b):  # max |a - b| / (1 + |b|): absolute near 0, relative for large values
        a, b = a.as_subclass(torch.Tensor).float(), b.float()
        return float(((a - b).abs() / (1 + b.abs())).max())
    return dict(name=name, shape=list(out.shape), out_type=type(out).__name__,
                use_flash=chosen["use_flash_attention"],
                version=str(chosen["flash_attention_backend"]),
                router=type(layer.flash_attention).__name__,
                err=[err(out, ref), err(dq, gq), err(dk, gk), err(dv, gv)])

results = [
    case("bshd causal fp32", "bshd", 2, 32, 2, 2, 16, torch.float32, "causal"),
    case("sbhd gqa no_mask fp32", "sbhd", 2, 24, 4, 2, 16, torch.float32, "no_mask"),
    case("bshd swa bf16", "bshd", 1, 48, 2, 1, 32, torch.bfloat16, "causal", window=(8, 0)),
    case("thd padding fp32", "thd", 3, 20, 2, 2, 16, torch.float32, "padding",
         cu=[0, 7, 20, 31]),
]
# ALiBi: our Triton kernel refuses it, and forcing triton leaves TE no backend.
layer = te.DotProductAttention(num_attention_heads=2, kv_channels=16, qkv_format="bshd",
                               attn_mask_type="causal")
q = tensor((1, 16, 2, 16), torch.float32, 5)
try:
    layer(q, q, q, core_attention_bias_type="alibi")
    refused = None
except ValueError as exc:
    refused = str(exc)
report(results=results, triton_version=TRITON_VERSION, refused=refused, log=log.getvalue())
"""


def test_dot_product_attention_runs_our_triton_kernel(te_script) -> None:
    report = te_script(SCENARIO, env={"TRITON_INTERPRET": "1", "TE_FL_ATTN_DEVICE": "h100",
                                      "TE_FL_ATTN_FORCE": "triton"})  # fmt: skip
    tolerance = {"fp32": 2e-5, "bf16": 1.5e-2}  # bf16: TE's own test tolerance
    for r in report["results"]:
        assert r["router"] == "FlashAttentionRouter", r
        assert r["use_flash"] and r["version"] == report["triton_version"], r
        tol = tolerance["bf16" if "bf16" in r["name"] else "fp32"]
        assert max(r["err"]) < tol, r
    shapes = {r["name"]: r["shape"] for r in report["results"]}
    assert shapes["bshd causal fp32"] == [2, 32, 32]  # TE's [b, s, h*d]
    assert shapes["sbhd gqa no_mask fp32"] == [24, 2, 64]  # [s, b, h*d]
    assert shapes["thd padding fp32"] == [31, 32]  # [t, h*d]
    assert report["refused"] and "No dot product attention backend" in report["refused"]
    assert "TritonFlashAttention" in report["log"] and "ALiBi" in report["log"]

"""On a real GPU (``@pytest.mark.gpu``; skipped without CUDA, run by scripts/gpu_acceptance.sh).

**Never ran on a GPU yet** (none was lent while writing them). Their CPU twins run the same code
paths through the hardware seam (tests/fakegpu): ``tests/probes/fused/test_local.py``,
``tests/test_run_worker.py``, ``tests/test_verify_measure.py``, ``tests/kernels/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.cache import MemoryCache
from te_fl_attention.device import local
from te_fl_attention.kernels import reference
from te_fl_attention.probes import default_probes
from te_fl_attention.verify import TOLERANCE, error

pytestmark = pytest.mark.gpu
TESTS = str(Path(__file__).resolve().parent)
LLAMA = FusedAttnConfig(batch_size=2, max_seqlen_q=1024, num_heads=32, num_gqa_groups=8,
                        head_dim_qk=128, attn_mask_type="causal", qkv_layout="bshd_bshd_bshd")


def test_the_local_gpu_is_decided_with_a_real_cudnn_handle():
    d = Selector(default_probes(), cache=MemoryCache()).decide(LLAMA, "local", Policy())
    fused = d.result("fused")
    assert d.device.source == "local" and d.device.sm is not None
    assert fused.stage == "graph_build" and fused.detail.get("mode") == "device", fused
    assert d.chosen is not None


CASES = [
    dict(qkv_format="bshd", attn_mask_type="causal", h=8, hkv=8, d=128, s=512),
    dict(qkv_format="bshd", attn_mask_type="no_mask", h=16, hkv=4, d=64, s=384),
    dict(qkv_format="sbhd", attn_mask_type="causal_bottom_right", h=8, hkv=2, d=128, s=256,
         skv=512),
    dict(qkv_format="bshd", attn_mask_type="causal", h=8, hkv=8, d=192, dv=128, s=256),
    dict(qkv_format="bshd", attn_mask_type="causal", h=8, hkv=8, d=128, s=1024,
         window=(128, 0)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['qkv_format']}-{c['attn_mask_type']}")
def test_triton_kernel_matches_the_reference_on_the_gpu(case, dtype):
    from te_fl_attention.kernels.triton_flash import flash_attention

    b, s, skv = 2, case["s"], case.get("skv", case["s"])
    h, hkv, d, dv = case["h"], case["hkv"], case["d"], case.get("dv", case["d"])
    g = torch.Generator().manual_seed(0)

    def make(seq, heads, dim):
        shape = (b, seq, heads, dim) if case["qkv_format"] == "bshd" else (seq, b, heads, dim)
        return torch.randn(shape, generator=g).to(dtype)

    q, k, v = make(s, h, d), make(skv, hkv, d), make(skv, hkv, dv)
    kw = dict(qkv_format=case["qkv_format"], attn_mask_type=case["attn_mask_type"],
              window_size=case.get("window", (-1, -1)))  # fmt: skip
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = flash_attention(qc, kc, vc, **kw)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad.cuda())
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    want = reference.attention(qr, kr, vr, **kw)
    want.backward(grad.double())
    tol = TOLERANCE["bf16" if dtype == torch.bfloat16 else "fp16"]
    for got, ref in ((out, want), (qc.grad, qr.grad), (kc.grad, kr.grad), (vc.grad, vr.grad)):
        assert error(got.cpu(), ref) <= tol


def test_a_faulting_tiny_run_is_its_own_failure_and_the_caller_survives():
    import os

    from te_fl_attention import problems
    from te_fl_attention.run_worker import RunWorker
    from te_fl_attention.workers import current_device

    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    small = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16)
    with RunWorker(env=env, setup="gpu_faults", device=current_device()) as w:
        note, exc = problems.tiny_run("triton", small, worker=w)
        assert exc is not None and "illegal" in str(exc).lower(), (note, exc)
        assert problems.tiny_run("unfused", small, worker=w) == (None, None)  # a fresh worker
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0  # this process's context is untouched
    torch.cuda.synchronize()


def test_verified_and_measured_decision_on_the_gpu():
    pol = Policy(verify=True, measure=True)
    d = Selector(default_probes(), cache=MemoryCache()).decide(LLAMA.replace(max_seqlen_q=512),
                                                               "local", pol)  # fmt: skip
    assert d.chosen is not None and d.detail["timings_ms"]
    ran = [r for r in d.results if r.detail.get("numerics")]
    assert ran and all(r.supported for r in ran if "max_error" in r.detail["numerics"])
    assert local().sm is not None

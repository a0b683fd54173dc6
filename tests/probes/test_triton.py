"""The Triton probe after its rules: the tiny run on the local device (the Triton interpreter on
this CPU machine), what-if devices, and the rules kept in sync with the kernel's SUPPORTED."""

from __future__ import annotations

import pytest
import torch

from te_fl_attention import selector
from te_fl_attention.config import MASK_TYPES, FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.kernels import run as runner
from te_fl_attention.probes import triton
from te_fl_attention.probes.triton import NO_GPU_MESSAGE, TritonFlashProbe

INTERP = not torch.cuda.is_available() and runner.use_interpreter()
needs_interpreter = pytest.mark.skipif(not INTERP, reason="needs the Triton interpreter")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
LOCAL = profile("local")


@cpu_only
def test_cpu_without_interpreter_is_refused_at_stage_run():
    r = TritonFlashProbe().probe(FusedAttnConfig(), LOCAL)
    assert not r.supported and r.stage == "run"
    (why,) = r.reasons
    assert why.stage == "run" and why.code == "device.no_gpu"
    assert why.message == NO_GPU_MESSAGE == (
        "no GPU; set TRITON_INTERPRET=1 to run the kernel on CPU (slow)")


@cpu_only
@needs_interpreter
@pytest.mark.parametrize("kw", [
    {},
    {"qkv_layout": "thd_thd_thd", "attn_mask_type": "padding_causal", "num_heads": 8,
     "num_gqa_groups": 2, "window_size": (128, 0), "head_dim_qk": 96, "head_dim_v": 64},
    {"dtype": "fp32", "is_training": False, "attn_mask_type": "causal_bottom_right",
     "max_seqlen_kv": 256},
], ids=["default", "thd-gqa-window-mla", "fp32-inference-cross"])  # fmt: skip
def test_interpreter_runs_a_tiny_problem(kw):
    r = TritonFlashProbe(interpret=True).probe(FusedAttnConfig(**kw), LOCAL)
    assert r.supported and r.stage == "run" and r.reasons == ()
    assert "Triton interpreter" in r.evidence and r.detail["interpreter"] is True


@cpu_only
def test_interpreter_not_ready_says_why(monkeypatch):
    monkeypatch.setattr(runner, "interpreter_ready", lambda: False)
    r = TritonFlashProbe(interpret=True).probe(FusedAttnConfig(), LOCAL)
    assert not r.supported and r.reasons[0].code == "triton.cannot_run"
    assert "before Python starts" in r.reasons[0].message


def test_what_if_devices_keep_the_rule_verdict():
    r = TritonFlashProbe(interpret=True).probe(FusedAttnConfig(), profile("h100"))
    assert r.supported and r.stage == "rule" and r.detail == {"predicted": True}
    r = TritonFlashProbe().probe(FusedAttnConfig(), profile("h100:sm=none"))
    assert not r.supported and r.reasons[0].code == "device.no_gpu"
    assert r.reasons[0].stage == "rule"


class CompilationError(Exception):
    """Stands for triton.compiler.errors.CompilationError."""


CompilationError.__module__ = "triton.compiler.errors"


@pytest.mark.parametrize("exc, stage", [(CompilationError("bad tl.dot"), "compile"),
                                        (RuntimeError("out of resources"), "run")])
def test_failures_are_compile_or_run(monkeypatch, exc, stage):
    from te_fl_attention import problems

    monkeypatch.setattr(runner, "can_run_here", lambda *a, **k: (True, "test"))
    monkeypatch.setattr(problems, "tiny_run", lambda b, c: (None, exc))
    r = TritonFlashProbe().probe(FusedAttnConfig(), LOCAL)
    assert not r.supported and r.stage == stage
    assert r.reasons[0].code == f"triton.{stage}_failed" and str(exc) in r.reasons[0].message


def test_selector_passes_triton_interpret_to_the_probe(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selector.Selector().interpret
    assert selector.Selector(selector._default_probes(graph=False)).interpret
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not selector.Selector().interpret


# ------------------------------------------------------------------------ in sync with SUPPORTED
def test_rules_match_the_kernels_supported_table():
    from te_fl_attention.kernels.triton_flash import SUPPORTED

    assert triton.MAX_HEAD_DIM == SUPPORTED["max_head_dim"]
    assert triton.DTYPES == tuple(SUPPORTED["dtypes"])
    assert triton.MIN_SM == SUPPORTED["min_sm"]
    rules, h100 = TritonFlashProbe.RULES, profile("h100")

    def refused(**kw):
        c = FusedAttnConfig(**kw)
        return [r for rule in rules if (r := rule(c, h100)) is not None]

    d = SUPPORTED["max_head_dim"]
    assert not refused(head_dim_qk=d, head_dim_v=d) and refused(head_dim_qk=d + 8)
    assert not refused(deterministic=True) and SUPPORTED["deterministic_backward"]
    for mask in MASK_TYPES:
        allowed = mask in SUPPORTED["attn_mask_types"]
        kw = {"max_seqlen_kv": 256} if "bottom_right" in mask else {}
        assert bool(refused(attn_mask_type=mask, **kw)) != allowed, mask
    for fmt in SUPPORTED["qkv_formats"]:
        extra = {"attn_mask_type": "padding"} if fmt == "thd" else {}
        assert not refused(qkv_layout=f"{fmt}_{fmt}_{fmt}", **extra), fmt
    assert not refused(window_size=(64, 8), num_heads=16, num_gqa_groups=1, head_dim_v=32)
    for bias in ("pre_scale_bias", "post_scale_bias", "alibi"):
        assert (bias in SUPPORTED["bias_types"]) != bool(refused(bias_type=bias))
    for softmax in ("off-by-one", "learnable"):
        assert (softmax in SUPPORTED["softmax_types"]) != bool(refused(softmax_type=softmax))
    assert bool(refused(dropout=0.1)) != SUPPORTED["dropout"]
    assert bool(refused(fp8=True)) != SUPPORTED["fp8"]


# ------------------------------------------------------------------------------ on a (fake) GPU
def test_on_a_gpu_a_compile_error_reported_by_the_worker_is_stage_compile(fake_gpu, monkeypatch):
    from te_fl_attention import problems
    from te_fl_attention.run_worker import RunFailure

    exc = RunFailure("CompilationError", "at 12:4: bad tl.dot",
                     ["builtins", "triton.compiler.errors"])  # fmt: skip
    monkeypatch.setattr(problems, "tiny_run", lambda b, c: (None, exc))
    device = profile("local")
    r = TritonFlashProbe().probe(FusedAttnConfig(), device)
    assert not r.supported and r.stage == "compile"
    (why,) = r.reasons
    assert why.code == "triton.compile_failed" and why.observed == "CompilationError"
    assert f"on {device.name}: CompilationError: at 12:4: bad tl.dot" in why.message


@needs_interpreter
def test_on_a_gpu_the_tiny_run_is_the_kernels(fake_gpu, monkeypatch):
    """The GPU branch with the kernel itself (run by the interpreter: tensors stay on CPU),
    in-process, synchronized after the run."""
    from te_fl_attention import problems

    monkeypatch.setattr(problems, "ISOLATE_GPU_RUNS", False)
    device = profile("local")
    r = TritonFlashProbe().probe(FusedAttnConfig(max_seqlen_q=16, head_dim_qk=32), device)
    assert r.supported and r.stage == "run" and r.detail == {"interpreter": False}
    assert r.evidence == f"ran a tiny problem on {device.name}" and fake_gpu.synchronize_calls == 1

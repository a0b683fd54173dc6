"""Numerical verification and measured mode, end to end through the Selector (CPU: the reference,
our Triton kernel in the interpreter, and fake kernels injected into the runner)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
import torch

from te_fl_attention import FusedAttnConfig, Policy, Selector, measure, render, verify
from te_fl_attention.cache import MemoryCache
from te_fl_attention.device import profile
from te_fl_attention.kernels import reference
from te_fl_attention.kernels import run as runner
from te_fl_attention.presets import preset
from te_fl_attention.probes.cudnn import CudnnProbe
from te_fl_attention.probes.flash_attn import FlashAttnProbe
from te_fl_attention.probes.triton_flash import TritonFlashProbe
from te_fl_attention.probes.unfused import UnfusedProbe
from te_fl_attention.reasons import ProbeResult, Reason

INTERP = not torch.cuda.is_available() and runner.use_interpreter()
needs_interpreter = pytest.mark.skipif(not INTERP, reason="needs the Triton interpreter")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU expectations")

SMALL = FusedAttnConfig(batch_size=2, max_seqlen_q=64, num_heads=4, num_gqa_groups=2,
                        head_dim_qk=64, attn_mask_type="causal", qkv_layout="bshd_bshd_bshd")
VERIFY, MEASURE = Policy(verify=True), Policy(measure=True)


def selector(cache=None, interpret=INTERP):
    probes = (CudnnProbe(graph=False), FlashAttnProbe(), TritonFlashProbe(interpret=interpret),
              UnfusedProbe())  # fmt: skip
    return Selector(probes, cache=cache if cache is not None else MemoryCache())


def unit(decision, name):
    return decision.result(name)


# ---------------------------------------------------------------------------------- verification
def test_verification_accepts_correct_backends():
    d = selector().decide(SMALL, "local", VERIFY)
    for name in ("unfused", "triton") if INTERP else ("unfused",):
        r = unit(d, name)
        num = r.detail["numerics"]
        assert r.supported and r.stage == "numerics", (name, r)
        assert set(num["max_error"]) == {"out", "dq", "dk", "dv"}  # training: gradients too
        assert max(num["max_error"].values()) <= num["tolerance"] == verify.TOLERANCE["bf16"]
        assert num["shape"]["num_heads"] == 4 and num["shape"]["num_gqa_groups"] == 2
    assert d.chosen == ("triton" if INTERP else "unfused")  # TE's order, now verified
    fused = unit(d, "fused")
    assert not fused.supported and "numerics" not in fused.detail  # refused: nothing to verify


def broken(q, k, v, f):
    """A kernel that is off by 0.5 everywhere."""
    return reference.attention(q, k, v, **{n: x for n, x in f.items()
                                           if n not in runner.HINTS}) + 0.5  # fmt: skip


def test_verification_refuses_a_broken_kernel_and_caches_the_verdict(monkeypatch):
    cache = MemoryCache()
    monkeypatch.setitem(runner.RUNNERS, "unfused", broken)
    sel = selector(cache, interpret=False)
    d = sel.decide(SMALL, "local", VERIFY)
    r = unit(d, "unfused")
    assert not r.supported and r.stage == "numerics"
    why = r.reasons[-1]
    assert why.code == "numerics.mismatch" and why.stage == "numerics"
    assert why.observed == r.detail["numerics"]["max_error"]["out"] > 0.1  # 0.5 / max|out|
    assert why.limit == verify.TOLERANCE["bf16"]
    assert "max error" in why.message and d.chosen is None
    assert sel.stats["verify_runs"] == 1
    # Without verification the same selector (same probe rows) still picks unfused.
    assert sel.decide(SMALL, "local").chosen == "unfused" and sel.stats["probes"] == 4
    # A later job reads the stored verdict: nothing runs again.
    monkeypatch.setitem(runner.RUNNERS, "unfused", lambda *a: pytest.fail("ran again"))
    again = selector(cache, interpret=False)
    d2 = again.decide(SMALL, "local", VERIFY)
    assert unit(d2, "unfused").reasons == r.reasons and "verify_runs" not in again.stats
    assert d2.source == "cache"


def test_a_crashing_kernel_is_refused_at_stage_run(monkeypatch):
    def crash(q, k, v, f):
        raise RuntimeError("illegal memory access")

    monkeypatch.setitem(runner.RUNNERS, "unfused", crash)
    r = unit(selector(interpret=False).decide(SMALL, "local", VERIFY), "unfused")
    assert not r.supported and r.reasons[-1].stage == "run"
    assert "illegal memory access" in r.reasons[-1].message


def test_what_if_devices_keep_their_verdict_with_a_note():
    d = selector().decide(SMALL, "h100", VERIFY)
    fused = unit(d, "fused")
    assert fused.supported and "numerics" not in fused.detail and d.chosen == "fused"
    assert "what-if" in d.detail["numerics_note"]
    assert "nothing is verified" in "\n".join(render.measured_lines(d))


def test_what_if_devices_are_not_timed():
    d = selector().decide(SMALL, "h100", MEASURE)
    assert d.chosen == "fused" and d.detail["timings_ms"] == {}
    assert "what-if" in d.detail["measured"]["note"]
    assert "timing_note" not in unit(d, "fused").detail


def test_local_candidates_that_cannot_run_get_a_note():
    """A local device said to have a GPU, on this CPU machine: fused passes its rules but cannot
    run: it keeps its verdict and its rule-priority place, with a note."""
    d = selector(interpret=False).decide(SMALL, profile("local:sm=90"), MEASURE)
    r = unit(d, "fused")
    assert r.supported and "needs a CUDA GPU" in r.detail["timing_note"]
    assert d.chosen == "fused" and d.detail["measured"]["untimed"] == ["fused"]
    assert "unfused" in d.detail["timings_ms"]
    assert "kept in their rule-priority place: fused" in "\n".join(render.measured_lines(d))


def test_nothing_runs_while_torch_compile_traces(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    r = unit(selector().decide(SMALL, "local", VERIFY), "unfused")
    assert r.supported and "torch.compile is tracing" in r.detail["numerics"]["skipped"]


def test_unverifiable_features_are_notes_not_refusals():
    c = SMALL.replace(softcap=30.0)  # the reference has no softcap
    r = unit(selector(interpret=False).decide(c, "local", VERIFY), "unfused")
    assert r.supported and "softcap" in r.detail["numerics"]["skipped"]


def test_small_shape_keeps_the_kinds():
    c = FusedAttnConfig(batch_size=8, max_seqlen_q=1, max_seqlen_kv=4096, num_heads=64,
                        num_gqa_groups=1, window_size=(1024, 0),
                        attn_mask_type="causal_bottom_right")
    s = verify.small_shape(c)
    assert (s.batch, s.seqlen_q, s.seqlen_kv, s.num_heads, s.num_gqa_groups) == (2, 1, 32, 2, 1)
    assert s.window_size == (8, 0)  # a quarter of the keys, as in the real config
    s = verify.small_shape(FusedAttnConfig(max_seqlen_q=4000, max_seqlen_kv=4096))
    assert s.seqlen_q != s.seqlen_kv  # cross-attention stays cross-attention


def test_error_counts_nan_as_infinite():
    want = torch.ones(3)
    assert verify.error(torch.tensor([1.0, float("nan"), 1.0]), want) == float("inf")
    assert verify.error(want * 1.5, want * 2) == pytest.approx(0.25)


# ---------------------------------------------------------------------------------- measured mode
class Fixed:
    """A candidate whose verdict is fixed (fake backends for measured mode)."""

    def __init__(self, name: str, ok: bool):
        self.name, self.ok = name, ok

    def rules(self, config, device):
        return []

    def probe(self, config, device):
        why = () if self.ok else (Reason("test.off", "off in this test", observed=1, limit=0),)
        return ProbeResult(self.name, self.ok, why)


def fake(delay_s: float):
    """A kernel that takes ``delay_s`` (its output is not looked at in measured mode)."""

    def kernel(q, k, v, f):
        time.sleep(delay_s)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    return kernel


def fake_selector(cache):
    probes = (Fixed("fused", False), Fixed("flash", False), Fixed("triton", True),
              Fixed("unfused", True))  # fmt: skip
    return Selector(probes, cache=cache)


TINY = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16, is_training=False)


def test_measured_mode_picks_the_faster_and_later_jobs_reuse_the_timings(monkeypatch):
    monkeypatch.setattr(runner, "can_run_here", lambda *a, **k: (True, "test"))
    monkeypatch.setitem(runner.RUNNERS, "triton", fake(0.03))
    monkeypatch.setitem(runner.RUNNERS, "unfused", fake(0.0))
    cache = MemoryCache()
    sel = fake_selector(cache)
    assert sel.decide(TINY, "local").chosen == "triton"  # TE's order without a GPU
    d = sel.decide(TINY, "local", MEASURE)
    assert d.chosen == "unfused" and d.order == ("flash", "unfused", "fused", "triton")
    t = d.detail["timings_ms"]
    assert t["triton"]["fwd"] >= 30 > t["unfused"]["fwd"] and "fwd_bwd" not in t["unfused"]
    assert d.detail["measured"]["metric"] == "fwd"
    assert d.detail["measured"]["priority_choice"] == "triton"
    assert unit(d, "unfused").stage == "measure" and sel.stats["measure_runs"] == 2
    out = io.StringIO()
    render.render(d, file=out)
    assert "measured (fwd, ms, median of 5): unfused" in out.getvalue()
    assert "rule priority alone would choose: triton" in out.getvalue()
    # A second job (new selector, same store) chooses from the stored timings, timing nothing.
    for name in ("triton", "unfused"):
        monkeypatch.setitem(runner.RUNNERS, name, lambda *a: pytest.fail("timed again"))
    later = fake_selector(cache)
    d2 = later.decide(TINY, "local", MEASURE)
    assert d2.chosen == "unfused" and d2.source == "cache" and "measure_runs" not in later.stats
    assert d2.detail["timings_ms"] == t


def test_force_and_prefer_beat_timings(monkeypatch):
    monkeypatch.setattr(runner, "can_run_here", lambda *a, **k: (True, "test"))
    monkeypatch.setitem(runner.RUNNERS, "triton", fake(0.01))
    monkeypatch.setitem(runner.RUNNERS, "unfused", fake(0.0))
    sel = fake_selector(MemoryCache())
    assert sel.decide(TINY, "local", MEASURE.with_(prefer=("triton",))).chosen == "triton"
    assert sel.decide(TINY, "local", MEASURE, force="triton").chosen == "triton"


def test_cpu_timing_shape_is_capped_and_said():
    c = FusedAttnConfig(**preset("llama3-70b"))
    shape, note = measure.timing_shape(c, cuda=False)
    assert shape.score_elements() <= measure.CPU_MAX_SCORE_ELEMENTS < verify.real_shape(c)\
        .score_elements()  # fmt: skip
    assert shape.num_heads // shape.num_gqa_groups >= 2  # still GQA
    assert "2^22 score elements" in note
    assert measure.timing_shape(c, cuda=True) == (verify.real_shape(c), None)


@needs_interpreter
def test_interpreter_is_never_timed_on_big_shapes():
    result, store = measure.check("triton", FusedAttnConfig(max_seqlen_q=512), profile("local"))
    assert result.supported and not store and result.detail["too_slow"]
    assert "too many for the Triton interpreter" in result.detail["timing_note"]
    d = selector().decide(FusedAttnConfig(max_seqlen_q=512), "local", MEASURE)
    assert d.chosen == "unfused" and d.detail["measured"]["priority_choice"] == "triton"


def test_policy_reads_the_env_switches():
    p = Policy.from_env({"TE_FL_ATTN_VERIFY": "1", "TE_FL_ATTN_MEASURE": "1"})
    assert p.verify and p.measure
    assert not Policy.from_env({}).verify
    with pytest.raises(ValueError, match="TE_FL_ATTN_MEASURE"):
        Policy.from_env({"TE_FL_ATTN_MEASURE": "yes"})


def test_cli_explain_verify_and_measure(tmp_path):
    env = {"TE_FL_ATTN_CACHE": str(tmp_path / "c.sqlite"), "PATH": "/usr/bin:/bin"}
    args = ["explain", "--seqlen", "32", "--num-heads", "2", "--head-dim-qk", "32", "--device",
            "local", "--verify", "--measure"]  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "te_fl_attention.cli", *args, "--json"],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["chosen"] == "unfused" and "unfused" in data["detail"]["timings_ms"]
    unfused = next(r for r in data["results"] if r["backend"] == "unfused")
    assert unfused["stage"] == "measure"
    assert unfused["detail"]["numerics"]["max_error"]["out"] < 0.05
    p = subprocess.run([sys.executable, "-m", "te_fl_attention.cli", *args], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert "timed: fwd" in p.stdout and "numerics: max error" in p.stdout and "source: cache" in \
        p.stdout  # fmt: skip

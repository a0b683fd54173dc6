"""Numerical verification and measured mode, end to end through the Selector (CPU: the reference,
our Triton kernel in the interpreter, and fake kernels injected into the runner)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time

import pytest
import torch

from te_fl_attention import FusedAttnConfig, Policy, Selector, measure, problems, verify
from te_fl_attention.cache import MemoryCache
from te_fl_attention.cli import render
from te_fl_attention.device import profile
from te_fl_attention.kernels import reference
from te_fl_attention.kernels import run as runner
from te_fl_attention.presets import preset
from te_fl_attention.probes.flash.probe import FlashAttnProbe
from te_fl_attention.probes.fused.probe import CudnnProbe
from te_fl_attention.probes.triton import TritonFlashProbe
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
    s = problems.small_shape(c)
    assert (s.batch, s.seqlen_q, s.seqlen_kv, s.num_heads, s.num_gqa_groups) == (2, 1, 32, 2, 1)
    assert s.window_size == (8, 0)  # a quarter of the keys, as in the real config
    s = problems.small_shape(FusedAttnConfig(max_seqlen_q=4000, max_seqlen_kv=4096))
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
    assert shape.score_elements() <= measure.CPU_MAX_SCORE_ELEMENTS < problems.real_shape(c)\
        .score_elements()  # fmt: skip
    assert shape.num_heads // shape.num_gqa_groups >= 2  # still GQA
    assert "2^22 score elements" in note
    assert measure.timing_shape(c, cuda=True) == (problems.real_shape(c), None)


@needs_interpreter
def test_interpreter_is_never_timed_on_big_shapes_and_keeps_its_place():
    """Untimed is not "slowest": the Triton interpreter cannot take the shape, so Triton is not
    measured and keeps its rule-priority slot (ahead of the timed unfused), as the README says."""
    result, store = measure.check("triton", FusedAttnConfig(max_seqlen_q=512), profile("local"))
    assert result.supported and not store and result.detail["too_slow"]
    assert "too many for the Triton interpreter" in result.detail["timing_note"]
    why = result.detail["not_measured"]
    assert why["code"] == "measure.too_slow" and why["stage"] == "measure"
    d = selector().decide(FusedAttnConfig(max_seqlen_q=512), "local", MEASURE)
    assert d.chosen == "triton" == d.detail["measured"]["priority_choice"]
    assert d.order.index("triton") < d.order.index("unfused")
    assert d.detail["measured"]["untimed"] == ["triton"] and "unfused" in d.detail["timings_ms"]
    assert "kept in their rule-priority place: triton" in "\n".join(render.measured_lines(d))


def test_untimed_candidates_keep_their_slot_among_timed_ones(monkeypatch):
    """Policy.order's contract through the selector: a too-slow (untimed) unit is never ranked
    by a made-up time."""
    monkeypatch.setattr(runner, "can_run_here", lambda *a, **k: (True, "test"))
    monkeypatch.setitem(runner.RUNNERS, "unfused", fake(0.0))
    real = measure.check

    def check(backend, config, device):
        if backend == "triton":
            return measure.not_measured("triton", "measure.too_slow", "test", too_slow=True), False
        return real(backend, config, device)

    monkeypatch.setattr(measure, "check", check)
    d = fake_selector(MemoryCache()).decide(TINY, "local", MEASURE)
    assert d.chosen == "triton" and d.order == ("flash", "triton", "fused", "unfused")


# ------------------------------------------ measured mode on a fake GPU: "not measured" (defect 6)
def gpu_selector(fused_ok=True):
    probes = (Fixed("fused", fused_ok), Fixed("flash", False), Fixed("triton", False),
              Fixed("unfused", True))  # fmt: skip
    return Selector(probes, cache=MemoryCache())


FUSED_CFG = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16, dtype="bf16")


@pytest.mark.parametrize("kw, says", [
    ({"dropout": 0.1}, "dropout_p=0.1 (cuDNN's dropout resolution is 1/16)"),
    ({"max_seqlen_kv": 1, "attn_mask_type": "no_mask"}, "s_kv=1"),
    ({"head_dim_qk": 192, "head_dim_v": 160}, "backward with head dims (192, 160)"),
    ({"dropout": 0.125}, "No viable backend"),  # passes the gates: SDPA itself refuses (CPU)
], ids=["dropout", "skv1", "mla-bwd", "sdpa-refuses"])  # fmt: skip
def test_fused_that_sdpa_cannot_express_is_not_measured_and_keeps_its_place(fake_gpu, monkeypatch,
                                                                           kw, says):
    """On an H100 FusedAttention comes first; a problem torch SDPA's cuDNN backend cannot take
    (refused by the runner before SDPA, or by SDPA itself) leaves it untimed with a reason at
    stage measure: still supported, still first, never dropped."""
    if "No viable" not in says:  # SDPA's math stands for the cuDNN kernel the gates let through
        math = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, **kw: math(*a, **kw))
        monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a: contextlib.nullcontext())
    config = FUSED_CFG.replace(**kw)
    sel = gpu_selector()
    d = sel.decide(config, "local", MEASURE)
    fused = unit(d, "fused")
    assert fused.supported and fused.reasons == () and "timings_ms" not in fused.detail
    why = fused.detail["not_measured"]
    assert why["code"] == "measure.not_expressible" and why["stage"] == "measure"
    assert says in why["message"] and says in fused.detail["timing_note"]
    assert d.chosen == "fused" and d.order[0] == "fused" and "unfused" in d.detail["timings_ms"]
    assert d.detail["measured"]["untimed"] == ["fused"]
    assert d.detail["measured"]["repeats"] == measure.REPEATS["cuda"][1]


def test_a_kernel_that_fails_on_the_timed_shape_is_refused_on_a_gpu(fake_gpu, monkeypatch):
    def oom(q, k, v, f):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setitem(runner.RUNNERS, "unfused", oom)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    d = gpu_selector(fused_ok=False).decide(FUSED_CFG, "local", MEASURE)
    r = unit(d, "unfused")
    assert not r.supported and r.reasons[-1].code == "measure.failed" and emptied == [1]
    assert "out of memory" in r.reasons[-1].message and r.reasons[-1].observed == "RuntimeError"


# ------------------------------------------------------- what is timed: the launch only (defect 10)
def _log_preparation(monkeypatch, log, bias: bool = False):
    """Record host preparation (varlen packing, signature look-ups; ``bias``: the masked_fill of
    a dense bias) and CUDA event records into ``log`` (the fake flash-attn appends its launches
    there)."""
    import inspect

    from fakegpu import FakeEvent

    def spy(obj, name):
        real = getattr(obj, name)

        def wrapper(*a, **kw):
            log.append(("prep", name))
            return real(*a, **kw)

        monkeypatch.setattr(obj, name, wrapper)

    spy(runner, "_tokens")
    spy(inspect, "signature")
    if bias:
        spy(torch.Tensor, "masked_fill")

    class Event(FakeEvent):
        def record(self, stream=None):
            log.append(("record", None))
            super().record(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)


def _timed_regions(log):
    """The log entries between each start event's record and its end event's record."""
    inside, out = False, []
    for e in log:
        if e[0] == "record":
            inside = not inside
        elif inside:
            out.append(e)
    assert not inside
    return out


def test_only_the_flash_launch_is_timed(fake_gpu, fake_flash):
    """padding + training: FA2 through its varlen entry point (packing, lengths, signature);
    none of that runs between the CUDA events, only the launches (and their backward)."""
    config = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16, dtype="bf16",
                             attn_mask_type="padding")  # fmt: skip
    problem = problems.build(config, problems.real_shape(config))
    log = fake_flash
    with pytest.MonkeyPatch.context() as mp:
        _log_preparation(mp, log)
        timings = measure.time_backend("fa2", problem, training=True, warmup=2, repeats=4)
    assert set(timings) == {"fwd", "fwd_bwd"}
    launches = [e for e in log if e[0] == "flash_attn_varlen_func"]
    preps = [e for e in log if e[0] == "prep"]
    assert preps and len(launches) == 2 * (2 + 4) + 1  # + the one that sizes the backward's grad
    timed = _timed_regions(log)
    assert timed and all(e[0] == "flash_attn_varlen_func" for e in timed), timed
    assert sum(e[0] == "record" for e in log) == 2 * 2 * 4  # start + end, per timed launch
    assert fake_gpu.synchronize_calls == 4  # after each warm-up and after each metric's runs


def test_only_the_sdpa_launch_is_timed(fake_gpu, monkeypatch):
    """Bottom-right causal cross-attention: the fused runner builds a dense bias (a masked_fill)
    once, outside the timed region; the timed region holds SDPA launches only."""
    log = []

    def sdpa(q, k, v, **kw):
        log.append(("sdpa", None))
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    _log_preparation(monkeypatch, log, bias=True)
    config = FUSED_CFG.replace(attn_mask_type="causal_bottom_right", max_seqlen_kv=24,
                               is_training=False)  # fmt: skip
    problem = problems.build(config, problems.real_shape(config))
    measure.time_backend("fused", problem, training=False, warmup=3, repeats=10)
    assert [e[0] for e in log].count("sdpa") == 13
    assert [e for e in log if e == ("prep", "masked_fill")] == [("prep", "masked_fill")]
    timed = _timed_regions(log)
    assert len(timed) == 10 and all(e[0] == "sdpa" for e in timed)


# ------------------------------------------ tiny runs synchronize: faults are attributed (defect 9)
def test_an_asynchronous_fault_is_the_candidate_that_ran(fake_gpu, fake_flash, monkeypatch):
    """In-process on a (fake) GPU: the fault a kernel leaves for the next synchronizing call is
    reported by the tiny run of that kernel, not by the next candidate's."""
    from fakegpu import ILLEGAL_ADDRESS

    monkeypatch.setattr(problems, "ISOLATE_GPU_RUNS", False)
    config = FusedAttnConfig(max_seqlen_q=16, num_heads=2, head_dim_qk=16)
    fake_gpu.pending_fault = ILLEGAL_ADDRESS  # armed by FA2's kernel
    fa2 = FlashAttnProbe().probe(config, profile("local")).variants[2]
    assert fa2.backend == "fa2" and not fa2.supported and fa2.stage == "run"
    assert fa2.reasons[0].code == "fa2.run_failed" and ILLEGAL_ADDRESS in fa2.reasons[0].message
    assert fake_gpu.synchronize_calls == 1 and fake_flash  # FA2 ran, then the run synchronized
    assert problems.tiny_run("unfused", config) == (None, None)  # the next candidate is clean
    assert fake_gpu.synchronize_calls == 2


def test_verification_synchronizes_on_a_gpu(fake_gpu, monkeypatch):
    from fakegpu import ILLEGAL_ADDRESS

    fake_gpu.pending_fault = ILLEGAL_ADDRESS
    result, store = verify.check("unfused", SMALL, profile("local"))
    assert not result.supported and store and ILLEGAL_ADDRESS in result.reasons[0].message
    assert result.reasons[0].stage == "run" and fake_gpu.synchronize_calls == 1


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

"""The flash probe after its rules: FA4's own head-dim validator, the import stage and the tiny run
on the local device (simulated where this CPU machine cannot do the real thing)."""

from __future__ import annotations

import pytest
from te_cpu import _fa4_validator

from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.probes.flash import fa4 as flash_fa4
from te_fl_attention.probes.flash import probe as flash_probe

FA4_VERSION = flash_fa4.fa4_validator()[1]
needs_fa4 = pytest.mark.skipif(FA4_VERSION is None, reason="flash-attn-4 is not installed")
DIMS = (8, 16, 60, 64, 96, 128, 160, 192, 256, 264, 512)


@pytest.fixture(autouse=True)
def fresh_imports():
    flash_probe.import_error.cache_clear()
    yield
    flash_probe.import_error.cache_clear()


@needs_fa4
@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_fa4_head_dims_are_fa4s_own_verdict(gpu):
    """Every (d_qk, d_v) pair: refused exactly when flash-attn-4's function asserts."""
    theirs, how = _fa4_validator()
    if how == "stand-in":
        pytest.skip("flash-attn-4's source is not readable here")
    device = profile(f"{gpu}:fa4={FA4_VERSION}")
    for dqk in DIMS:
        for dv in DIMS:
            try:
                theirs(dqk, dv, device.sm // 10, 8)
                accepted = True
            except AssertionError:
                accepted = False
            reason = flash_fa4.fa4_head_dims(FusedAttnConfig(head_dim_qk=dqk, head_dim_v=dv),
                                              device)  # fmt: skip
            assert (reason is None) == accepted, (gpu, dqk, dv, reason)
            if reason is not None:
                assert reason.stage == "import" and reason.code == "fa4.head_dim"
                assert f"({dqk}, {dv})" in reason.message and FA4_VERSION in reason.limit


@needs_fa4
def test_fa4_falls_back_to_our_rule(monkeypatch):
    c = FusedAttnConfig(head_dim_qk=160)
    other = profile("b200:fa4=4.0.0b1")  # not the installed FA4: its validator cannot answer
    assert flash_fa4.fa4_head_dims(c, other).stage == "rule"
    monkeypatch.setattr(flash_fa4, "fa4_validator", lambda: (None, FA4_VERSION))
    reason = flash_fa4.fa4_head_dims(c, profile(f"b200:fa4={FA4_VERSION}"))
    assert reason.stage == "rule" and reason.code == "fa4.head_dim"


def _failing_import(monkeypatch, module: str, text: str):
    real = flash_probe.importlib.import_module

    def fake(name, *a):
        if name == module:
            raise ImportError(text)
        return real(name, *a)

    monkeypatch.setattr(flash_probe.importlib, "import_module", fake)


def test_broken_flash_attn_2_is_an_import_reason_on_the_local_device(monkeypatch):
    text = "flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"
    _failing_import(monkeypatch, "flash_attn.flash_attn_interface", text)
    r = flash_probe.FlashAttnProbe().probe(FusedAttnConfig(), profile("local:sm=80,fa2=2.8.3"))
    fa2 = next(v for v in r.variants if v.backend == "fa2")
    assert not fa2.supported and fa2.stage == "import"
    (why,) = fa2.reasons
    assert why.code == "fa2.import_failed" and why.stage == "import" and text in why.message
    assert not r.supported and any(x.code == "fa2.import_failed" for x in r.reasons)
    # A what-if question about the same stack imports nothing.
    ok = flash_probe.FlashAttnProbe().probe(FusedAttnConfig(), profile("a100:fa2=2.8.3"))
    assert ok.supported and ok.detail["variant"] == "fa2"


@needs_fa4
def test_fa4_on_this_machine(monkeypatch):
    """The real import of flash-attn-4 on a local device said to be sm90: a refusal with the
    import error, or (where it imports) accepted with a note that no tiny call ran (no CUDA)."""
    from te_fl_attention.kernels import run as runner

    monkeypatch.setattr(runner, "tensor_device", lambda: "cpu")
    fa4 = flash_probe.FlashAttnProbe().probe(FusedAttnConfig(), profile("local:sm=90")).variants[0]
    assert fa4.backend == "fa4" and fa4.stage == "import"
    if fa4.supported:
        assert "no CUDA device" in fa4.detail["run_note"]
    else:
        assert fa4.reasons[0].code == "fa4.import_failed"
        assert "flash_attn.cute.interface" in fa4.reasons[0].message


def test_tiny_run_on_a_gpu(fake_gpu, monkeypatch):
    """Import works, a (fake) GPU is there: the tiny call decides (stage run)."""
    from te_fl_attention import problems

    monkeypatch.setattr(flash_probe, "import_error", lambda module: None)
    device, c = profile("local:fa2=2.8.3"), FusedAttnConfig()
    monkeypatch.setattr(problems, "tiny_run", lambda b, cfg: (None, None))
    ok = flash_probe.FlashAttnProbe().probe(c, device)
    assert ok.supported and ok.chosen_variant().stage == "run"
    monkeypatch.setattr(problems, "tiny_run",
                        lambda b, cfg: (None, RuntimeError("no kernel image")))  # fmt: skip
    bad = flash_probe.FlashAttnProbe().probe(c, device)
    fa2 = bad.variants[2]
    assert not bad.supported and fa2.stage == "run" and fa2.reasons[0].code == "fa2.run_failed"
    assert "RuntimeError: no kernel image" in fa2.reasons[0].message
    assert fa2.reasons[0].observed == "RuntimeError"
    monkeypatch.setattr(problems, "tiny_run", lambda b, cfg: ("tiny run skipped: why", None))
    noted = flash_probe.FlashAttnProbe().probe(c, device).variants[2]
    assert noted.supported and noted.stage == "import" and noted.detail["run_note"].endswith("why")
    assert flash_probe.FlashAttnProbe(run=False).probe(c, device).supported


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_fa2_runs_mla_on_the_local_h100(fake_gpu, fake_flash, monkeypatch, training):
    """MLA head dims (192/128) on the local (fake) H100 with flash-attn 2.8.3 installed: the
    tiny run pads as TE does (the fake checks v's head size like flash_api.cpp), so FA2 is
    accepted where TE would run it, at stage run."""
    from te_fl_attention import problems
    from te_fl_attention.presets import preset

    monkeypatch.setattr(problems, "ISOLATE_GPU_RUNS", False)  # in-process (the worker: elsewhere)
    config = FusedAttnConfig(**preset("deepseek-v3"), is_training=training)
    device = profile("local")
    assert device.sm == 90 and device.flash_attn == "2.8.3"
    r = flash_probe.FlashAttnProbe().probe(config, device)
    fa2 = r.variants[2]
    assert fa2.backend == "fa2" and fa2.supported and fa2.stage == "run", fa2.reasons
    assert r.supported and r.detail["variant"] == "fa2" and "tiny run" in fa2.evidence
    (entry, shapes), = fake_flash
    assert shapes["q"][-1] == shapes["k"][-1] == shapes["v"][-1] == 192
    assert fake_gpu.synchronize_calls == 1

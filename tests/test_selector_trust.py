"""The cache's trust boundary on the selector side: this process always runs the rule stage, and
a cached result (this machine's earlier run, an import, a merge, the Redis tier, a fleet
recording) can only narrow what the local rules accept, never widen it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.cache import MemoryCache
from te_fl_attention.device import profile
from te_fl_attention.presets import preset
from te_fl_attention.probes import default_probes
from te_fl_attention.reasons import ProbeResult, Reason

FP32 = FusedAttnConfig(dtype="fp32", max_seqlen_q=256, num_heads=8)
LLAMA = FusedAttnConfig(**preset("llama3-8b"))
#: (config, device, the local rule code that refuses fused)
REFUSED_FUSED = [
    (FP32, "h100", "fused.dtype"),
    (FusedAttnConfig(bias_type="pre_scale_bias", bias_shape="1hss", num_heads=4), "b200",
     "fused_cpp.pre_scale_bias"),
    (FusedAttnConfig(**{**preset("llama3-8b"), "max_seqlen_q": 512}), "t4", "fused.sm"),
    (FusedAttnConfig(qkv_layout="thd_thd_thd", attn_mask_type="padding"), "a100",
     "fused_cpp.thd_sm90"),
]


def _selector(cache: MemoryCache) -> Selector:
    return Selector(default_probes(graph=False), cache=cache)


def _poison(cache: MemoryCache, backend: str, edit) -> int:
    """Rewrite every stored ``backend`` row's result with ``edit(result) -> result``."""
    rows = [r for r in cache.iter_rows() if r.key.backend == backend]
    items = [(r.key, edit(r.probe_result), r.config, r.device) for r in rows]
    return cache.put_many(items)


def _claims_supported(r: ProbeResult) -> ProbeResult:
    variants = tuple(dataclasses.replace(v, supported=True, reasons=()) for v in r.variants)
    return dataclasses.replace(r, supported=True, reasons=(), stage="graph_build",
                               evidence="cudnn 9.99 graph", variants=variants)  # fmt: skip


@pytest.mark.parametrize(("config", "device", "code"), REFUSED_FUSED,
                         ids=[c for _, _, c in REFUSED_FUSED])  # fmt: skip
def test_a_cached_claim_cannot_widen_the_local_rules(config, device, code):
    """A fused row flipped to supported in the shared store: a fresh selector (a new job) still
    refuses fused, with the local rule's reasons."""
    cache = MemoryCache()
    first = _selector(cache).decide(config, device, Policy())
    assert code in [r.code for r in first.result("fused").reasons]
    assert _poison(cache, "fused", _claims_supported) == 1
    assert cache.get_rows([r.key for r in cache.iter_rows()])  # the poisoned row is there
    sel = _selector(cache)
    d = sel.decide(FusedAttnConfig(**config.to_dict()), device, Policy())
    assert sel.stats["cache_hits"] == 4 and sel.stats["probes"] == 0
    assert d.chosen != "fused"
    fused = d.result("fused")
    assert not fused.supported and fused.reasons[0].code == code
    assert fused.reasons == first.result("fused").reasons
    assert d.chosen == first.chosen


def test_a_cached_flash_flavour_cannot_widen_the_local_rules():
    """Every flash flavour claimed supported on a100 (sm80): FA3 (sm90 only) and FA4 (sm90+)
    stay refused by the local rules; FA2 keeps the cached verdict."""
    cache = MemoryCache()
    first = _selector(cache).decide(LLAMA, "a100", Policy())
    _poison(cache, "flash", _claims_supported)
    d = _selector(cache).decide(LLAMA, "a100", Policy())
    flash = d.result("flash")
    by = {v.backend: v for v in flash.variants}
    assert not by["fa3"].supported and by["fa3"].reasons[0].stage in ("rule", "import")
    assert "fa3.sm" in [r.code for r in by["fa3"].reasons]
    assert not by["fa4"].supported and "fa4.sm" in [r.code for r in by["fa4"].reasons]
    assert d.flash_variant not in ("fa3", "fa4")
    assert by["fa3"].reasons == {v.backend: v for v in first.result("flash").variants}[
        "fa3"].reasons


def test_every_candidate_claimed_supported_leaves_only_what_the_rules_accept():
    """All four rows flipped for fp32 on h100: only the candidates the local rules accept can
    be chosen (Triton runs fp32; unfused too)."""
    cache = MemoryCache()
    _selector(cache).decide(FP32, "h100", Policy())
    for b in ("fused", "flash", "triton", "unfused"):
        _poison(cache, b, _claims_supported)
    d = _selector(cache).decide(FP32, "h100", Policy())
    assert not d.result("fused").supported and not d.result("flash").supported
    assert d.chosen == "triton"


def test_a_cached_refusal_still_narrows():
    """Evidence from a later stage (cuDNN refused the graph on the GPU that ran it) is kept:
    fused is refused with the cached reason although the local rules accept it."""
    cache = MemoryCache()
    assert _selector(cache).decide(LLAMA, "h100", Policy()).chosen == "fused"
    why = Reason("cudnn.not_supported", "cuDNN refused the fwd graph", "graph_build")
    _poison(cache, "fused", lambda r: dataclasses.replace(r, supported=False, reasons=(why,),
                                                          stage="graph_build"))  # fmt: skip
    d = _selector(cache).decide(LLAMA, "h100", Policy())
    assert d.chosen == "flash" and d.result("fused").reasons == (why,)


def test_a_cached_flavour_refusal_still_narrows():
    cache = MemoryCache()
    first = _selector(cache).decide(LLAMA, "h100:fa3=3.0.0b1", Policy(), force="flash")
    assert first.flash_variant == "fa3"

    def refuse_fa3(r: ProbeResult) -> ProbeResult:
        why = Reason("fa3.run_failed", "FlashAttention 3 failed on a tiny problem", "run")
        variants = tuple(dataclasses.replace(v, supported=False, reasons=(why,), stage="run")
                         if v.backend == "fa3" else v for v in r.variants)  # fmt: skip
        return dataclasses.replace(r, variants=variants)

    _poison(cache, "flash", refuse_fa3)
    d = _selector(cache).decide(LLAMA, "h100:fa3=3.0.0b1", Policy(), force="flash")
    assert d.flash_variant != "fa3"
    assert {v.backend: v for v in d.result("flash").variants}["fa3"].reasons[0].code \
        == "fa3.run_failed"  # fmt: skip


@pytest.mark.parametrize("edit", [
    lambda r: dataclasses.replace(r, backend="unfused", supported=True, reasons=()),
    lambda r: dataclasses.replace(r, variants=()) if r.backend == "flash" else r,
    lambda r: dataclasses.replace(r, supported=True, reasons=()) if r.backend == "flash" else r,
], ids=["another backend's result", "flash without flavours", "flash supported, no flavour"])
def test_a_row_that_is_not_this_candidates_result_is_probed_again(edit):
    """A row the candidate's probe could not have written counts as a miss: probed again."""
    cache = MemoryCache()
    first = _selector(cache).decide(FP32, "h100", Policy())
    for b in ("fused", "flash"):
        _poison(cache, b, edit)
    sel = _selector(cache)
    d = sel.decide(FP32, "h100", Policy())
    assert sel.stats["probes"] >= 1
    assert [r.backend for r in d.results] == ["fused", "flash", "triton", "unfused"]
    assert d.chosen == first.chosen == "triton"
    assert not d.result("fused").supported and not d.result("flash").supported


def test_narrow_holds_a_probe_without_its_own_narrow_to_its_rules():
    """A probe without ``narrow`` (a plugin's own candidate) is held to what ``rules`` refuse."""
    from te_fl_attention.selector import narrow

    why = Reason("x.refused", "refused by x's rules")

    class Strict:
        name = "fused"

        def rules(self, config, device):
            return [why]

        def probe(self, config, device):
            return ProbeResult("fused", False, (why,))

    claim = ProbeResult("fused", True, stage="run", evidence="ran")
    got = narrow(Strict(), claim, FP32, profile("h100"))
    assert got is not None and not got.supported and got.reasons == (why,)
    assert narrow(Strict(), dataclasses.replace(claim, backend="flash"), FP32,
                  profile("h100")) is None  # fmt: skip


def test_an_imported_poisoned_row_cannot_widen_explain_or_select(tmp_path, new_job, capsys):
    """The issue's reproduction: export a real fp32 decision on h100, flip the fused row to
    supported, import it into a fresh store: ``explain`` and ``select()`` still refuse fused."""
    from te_fl_attention import cli, selector

    argv = ["explain", "--dtype", "fp32", "--seqlen", "256", "--num-heads", "8", "--device",
            "h100", "--json"]  # fmt: skip
    new_job("a.sqlite")
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["chosen"] != "fused"
    assert cli.main(["cache", "export", str(tmp_path / "rows.jsonl")]) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "rows.jsonl").read_text().splitlines()]
    flipped = 0
    for row in rows:
        if row.get("backend") == "fused":
            row["result"].update(supported=True, reasons=[], stage="graph_build")
            flipped += 1
    assert flipped == 1
    (tmp_path / "rows.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    new_job("b.sqlite")
    assert cli.main(["cache", "import", str(tmp_path / "rows.jsonl")]) == 0
    capsys.readouterr()
    new_job()  # explain in a new job, from the imported store only
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] != "fused"
    fused = next(r for r in out["results"] if r["backend"] == "fused")
    assert not fused["supported"] and fused["reasons"][0]["code"] == "fused.dtype"
    new_job()
    d = selector.select(FP32, "h100", Policy())
    assert d.chosen != "fused" and selector.default_selector().stats["cache_hits"] == 4


def test_recorded_fleet_results_are_held_to_the_local_rules():
    """fleet replays results recorded elsewhere (the cache, another rank) through the same
    boundary: a recording claiming fused for fp32 on h100 does not make fused the choice."""
    from te_fl_attention.fleet import replay

    sel = Selector(default_probes(graph=False))
    real = sel.decide(FP32, "h100", Policy())
    recorded = [_claims_supported(r) for r in real.results]
    d = replay(FP32, profile("h100"), recorded, sel.probes, Policy())
    assert d.chosen == "triton" and not d.result("fused").supported
    assert d.result("fused").reasons[0].code == "fused.dtype"


def test_rule_verdicts_follow_the_rule_set_and_leave_no_state_on_the_config(monkeypatch):
    """Rule verdicts are evaluated afresh (no per-object memo: it cost more than it saved on the
    new config objects a warm job sees): replacing a rule set changes the verdict at once."""
    from te_fl_attention.probes.fused import cpp as fused_cpp
    from te_fl_attention.probes.fused import probe as fused_probe
    from te_fl_attention.probes.fused import rules as fused_rules

    probe = fused_probe.CudnnProbe()
    c, d = FusedAttnConfig(**preset("llama3-8b")), profile("h100")
    assert probe.binding(c, d) == () and probe.binding(c, d) == probe.binding(c, d)
    assert set(c.__dict__) - {f.name for f in dataclasses.fields(c)} <= {"_key", "_hash"}

    def refuse_all(config, device):
        return fused_rules._r("test", "refused by a test rule", None, None)

    monkeypatch.setattr(fused_probe, "BINDING_RULES", (*fused_cpp.BINDING_RULES, refuse_all))
    assert [r.code for r in probe.binding(c, d)] == ["fused.test"]
    assert not probe.probe(c, d).supported
    monkeypatch.undo()
    assert probe.binding(c, d) == () and probe.probe(c, d).supported
    # the memo is invisible to equality, hashing and the config's JSON
    assert c == FusedAttnConfig(**preset("llama3-8b")) and c.to_dict() == LLAMA.to_dict()
    assert hash(c) == hash(LLAMA)

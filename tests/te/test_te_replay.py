"""A sample of ``benchmarks/te_replay.py``: TE's attention test configurations through TE 2.20.2's
own ``get_attention_backend`` (on CPU, cuDNN query answered by our support table) and through
our plugin's, with the same policy. Every disagreement must be listed in ``EXPLAINED``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import te_replay  # noqa: E402

from te_fl_attention.probes.flash import fa2 as flash_fa2  # noqa: E402
from te_fl_attention.probes.flash import probe as flash_probe

SAMPLE_STEP = 11


@pytest.fixture(scope="module")
def sample() -> list[te_replay.Case]:
    return list(te_replay.cases(te_replay.load_configs()))[::SAMPLE_STEP]


def test_configs_are_the_appendix() -> None:
    entries = te_replay.load_configs()
    assert len(entries) == 252
    by_file = {f: sum(e["file"] == f for e in entries) for f in
               ("test_attention.py", "test_attention_with_cp.py", "test_kv_cache.py")}
    assert by_file == {"test_attention.py": 214, "test_attention_with_cp.py": 36,
                       "test_kv_cache.py": 2}  # fmt: skip
    mla = next(e for e in entries if e["key"] == "mla_2_2")
    assert (mla["dqk"], mla["dv"], mla["kwargs"]) == (192, 128, {"attn_mask_type": "causal"})


def test_replay_sample_agrees_with_te(sample: list[te_replay.Case]) -> None:
    result = te_replay.replay(sample)
    report = te_replay.format_report(result, te_replay.DEVICES)
    assert not result["unexplained"], report
    assert result["cases"] >= 350
    te_picks = {te for (_, te, _) in result["selected"]}
    assert te_picks == {"flash", "fused", "unfused", None}, report  # every outcome exercised


def test_replay_catches_a_wrong_rule(sample: list[te_replay.Case],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FA2's head-dim rule our side accepts head dims TE refuses (base_5_1: d = 512)."""
    fa2 = tuple(r for r in flash_fa2.FA2 if r is not flash_fa2.fa2_head_dim)
    monkeypatch.setitem(flash_probe.FLAVOUR_RULES, "fa2", fa2)
    cases = [c for c in te_replay.cases(te_replay.load_configs(), ("a100",), ("bf16",))
             if c.entry[2] in ("base_5_1", "base_6_1")]
    result = te_replay.replay(cases)
    fields = {f for _, f in result["unexplained"]}
    assert {"flash", "selected"} <= fields

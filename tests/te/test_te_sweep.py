"""A small ``benchmarks/te_sweep.py``: random configs through TE 2.20.2's ``get_attention_backend``
(on CPU, its C++ fused query answered by the deviceless cuDNN graph build of what TE passes it)
and through our plugin's (graph probes). Checks the report's format, that the draws are valid and
reproducible, and that the harness reports a disagreement when one side is made wrong."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from cudnn_skip import require_cudnn

require_cudnn()

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import te_sweep  # noqa: E402

N = 40
HEADLINE = re.compile(r"^te_sweep configs=(\d+) rows=(\d+) agree=(\d+\.\d\d)% \(elapsed ")


@pytest.fixture(scope="module")
def runner():
    r = te_sweep.Sweep()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cases() -> list[te_sweep.Draw]:
    return te_sweep.draws(7, N)


def test_draws_are_seeded_and_valid(runner, cases) -> None:
    assert [c.params for c in te_sweep.draws(7, N)] == [c.params for c in cases]
    assert [c.params for c in te_sweep.draws(8, N)] != [c.params for c in cases]
    from te_fl_attention import FusedAttnConfig

    for c in cases:  # TE's AttentionParams, and our config of them, for every draw
        params = te_sweep.attention_params(runner.te.te, c)
        FusedAttnConfig.from_attention_params(params)


def test_small_sweep_report(runner, cases) -> None:
    result = te_sweep.sweep(cases, ("h100",), runner=runner)
    report = te_sweep.format_report(result)
    m = HEADLINE.match(report.splitlines()[0])
    assert m, report
    assert (int(m.group(1)), int(m.group(2))) == (N, N)
    bad = len(result["bad"])
    assert float(m.group(3)) == pytest.approx(100.0 * (N - bad) / N, abs=0.01)
    assert f"disagreements: {bad} rows in " in report
    sources = result["sources"]
    assert sources.get("TE query: cuDNN graph ok", 0) > 0, report  # TE's query reached cuDNN
    assert sources.get("ours fused: cuDNN graph", 0) > 0, report  # and so did ours


def test_sweep_detects_a_wrong_side(runner, cases, monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's C++ query made to refuse everything: every row where ours keeps FusedAttention is a
    disagreement, reported in a family with an example."""
    monkeypatch.setattr(runner, "graph", lambda params, device: (-1, "test: forced refusal"))
    result = te_sweep.sweep(cases, ("h100",), runner=runner)
    report = te_sweep.format_report(result)
    assert result["bad"], report
    assert all("fused" in r["diffs"] for r in result["bad"])
    agree = float(HEADLINE.match(report).group(3))  # type: ignore[union-attr]
    assert agree < 100.0
    family = next(line for line in report.splitlines() if line.startswith("- x"))
    assert "TE fused=False ours fused=True" in family and "forced refusal" in family, report
    assert "    e.g. h100 #" in report

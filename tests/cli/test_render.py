"""Terminal and JSON renderings of a decision (cli/render.py): hostile text is escaped, JSON
is strict."""

from __future__ import annotations

import json

import pytest


def _hostile_decision():
    import dataclasses as dc

    from te_fl_attention.config import FusedAttnConfig
    from te_fl_attention.device import profile
    from te_fl_attention.policy import Policy
    from te_fl_attention.reasons import Reason
    from te_fl_attention.selector import Selector

    d = Selector().decide(FusedAttnConfig(), profile("h100"), Policy(triton=False))
    evil = Reason("x.evil", "bad \x1b]0;pwned\x07 \x1b[31mred\x1b[0m \x9b2J \ud800 end",
                  hint="\udfff\x00")  # fmt: skip
    results = tuple(dc.replace(r, supported=False, reasons=(evil,), elapsed_ms=float("nan"),
                               detail={"x": float("inf"), "\ud801": "\udc00"})
                    if r.backend == "unfused" else r for r in d.results)  # fmt: skip
    dev = dc.replace(d.device, name="h100\x1b[2J")
    return dc.replace(d, results=results, device=dev)


def test_text_output_escapes_control_sequences_and_survives_surrogates():
    import io

    from te_fl_attention.cli import render

    buf = io.StringIO()
    render.render(_hostile_decision(), file=buf)
    text = buf.getvalue()
    text.encode("utf-8")  # no lone surrogate left
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert "\\x1b]0;pwned\\x07" in text and "\\ud800" in text


def test_json_output_is_strict():
    from te_fl_attention.cli import render

    text = render.to_json(_hostile_decision())
    text.encode("utf-8")
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    assert "\\ud8" not in text.lower()  # no escaped lone surrogate
    unfused = next(r for r in data["results"] if r["backend"] == "unfused")
    assert unfused["elapsed_ms"] is None and unfused["detail"]["x"] is None

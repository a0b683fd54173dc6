"""benchmarks/bench_compact_layout.py: its result line on a small run (every row held in the compact
layout, which gives back each row's exact text), and the masking it relies on."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from te_fl_attention.cache import pack

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compact_layout.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_compact_layout", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


def test_the_benchmark_line_on_a_small_run(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--n", "400", "--dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    line = out.strip().splitlines()[-1]
    assert line.startswith("compact_layout n=400 ")
    v = {k: float(x) for k, x in re.findall(r"(\w+)=([0-9.]+)", line)}
    assert v["fallback_rows"] == 0  # every generated row round-trips through a template
    assert 0 < v["templates"] < 400
    assert v["compact_bytes_per_row"] < v["bytes_per_row"]
    assert v["bound_per_s"] > 0 and v["compact_bound_per_s"] > 0
    assert abs(v["compact_vs_current"] - v["compact_bound_per_s"] / v["bound_per_s"]) < 0.02


def test_a_template_gives_back_each_elapsed_time_in_order():
    bench = _bench()
    text = (b'{"backend":"flash","elapsed_ms":33.0418,"variants":[{"elapsed_ms":4.3086},'
            b'{"elapsed_ms":0.0}],"detail":{"note":"\\"elapsed_ms\\":7"}}')  # fmt: skip
    values = bench._values(text)
    assert values == ["33.0418", "4.3086", "0.0"]  # (not the one inside a string)
    template = pack._ELAPSED.sub(b'"elapsed_ms":0', text)
    assert b"33.0418" not in template and b"4.3086" not in template
    assert bench._expand(template, values) == text
    assert bench._expand(template, ["1.5", "4.3086", "0.0"]) != text

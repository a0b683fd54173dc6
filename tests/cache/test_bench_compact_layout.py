"""benchmarks/bench_compact_layout.py: its result line on a small run (every row held in the compact
layout, which gives back each row's exact text, and the prototype import copying every row), the
masking it relies on, and the prototype's checks refusing a damaged row."""

from __future__ import annotations

import importlib.util
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

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
    cmd = [sys.executable, str(SCRIPT), "--n", "400", "--dir", str(tmp_path), "--rounds", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    line = out.strip().splitlines()[-1]
    assert line.startswith("compact_layout n=400 ")
    v = {k: float(x) for k, x in re.findall(r"(\w+)=([0-9.]+)", line)}
    assert v["fallback_rows"] == 0  # every generated row round-trips through a template
    assert 0 < v["templates"] < 400
    assert v["compact_bytes_per_row"] < v["bytes_per_row"]
    assert v["bound_per_s"] > 0 and v["compact_bound_per_s"] > 0
    assert abs(v["compact_vs_current"] - v["compact_bound_per_s"] / v["bound_per_s"]) < 0.02
    assert v["import_pack_per_s"] > 0 and v["compact_import_per_s"] > 0
    ratio = v["compact_import_per_s"] / v["import_pack_per_s"]
    assert abs(v["compact_import_vs_current"] - ratio) < 0.02 * ratio
    assert v["compact_split_import_per_s"] > 0 and v["migrate_per_s"] > 0
    assert v["read_us_per_row"] > 0 and v["compact_read_us_per_row"] > 0  # (texts compared)


def _compact_pack(bench, tmp_path, n=40):
    from te_fl_attention.cache import ProbeCache

    store = ProbeCache(tmp_path / "store.sqlite")
    for batch in bench._rows(n, 0, []):
        store.put_many(batch, checked=True)
    pk, compact = tmp_path / "rows.pack", tmp_path / "compact.sqlite"
    pack.export_pack(store, pk)
    store.close()
    bench._compact(pk, compact)
    return compact


@pytest.mark.parametrize("damage", [
    None,
    "UPDATE probes SET crc = (crc + 1) % 4294967296 WHERE backend = 'flash'",
    "UPDATE probes SET e1 = e1 + 0.5 WHERE backend = 'flash'",  # (a time the checksum covers)
    "UPDATE probes SET supported = 1 - supported WHERE backend = 'triton'",  # template disagrees
    # (an unknown template: the checksum covers the id too)
    "UPDATE probes SET rid = (SELECT max(rid) + 7 FROM templates) WHERE backend = 'unfused'",
])
def test_the_prototype_checks_refuse_a_damaged_row(tmp_path, damage):
    bench = _bench()
    compact = _compact_pack(bench, tmp_path)
    changed = 0
    if damage is not None:
        conn = sqlite3.connect(compact)
        with conn:
            changed = conn.execute(damage).rowcount
        conn.close()
        assert changed > 0
    refused: list = []
    bench._compact_pass(sqlite3.connect(compact), lambda lo, hi, skip: refused.extend(skip))
    assert len(refused) == changed
    for split in (False, True):  # (split: the upper half checked by a helper process)
        dest = tmp_path / f"dest-{split}.sqlite"
        if changed:  # the prototype import then copies fewer rows than the pack holds: refused
            with pytest.raises(SystemExit, match=f"copied {40 - changed} of 40"):
                bench._compact_import(compact, dest, split=split)
        else:
            assert bench._compact_import(compact, dest, split=split) > 0


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


def test_an_error_on_the_helpers_ranges_is_raised_not_lost_in_its_thread(tmp_path):
    bench = _bench()
    compact = _compact_pack(bench, tmp_path)
    seen: list = []

    def emit(lo, hi, skip):
        seen.append(hi)
        if hi is None:  # (the last range: the helper's, from the middle key on)
            raise RuntimeError("the copier failed")

    with pytest.raises(RuntimeError, match="copier failed"):
        bench._split_checks(compact, sqlite3.connect(compact), emit)
    assert None in seen and any(hi is not None for hi in seen)  # both halves were handed on

"""Export/import round trips, hostile import files, merge and warm start."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from cache_testutil import FP, key, result

from te_fl_attention.cache import (
    MemoryCache,
    ProbeCache,
    default_cache,
    export,
    import_,
    merge,
    warm_from,
)
from te_fl_attention.cache.rows import MAX_ROW, make_row, validate_row
from te_fl_attention.cache.transfer import FORMAT
from te_fl_attention.reasons import ProbeResult, Reason

HEADER = {"format": FORMAT, "format_version": 1, "package_version": "0.1.0", "exported_at": 1.0}


def rich_results() -> list[ProbeResult]:
    """Results using every field: reasons with structured values, details, flavour variants."""
    fa = [
        ProbeResult("fa2", True, elapsed_ms=0.25, evidence="flash-attn 2.8.3"),
        ProbeResult("fa3", False, (Reason("sm.unsupported", "needs sm90 — got sm80 ✗", "import",
                                          observed=80, limit=[90, 90], hint="use fa2"),)),
        ProbeResult("fa4", False, (Reason("not_installed", "flash-attn-4 is not installed",
                                          "import"),), stage="import"),
    ]  # fmt: skip
    return [
        ProbeResult("fused", True, stage="run", evidence="cudnn 9.28.1 graph", elapsed_ms=12.5,
                    detail={"sub_backend": 1, "graph": {"nodes": [1, 2, 3], "ok": True}}),
        ProbeResult("flash", True, detail={"variant": "fa2"}, variants=tuple(fa)),
        ProbeResult("triton", False, (
            Reason("head_dim.too_large", "head_dim 512 > 256", observed=512, limit=256),
            Reason("dtype", "fp8 is not supported", observed="fp8_e4m3", limit=None),
        )),
        ProbeResult("unfused", True, elapsed_ms=0.0),
    ]  # fmt: skip


def _fill(cache, n: int = 40, fp: str = FP) -> dict:
    stored = {}
    for i in range(n):
        for r in rich_results():
            k = key(i, r.backend, fp=fp)
            cache.put(k, r, config={"i": i, "window_size": [-1, 0]}, device={"name": "h100"})
            stored[k] = r
    return stored


def _write(path: Path, rows: list, header: dict | None = HEADER) -> Path:
    lines = [json.dumps(header)] if header is not None else []
    lines += [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _row(i: int, **over) -> dict:
    """An export row for ``key(i)``, with fields overridden (possibly with bad values)."""
    d = make_row(key(i), result(i), created_at=1000.0 + i).to_dict()
    d.update(over)
    return d


# ------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("target", ["sqlite", "memory"])
def test_export_import_round_trip(store, tmp_path, target):
    stored = _fill(store)
    path = tmp_path / "out.jsonl"
    assert export(store, path) == len(stored)
    fresh = ProbeCache(tmp_path / "fresh.sqlite") if target == "sqlite" else MemoryCache()
    report = import_(fresh, path)
    assert (report.imported, report.skipped, report.rejected) == (len(stored), 0, [])
    assert all(fresh.get(k) == r for k, r in stored.items())
    rows = {r.key: r for r in fresh.iter_rows()}
    assert all(rows[k].config == {"i": int(rows[k].config["i"]), "window_size": [-1, 0]}
               for k in stored)  # fmt: skip
    again = import_(fresh, path)
    assert (again.imported, again.skipped) == (0, len(stored))


def test_export_file_object_and_device_filter(store, tmp_path):
    _fill(store, 5)
    other = _fill(store, 3, fp="e" * 64)
    buf = io.StringIO()
    assert export(store, buf, device_fp="e" * 64) == len(other)
    lines = buf.getvalue().splitlines()
    assert json.loads(lines[0])["format"] == FORMAT
    fresh = MemoryCache()
    report = import_(fresh, io.StringIO(buf.getvalue()))
    assert report.imported == len(other) and set(k.device_fp for k in fresh._memo) == {"e" * 64}
    assert import_(MemoryCache(), io.BytesIO(buf.getvalue().encode())).imported == len(other)


def test_import_from_sqlite_store(store, tmp_path):
    stored = _fill(store, 5)
    store.close()
    fresh = MemoryCache()
    report = import_(fresh, store.path)
    assert report.imported == len(stored)
    assert all(fresh.get(k) == r for k, r in stored.items())


# --------------------------------------------------------------------------------- hostile files
def test_missing_or_bad_header(tmp_path):
    cache = MemoryCache()
    for header, why in [(None, "bad header"), ({**HEADER, "format": "other"}, "not a"),
                        ({**HEADER, "format_version": 2}, "format_version 2"),
                        ({**HEADER, "format_version": "1"}, "integer"),
                        ({**HEADER, "extra": 1}, "unknown field")]:  # fmt: skip
        path = _write(tmp_path / "h.jsonl", [_row(1)], header)
        report = import_(cache, path)
        assert report.imported == 0 and len(report.rejected) == 1
        assert why in report.rejected[0][1]
    (tmp_path / "empty.jsonl").write_text("")
    assert "no header" in import_(cache, tmp_path / "empty.jsonl").rejected[0][1]
    assert len(cache) == 0


def test_hostile_rows(tmp_path):
    marker = tmp_path / "PWNED"
    # A protocol-0 pickle that would create `marker` if anything ever unpickled it (hand-written:
    # this test never uses the pickle module).
    payload = f"cbuiltins\nopen\n(V{marker}\nVw\ntR."
    deep = 0
    for _ in range(40):
        deep = [deep]
    rows = [
        _row(1),                                                      # 2: ok
        _row(2, backend=7),                                           # 3: wrong type
        _row(3, result={**_row(3)["result"], "supported": "yes"}),    # 4: wrong type
        _row(4, config_key="ABC"),                                    # 5: bad hex
        _row(5, created_at="yesterday"),                              # 6: wrong type
        _row(6, evil=True),                                           # 7: unknown field
        _row(7, result={**_row(7)["result"], "exec": "rm -rf /"}),    # 8: unknown result field
        _row(1, result=result(99).to_dict()),                         # 9: duplicate key: skipped
        _row(9, result={**_row(9)["result"], "detail": {"p": payload}}),  # 10: inert string
        "{not json",                                                  # 11
        _row(11, result={**_row(11)["result"], "detail": {"x": "y" * 100_000}}),  # 12: long str
        json.dumps(_row(12))[:-1] + ',"pad":"' + "z" * (10 * 2**20) + '"}',  # 13: 10 MB line
        _row(13, result={**_row(13)["result"], "detail": {"deep": deep}}),  # 14: nesting
        "[" * 100_000 + "]" * 100_000,                                # 15: absurd nesting
        _row(15, device_fp="d" * 64),                                 # 16: foreign device: kept
        _row(16, backend="cuda"),                                     # 17: unknown backend
        _row(17, result=result(17, "flash").to_dict()),               # 18: backend mismatch
        [1, 2, 3],                                                    # 19: not an object
        _row(19, result={**_row(19)["result"], "elapsed_ms": 10**400}),  # 20: huge int
        "",                                                           # 21: blank: ignored
        _row(21, result={**_row(21)["result"], "reasons": [{"code": 1, "message": "m"}]}),  # 22
        _row(22, created_at=float("nan")),                            # 23: NaN time
        _row(23),                                                     # 24: ok
    ]  # fmt: skip
    path = tmp_path / "hostile.jsonl"
    _write(path, [r if isinstance(r, (dict, str)) else json.dumps(r) for r in rows])
    raw = b"\x80\x04\x95" + payload.encode() + b"\xff\xfe\n"  # 25..30: raw pickle, not UTF-8
    with open(path, "ab") as f:
        f.write(raw)
    cache = ProbeCache(tmp_path / "target.sqlite")
    report = import_(cache, path)
    rejected = dict(report.rejected)
    tail = list(range(25, 25 + raw.count(b"\n")))
    assert sorted(rejected) == [3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 17, 18, 19, 20, 22, 23, *tail]
    assert "unknown field(s): evil" in rejected[7]
    assert "exec" in rejected[8]
    assert "longer than" in rejected[13] and "65536" in rejected[12]
    assert "nested deeper" in rejected[14] and "nested deeper" in rejected[15]
    assert report.imported == 4 and report.skipped == 1
    assert cache.get(key(1)) == result(1)  # first occurrence won
    assert cache.get(key(9)).detail == {"p": payload}  # stored as an inert string
    assert cache.get(key(15)) is None  # foreign device: stored, never served locally
    assert cache.get(key(15)._replace(device_fp="d" * 64)) == result(15)
    assert cache.get(key(23)) == result(23)
    assert not marker.exists()


def test_import_never_overwrites(store, tmp_path):
    store.put(key(1), result(1))
    path = _write(tmp_path / "x.jsonl", [_row(1, result=result(4).to_dict()), _row(2)])
    report = import_(store, path)
    assert (report.imported, report.skipped) == (1, 1)
    assert store.get(key(1)) == result(1)


def test_validate_row_direct():
    assert isinstance(validate_row(_row(1)), object) and not isinstance(validate_row(_row(1)), str)
    assert "missing field(s): result" == validate_row({k: v for k, v in _row(1).items()
                                                       if k != "result"})  # fmt: skip
    assert validate_row("x") == "row is not a JSON object"
    assert MAX_ROW == 2**20


# ----------------------------------------------------------------------------------------- merge
def _export_rows(path: Path, rows: list) -> Path:
    cache = MemoryCache()
    cache.put_many(rows)
    export(cache, path)
    return path


def test_merge(tmp_path):
    a = _export_rows(tmp_path / "a.jsonl", [
        make_row(key(1), result(1), created_at=10), make_row(key(2), result(2), created_at=10),
        make_row(key(3), result(3), created_at=50)])  # fmt: skip
    b = _export_rows(tmp_path / "b.jsonl", [
        make_row(key(2), result(2), created_at=20),          # identical result: duplicate
        make_row(key(3), result(4), created_at=40),          # conflict, older: a wins
        make_row(key(1), result(5), created_at=30),          # conflict, newer: b wins
        make_row(key(6), result(6), created_at=5)])  # fmt: skip
    report = merge(a, b, tmp_path / "out.sqlite")
    assert (report.written, report.conflicts, report.duplicates) == (4, 2, 1)
    out = ProbeCache(tmp_path / "out.sqlite")
    assert out.get(key(1)) == result(5) and out.get(key(3)) == result(3)
    assert out.get(key(2)) == result(2) and out.get(key(6)) == result(6)
    out.close()
    # sqlite inputs, JSONL output
    report2 = merge(tmp_path / "out.sqlite", a, tmp_path / "out2.jsonl")
    assert report2.written == 4 and report2.conflicts == 1  # key 1: out has the newer result
    check = MemoryCache()
    import_(check, tmp_path / "out2.jsonl")
    assert check.get(key(1)) == result(5)
    with pytest.raises(FileExistsError):
        merge(a, b, tmp_path / "out.sqlite")


def test_merge_reports_rejections(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_row(1), _row(2, backend="nope")])
    b = tmp_path / "b.txt"
    b.write_text("garbage")
    report = merge(a, b, tmp_path / "m.sqlite")
    assert report.written == 1
    assert [(Path(s).name, n) for s, n, _ in report.rejected] == [("a.jsonl", 3), ("b.txt", 1)]


# ------------------------------------------------------------------------------------ warm start
def test_warm_from(store, tmp_path):
    stored = _fill(store, 3)
    export(store, tmp_path / "w.jsonl")
    report = warm_from(tmp_path / "w.jsonl")
    assert report.imported == len(stored)
    assert all(default_cache().get(k) == r for k, r in stored.items())
    store.close()
    again = warm_from(store.path)  # from a store file: everything already present
    assert (again.imported, again.skipped) == (0, len(stored))


def test_warm_from_is_exported_from_package():
    import te_fl_attention.cache as cache_pkg

    assert cache_pkg.warm_from is warm_from


# ------------------------------------------------------------------------------ parallel import
def _mixed_export(path: Path, n: int) -> Path:
    """Valid rows, rejects and repeated keys (with different results) spread over the file."""
    rows: list = []
    for i in range(n):
        rows.append(_row(i))
        if i % 50 == 7:
            rows.append(_row(i + 1, backend="cuda"))  # rejected
        if i % 97 == 3:
            rows.append("not json")  # rejected
        if i % 61 == 5:
            rows.append(_row(i // 3, result=result(i + 1000).to_dict()))  # repeat: first wins
    rows.append(_row(0, result=result(4242).to_dict()))  # a repeat at the very end
    return _write(path, rows)


@pytest.mark.parametrize("trouble", [None, "worker", "copy"])
def test_parallel_import_matches_serial(tmp_path, monkeypatch, trouble):
    from te_fl_attention.cache import _parallel

    path = _mixed_export(tmp_path / "big.jsonl", 3000)
    monkeypatch.setattr(_parallel, "MIN_BYTES", 0)
    if trouble == "worker":  # workers that never start: every range is redone in this process
        monkeypatch.setattr(_parallel, "_start", lambda *a: None)
    copies = []
    copy = _parallel._copy_into

    def counted(target, part):
        copies.append(part)
        if trouble == "copy" and len(copies) == 2:  # the rest is imported serially
            return None
        return copy(target, part)

    monkeypatch.setattr(_parallel, "_copy_into", counted)
    serial = ProbeCache(tmp_path / "serial.sqlite")
    parallel = ProbeCache(tmp_path / "parallel.sqlite")
    for c in (serial, parallel):  # rows already present are never overwritten
        c.put(key(5), result(555))
    want = import_(serial, path, workers=1)
    got = import_(parallel, path, workers=3)
    assert (got.imported, got.skipped) == (want.imported, want.skipped)
    assert got.rejected == want.rejected and len(want.rejected) > 50
    a = {r.key: (r.result, r.config) for r in serial.iter_rows()}
    b = {r.key: (r.result, r.config) for r in parallel.iter_rows()}
    assert a == b and parallel.get(key(0)) == result(0) and parallel.get(key(5)) == result(555)
    assert len(copies) == (2 if trouble == "copy" else 3)  # three ranges, copied in order
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".import-")]


def test_string_limit_counts_utf8_bytes(tmp_path):
    wide = "€" * 25_000  # 25k characters, 75 kB of UTF-8
    narrow = "e" * 25_000
    path = _write(tmp_path / "u.jsonl", [
        _row(1, result={**_row(1)["result"], "detail": {"w": wide}}),
        _row(2, result={**_row(2)["result"], "detail": {"n": narrow}}),
    ])  # fmt: skip
    report = import_(MemoryCache(), path)
    assert report.imported == 1 and [n for n, _ in report.rejected] == [2]
    assert "bytes (limit 65536)" in report.rejected[0][1]

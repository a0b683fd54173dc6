"""Format-2 packs (:mod:`te_fl_attention.cache.pack` in the compact layout of
:mod:`te_fl_attention.cache.compact`): round trips of compact rows, templates and base configs,
format-1 packs, hostile templates, bases and compact rows, the trust rule, and the checking
helper process (the split, its refusals, the fallback to one process, kill -9)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_testutil import (
    ROOT,
    export_fp32_pack,
    full_result,
    import_and_assert_fused_refused,
    key,
    result,
)

from te_fl_attention.cache import ProbeCache, compact, pack, transfer
from te_fl_attention.cache.rows import MAX_ROW, dumps, row_params
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.reasons import ProbeResult

DEVICE = {"name": "h100", "sm": 90}
_TABLES = {
    "contexts": "ctx",
    "bases": "base",
    "templates": "rid",
    "configs": "config_key",
    "probes": "config_key, backend, ctx",
}


def _two(i: int, backend: str = "fused") -> ProbeResult:
    """:func:`result` with a second ``elapsed_ms`` value: a template of two holes."""
    return dataclasses.replace(result(i, backend),
                               variants=(ProbeResult("fa2", True, elapsed_ms=i / 5),))  # fmt: skip


def _result(i: int, backend: str) -> ProbeResult:
    """Row ``i``'s result: mostly compact rows of one or two holes, every tenth a full row."""
    return full_result(i, backend) if i % 10 == 9 else _two(i, backend) if i % 5 == 2 else (
        result(i, backend))  # fmt: skip


def _fill(store: ProbeCache, n: int, start: int = 0) -> None:
    """``n`` configs (each a real ``FusedAttnConfig``: stored as its fields that differ from the
    base) with a fused and a flash row each."""
    store.put_many([(key(i, b), _result(i, b),
                     FusedAttnConfig(num_heads=1 + i % 32, max_seqlen_q=128 + i).to_dict(), DEVICE)
                    for i in range(start, start + n) for b in ("fused", "flash")])  # fmt: skip


def _tables(path: Path) -> dict[str, list[tuple]]:
    """Every row of a store's or a pack's tables, as stored (byte for byte)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY {order}").fetchall()
                for t, order in _TABLES.items()}  # fmt: skip
    finally:
        conn.close()


def _rows(store: ProbeCache) -> dict:
    return {r.key: r.to_dict() for r in store.iter_rows()}


def _one(path: Path, sql: str, params: tuple = ()) -> tuple:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchone()
    finally:
        conn.close()


def _forge(path: Path, *statements: tuple[str, tuple]) -> None:
    """Change a pack behind the exporter's back (CHECKs not enforced: a hostile writer)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA ignore_check_constraints=ON")
    for sql, params in statements:
        conn.execute(sql, params)
    conn.close()


_ROW = ("SELECT ctx, rid, elapsed_ms, e1, e2, e3 FROM probes WHERE config_key = ? AND"
        " backend = ?")  # fmt: skip


def _set_compact(path: Path, i: int, backend: str, crc_as: dict | None = None,
                 **columns) -> None:  # fmt: skip
    """Give row ``i``/``backend`` of a pack new compact ``columns`` (``rid``, ``elapsed_ms``,
    ``e1``..``e3``) with its checksum made right for them (or for ``crc_as``'s values, where a
    column is given a value of another type)."""
    ck = key(i, backend)[0]
    ctx, *values = _one(path, _ROW, (ck, backend))
    now = dict(zip(["rid", "elapsed_ms", "e1", "e2", "e3"], values, strict=True))
    now.update(columns, **(crc_as or {}))
    crc = compact.compact_crc(ck, backend, ctx, *now.values())
    sets = ", ".join(f"{c} = ?" for c in columns)
    _forge(path, (f"UPDATE probes SET {sets}, crc = ? WHERE config_key = ? AND backend = ?",
                  (*columns.values(), crc, ck, backend)))  # fmt: skip


def _add_template(path: Path, text: str, backend: str, supported: int, stage: str) -> int:
    """Store a template of text ``text`` under its right id (and right holes) in a pack."""
    rid = compact.text_id(text.encode())
    holes = len(compact.HOLE.findall(text.encode()))
    _forge(path, ("INSERT OR REPLACE INTO templates VALUES (?, ?, ?, ?, ?, ?)",
                  (rid, backend, supported, stage, holes, text)))  # fmt: skip
    return rid


def _template_of(path: Path, i: int, backend: str) -> str:
    return _one(path, "SELECT t.template FROM probes p JOIN templates t ON t.rid = p.rid WHERE"
                " p.config_key = ? AND p.backend = ?",
                (key(i, backend)[0], backend))[0]  # fmt: skip


def _exported(store: ProbeCache, path: Path, n: int) -> tuple[ProbeCache, Path]:
    """``store`` filled with ``n`` configs (:func:`_fill`), exported as the pack ``path``."""
    _fill(store, n)
    assert pack.export_pack(store, path) == 2 * n
    return store, path


@pytest.fixture
def packed(store, tmp_path):
    return _exported(store, tmp_path / "rows.pack", 30)


def _fresh(tmp_path: Path, name: str = "fresh.sqlite") -> ProbeCache:
    """A store holding one row of its own (stored at a fixed time: stores compare equal)."""
    fresh = ProbeCache(tmp_path / name)
    fresh.put(key(1000), result(1000))
    fresh.run(lambda c: c.execute("UPDATE probes SET created_at = 1000.0"), write=True, miss=None)
    return fresh


def _without(tables: dict[str, list[tuple]], *keys: tuple[int, str]) -> list[tuple]:
    """The probes rows of ``tables`` less rows ``(i, backend)``."""
    out = {(key(i, b)[0], b) for i, b in keys}
    return [r for r in tables["probes"] if (r[0], r[1]) not in out]


# ------------------------------------------------------------------------------------ round trip
def test_a_format_2_pack_imports_compact_rows_templates_and_bases_byte_for_byte(packed, tmp_path):
    store, path = packed
    src = _tables(store.path)
    got = _tables(path)
    compact_rows = [r for r in got["probes"] if r[10] is not None]
    assert len(compact_rows) == 54 and {r[9] for r in compact_rows} == {""}  # 6 full rows
    assert {t[4] for t in got["templates"]} == {1, 2} and len(got["bases"]) == 1
    assert all(c[2] == got["bases"][0][0] for c in got["configs"])
    assert got == src  # the pack holds the store's rows as they are stored
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, path)
    assert (report.imported, report.skipped, report.rejected) == (60, 0, [])
    assert _tables(fresh.path) == src  # rows, templates, bases, configs: byte for byte
    assert _rows(fresh) == _rows(store)  # (configs rebuilt from their base, devices...)
    assert fresh.get(key(2, "flash")) == _two(2, "flash")
    assert fresh.get(key(9, "fused")) == full_result(9, "fused")
    assert fresh.check_integrity() is None


def _format_1_pack(store: ProbeCache, path: Path) -> int:
    """Write ``store``'s rows as a format-1 pack (every row in full), as a format-1 exporter
    did (the CHECKs enforced: legal format-1 rows)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA application_id={pack.PACK_APPLICATION_ID}")
    conn.execute("PRAGMA user_version=1")
    for ddl in pack.PACK_SCHEMA_1.values():
        conn.execute(ddl)
    conn.execute("BEGIN")
    n = 0
    for row in store.iter_rows():
        p = row_params(row)
        conn.execute(f"INSERT INTO probes VALUES ({','.join('?' * 10)})", p)
        conn.execute("INSERT OR IGNORE INTO contexts VALUES (?, ?, ?, ?)",
                     (p[2], row.key.device_fp, row.key.versions_key, dumps(row.device)))
        conn.execute("INSERT OR IGNORE INTO configs VALUES (?, ?)",
                     (row.key.config_key, dumps(row.config)))  # fmt: skip
        n += 1
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [
        ("format", pack.PACK_FORMAT), ("format_version", "1"), ("package_version", "0.0.1"),
        ("rows", str(n)), ("exported_at", repr(time.time()))])  # fmt: skip
    conn.execute("COMMIT")
    conn.close()
    return n


def test_a_format_1_pack_still_imports_and_its_rows_read_back_right(packed, tmp_path):
    store, _ = packed
    old = tmp_path / "old.pack"
    assert _format_1_pack(store, old) == 60 and pack.is_pack(old)
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, old)
    assert (report.imported, report.skipped, report.rejected) == (60, 0, [])
    assert _rows(fresh) == _rows(store)
    assert fresh.get(key(2, "fused")) == _two(2, "fused")
    assert fresh.check_integrity() is None
    # a damaged full row of a format-1 pack is still caught by its checksum
    _forge(old, ("UPDATE probes SET crc = crc + 1 WHERE config_key = ? AND backend = 'flash'",
                 (key(4)[0],)))  # fmt: skip
    again = transfer.import_(ProbeCache(tmp_path / "again.sqlite"), old)
    assert again.imported == 59 and [r for _, r in again.rejected] == ["checksum mismatch"]


@pytest.mark.parametrize("first_old", [True, False])
def test_the_same_rows_in_format_1_and_format_2_packs_merge_as_duplicates(packed, tmp_path,
                                                                          first_old):  # fmt: skip
    """The same rows, stored in full (format 1) or compact (format 2): a merge finds the same
    results (duplicates), not conflicts."""
    store, path = packed
    old = tmp_path / "old.pack"
    _format_1_pack(store, old)
    merged = transfer.merge(*((old, path) if first_old else (path, old)), tmp_path / "m.sqlite")
    assert (merged.written, merged.duplicates, merged.conflicts) == (60, 60, 0)


# --------------------------------------------------------------------------------- hostile packs
def _forged_base(text: str) -> list[tuple[str, tuple]]:
    """Statements storing a base config of text ``text`` under its right id, used by every
    config."""
    bid = compact.text_id(text.encode())
    return [("INSERT INTO bases VALUES (?, ?)", (bid, text)), ("UPDATE configs SET base = ?",
                                                               (bid,))]  # fmt: skip


HOSTILE = {
    "template_text": [("UPDATE templates SET template = replace(template, 'rules', 'rulez')", ())],
    "template_more_holes": [("UPDATE templates SET holes = 2 WHERE holes = 1", ())],
    "template_fewer_holes": [("UPDATE templates SET holes = 1 WHERE holes = 2", ())],
    "template_id": [("UPDATE templates SET rid = rid + 1", ())],
    "template_checks": [("UPDATE templates SET supported = 7", ())],
    "template_not_object": [("UPDATE templates SET template = '[0]'", ())],
    "base_text": [("UPDATE bases SET config = replace(config, 'bf16', 'fp32')", ())],
    "base_not_object": _forged_base("[1]"),
    "base_not_flat": _forged_base('{"a":{"b":1}}'),
    "base_cleaned": _forged_base('{"a":"bell\\u0007"}'),
}
REFUSALS = {
    **{k: "template [0-9]+ is not the template its id names" for k in HOSTILE
       if k.startswith("template")},  # fmt: skip
    "base_text": "base config [0-9]+ is not the config its id names",
    "base_not_object": "base config [0-9]+ is not the config its id names",
    "base_not_flat": "base config [0-9]+ fails the checks of a config",
    "base_cleaned": "base config [0-9]+ fails the checks of a config",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_pack_with_a_bad_template_or_base_is_refused_and_nothing_applied(packed, tmp_path,
                                                                           kind):  # fmt: skip
    store, path = packed
    _forge(path, *HOSTILE[kind])
    fresh = _fresh(tmp_path)
    before = _tables(fresh.path)
    with pytest.raises(pack.PackError, match=f"^{REFUSALS[kind]}$"):
        transfer.import_(fresh, path)
    assert _tables(fresh.path) == before and fresh.check_integrity() is None
    with pytest.raises(pack.PackError):
        transfer.merge(path, store.path, tmp_path / "m.sqlite")
    assert not (tmp_path / "m.sqlite").exists()


_DEEP = '{"a":' + "[" * 1500 + "]" * 1500 + "}"  # valid JSON to SQLite, too deep for Python


@pytest.mark.parametrize("where", ["base", "device"])
def test_a_deeply_nested_base_or_device_is_refused_by_name(packed, tmp_path, where):
    _, path = packed
    _forge(path, *(_forged_base(_DEEP) if where == "base" else [
        ("UPDATE contexts SET device = ?", (_DEEP,))]))  # fmt: skip
    fresh = _fresh(tmp_path)
    before = _tables(fresh.path)
    with pytest.raises(pack.PackError):
        transfer.import_(fresh, path)
    assert _tables(fresh.path) == before


def _other_backend(path: Path) -> None:  # a flash row naming the fused row's template
    _set_compact(path, 1, "flash", rid=_one(path, _ROW, (key(1)[0], "fused"))[1])


#: Compact rows that break a rule (their checksum made right): each is rejected (counted), and
#: every other row imported as it is.
BAD_ROWS = {
    "supported": (1, lambda p: _forge(p, ("UPDATE probes SET supported = 0 WHERE config_key = ?"
                                          " AND backend = 'fused'", (key(1)[0],)))),
    "stage": (1, lambda p: _forge(p, ("UPDATE probes SET stage = 'graph_build' WHERE"
                                      " config_key = ? AND backend = 'fused'", (key(1)[0],)))),
    "other_backend": (1, _other_backend),
    "value_past_the_holes": (1, lambda p: _set_compact(p, 1, "fused", e1=1.5)),
    "missing_value": (2, lambda p: _set_compact(p, 2, "fused", e1=None)),
    "values_with_a_gap": (2, lambda p: _set_compact(p, 2, "fused", e1=None, e2=0.4)),
    "value_out_of_range": (2, lambda p: _set_compact(p, 2, "fused", e1=2e9)),
    "value_of_text": (2, lambda p: _set_compact(p, 2, "fused", {"e1": 0.4}, e1="0.4 ms")),
    "value_of_blob": (2, lambda p: _set_compact(p, 2, "fused", {"e1": 0.4}, e1=b"\x00")),
    "negative_elapsed": (1, lambda p: _set_compact(p, 1, "fused", elapsed_ms=-1.0)),
    "missing_template": (1, lambda p: _set_compact(p, 1, "fused", rid=12345)),
    "template_of_text": (1, lambda p: _set_compact(p, 1, "fused", {"rid": 7}, rid="id 7")),
    "deleted_template": (1, lambda p: _forge(p, ("DELETE FROM templates WHERE rid = ?", (
        _one(p, _ROW, (key(1)[0], "fused"))[1],)))),
    "text_beside_a_template": (1, lambda p: _forge(p, (
        "UPDATE probes SET result = ? WHERE config_key = ? AND backend = 'fused'",
        (dumps(result(1).to_dict()), key(1)[0])))),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_a_compact_row_that_breaks_a_rule_is_rejected_and_no_other_row_is_touched(
        packed, tmp_path, kind):  # fmt: skip
    store, path = packed
    i, damage = BAD_ROWS[kind]
    damage(path)
    fresh = _fresh(tmp_path)
    own = _tables(fresh.path)["probes"]
    report = transfer.import_(fresh, path)
    assert (report.imported, [r for _, r in report.rejected]) == (59, [pack._FAILS_SQL])
    bad = (i, "flash" if kind == "other_backend" else "fused")
    assert fresh.get(key(*bad)) is None
    assert _tables(fresh.path)["probes"] == sorted(own + _without(_tables(store.path), bad))
    assert len(list(fresh.iter_rows())) == len(fresh) == 60 and fresh.check_integrity() is None


def test_a_compact_row_whose_checksum_is_wrong_is_rejected(packed, tmp_path):
    store, path = packed
    _forge(path, ("UPDATE probes SET e1 = 0.5 WHERE config_key = ? AND backend = 'flash'",
                  (key(2)[0],)))  # (a value changed, the checksum not)
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert (report.imported, [r for _, r in report.rejected]) == (59, ["checksum mismatch"])
    assert fresh.get(key(2, "flash")) is None


def _retemplate(path: Path, i: int, edit, supported: int | None = None) -> str:
    """Point row ``i``'s fused row at a new template (right id, holes and checksum): its own
    template's text changed by ``edit`` (its columns as they were, or ``supported``)."""
    old = _template_of(path, i, "fused")
    text = edit(old)
    _, backend, was, stage, _, _ = _one(path, "SELECT * FROM templates WHERE template = ?",
                                        (old,))  # fmt: skip
    rid = _add_template(path, text, backend, was if supported is None else supported, stage)
    _set_compact(path, i, "fused", rid=rid)
    return text


def test_rows_of_a_template_the_validator_cleans_are_stored_cleaned(packed, tmp_path):
    """A template the validator accepts only once cleaned (a control character): its rows go
    one by one through the full validator, stored cleaned."""
    _, path = packed
    _retemplate(path, 1, lambda t: t.replace('"rules #1"', '"bell\\u0007"'))
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert (report.imported, report.rejected) == (60, [])
    assert fresh.get(key(1)).evidence == "bell\ufffd"
    stored = _one(fresh.path, "SELECT t.template FROM probes p JOIN templates t ON t.rid = p.rid"
                  " WHERE p.config_key = ? AND p.backend = 'fused'", (key(1)[0],))[0]  # fmt: skip
    assert json.loads(stored)["evidence"] == "bell\ufffd"


def test_rows_of_a_template_the_validator_refuses_are_rejected(packed, tmp_path):
    _, path = packed
    _retemplate(path, 1, lambda t: t.replace('"detail":{}', '"detail":{},"extra":1'))
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert report.imported == 59 and len(report.rejected) == 1
    assert "unknown field" in report.rejected[0][1] and fresh.get(key(1)) is None


def test_rows_of_a_template_whose_columns_lie_are_stored_as_its_text_says(packed, tmp_path):
    """A template (and its row) claiming ``supported`` where its text says not: the row goes
    through the full validator and is stored as the text says."""
    _, path = packed
    assert not result(3).supported
    _retemplate(path, 3, lambda t: t.replace('"rules"', '"rules!"'), supported=1)
    _forge(path, ("UPDATE probes SET supported = 1 WHERE config_key = ? AND backend = 'fused'",
                  (key(3)[0],)))  # fmt: skip
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert (report.imported, report.rejected) == (60, [])
    assert not fresh.get(key(3)).supported
    assert _one(fresh.path, "SELECT p.supported, t.supported FROM probes p JOIN templates t ON"
                " t.rid = p.rid WHERE p.config_key = ? AND p.backend = 'fused'",
                (key(3)[0],)) == (0, 0)  # fmt: skip


def test_a_lying_template_no_row_uses_does_not_poison_the_store(packed, tmp_path):
    """A pack's template whose ``supported`` column contradicts its text must not end up in the
    store: an honest pack's row of that text imported later keeps it (``INSERT OR IGNORE``), and
    an export of that row would then be rejected by every importer (its template disagrees)."""
    _, path = packed
    lying = tmp_path / "lying.pack"
    shutil.copyfile(path, lying)
    rid = compact.text_id(_template_of(path, 3, "fused").encode())  # unsupported (3 % 3 == 0)
    _forge(lying, ("UPDATE templates SET supported = 1 WHERE rid = ?", (rid,)),
           ("DELETE FROM probes WHERE rid = ?", (rid,)),
           ("UPDATE meta SET value = '59' WHERE name = 'rows'", ()))  # fmt: skip
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    assert transfer.import_(fresh, lying).imported == 59
    assert transfer.import_(fresh, path).imported == 1  # the honest row of that template
    out = tmp_path / "again.pack"
    pack.export_pack(fresh, out)
    report = transfer.import_(ProbeCache(tmp_path / "other.sqlite"), out)
    assert (report.imported, report.rejected) == (60, [])


# ---------------------------------------------------------------------------------- trust rule
def test_a_forged_compact_row_claiming_fused_for_fp32_cannot_make_select_choose_it(
        tmp_path, new_job, capsys):  # fmt: skip
    """As test_pack's full-row case, forged in the compact layout: a template claiming
    supported for fused on an fp32 config (right id, holes and row checksum) imports, and is
    copied as it is (the validator accepts it), yet ``select()`` still refuses fused."""
    out = tmp_path / "rows.pack"
    export_fp32_pack(new_job, capsys, out)
    (ck, ctx, el, e1, e2, e3, text), = _rows_of(out, "p.backend = 'fused' AND p.rid IS NOT NULL")
    full = compact.expand(compact.pieces(text.encode()), el, e1, e2, e3).decode()
    res = json.loads(full)
    res.update(supported=True, reasons=[], stage="graph_build")
    forged = dumps(res)
    t, f1, f2, f3 = compact.split_result(forged, "fused", 1, "graph_build", el)
    _add_template(out, t.text, "fused", 1, "graph_build")
    crc = compact.compact_crc(ck, "fused", ctx, t.rid, el, f1, f2, f3)
    conn = sqlite3.connect(out, isolation_level=None)  # (CHECKs enforced: a legal row)
    conn.execute("UPDATE probes SET rid = ?, e1 = ?, e2 = ?, e3 = ?, supported = 1,"
                 " stage = 'graph_build', crc = ? WHERE backend = 'fused'",
                 (t.rid, f1, f2, f3, crc))  # fmt: skip
    conn.close()

    def copied_as_is() -> None:  # the forged template, copied as it is
        stored = _rows_of(tmp_path / "b.sqlite", "p.backend = 'fused'")
        assert [r[-1] for r in stored] == [t.text]

    import_and_assert_fused_refused(new_job, capsys, out, copied_as_is)


def _rows_of(path: Path, where: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT p.config_key, p.ctx, p.elapsed_ms, p.e1, p.e2, p.e3,"
                            " t.template FROM probes p JOIN templates t ON t.rid = p.rid"
                            f" WHERE {where}").fetchall()  # fmt: skip
    finally:
        conn.close()


# --------------------------------------------------------------------------- the checking helper
@pytest.fixture
def helper(monkeypatch) -> list[str]:
    """Packs of 10 rows or more are split (as on two CPUs); the lower bounds of the helpers
    started, as they start."""
    monkeypatch.setattr(pack, "SPLIT_MIN_ROWS", 10)
    monkeypatch.setattr(pack, "_cpus", lambda: 2)
    started: list[str] = []
    real = pack.Helper.start.__func__

    def start(cls, job, emit):
        started.append(job["lo"])
        return real(cls, job, emit)

    monkeypatch.setattr(pack.Helper, "start", classmethod(start))
    return started


@pytest.fixture
def big(store, tmp_path):
    return _exported(store, tmp_path / "big.pack", 150)


def _middle(path: Path) -> str:
    """The first config key of the pack's rows the helper checks (with :func:`helper` on)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        mid = pack._middle(conn, conn.execute("SELECT count(*) FROM probes").fetchone()[0])
    finally:
        conn.close()
    assert type(mid) is str
    return mid


def _one_process(path: Path, where: Path, monkeypatch) -> tuple:
    """The import of ``path`` into a new store ``where`` in one process: its report, its tables."""
    with monkeypatch.context() as m:
        m.setattr(pack, "SPLIT_MIN_ROWS", 10**9)
        report = transfer.import_(_fresh(where.parent, where.name), path)
    return report, _tables(where)


def test_a_large_pack_is_checked_half_by_a_helper_and_imports_the_same(big, tmp_path, helper,
                                                                       monkeypatch):  # fmt: skip
    store, path = big
    alone, alone_tables = _one_process(path, tmp_path / "alone.sqlite", monkeypatch)
    assert helper == []
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert helper == [_middle(path)]  # one helper, on the upper half
    assert (report.imported, report.skipped, report.rejected) == (300, 0, [])
    assert (alone.imported, alone.rejected) == (300, [])
    assert _tables(fresh.path) == alone_tables
    assert {k: v for k, v in _rows(fresh).items() if k != key(1000)} == _rows(store)
    again = transfer.import_(fresh, path)
    assert (again.imported, again.skipped) == (0, 300) and len(helper) == 2


def test_damaged_rows_in_either_half_are_rejected_as_in_one_process(big, tmp_path, helper,
                                                                    monkeypatch):  # fmt: skip
    _, path = big
    mid = _middle(path)
    compact_rows = sorted((key(i)[0], i) for i in range(150) if i % 10 != 9)
    low = [i for ck, i in compact_rows if ck < mid]
    high = [i for ck, i in compact_rows if ck >= mid]
    for i in (low[3], high[0], high[7], high[-1]):
        _forge(path, ("UPDATE probes SET crc = crc + 1 WHERE config_key = ? AND backend ="
                      " 'flash'", (key(i)[0],)))  # fmt: skip
    _forge(path, ("UPDATE probes SET supported = 1 - supported WHERE config_key = ? AND"
                  " backend = 'fused'", (key(high[5])[0],)),
           ("UPDATE probes SET created_at = ? WHERE config_key = ?",
            (time.time() + 1e6, key(high[9])[0])))  # fmt: skip
    for i in (low[5], high[11]):  # rows for the full validator (stored cleaned), from either half
        _retemplate(path, i, lambda t: t.replace('"evidence":"', '"evidence":"\\u0007'))
    alone, alone_tables = _one_process(path, tmp_path / "alone.sqlite", monkeypatch)
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert helper == [mid]
    assert len(report.rejected) == 7 and report.imported == 293
    assert (report.imported, report.skipped, report.rejected) == (
        alone.imported, alone.skipped, alone.rejected)  # the same rows, numbered the same
    assert _tables(fresh.path) == alone_tables
    assert all(fresh.get(key(i)).evidence.startswith("\ufffd") for i in (low[5], high[11]))


def _huge_row(half: str):
    def damage(path: Path) -> None:
        ck = _one(path, f"SELECT max(config_key) FROM probes WHERE config_key {half} ?",
                  (_middle(path),))[0]  # fmt: skip
        _forge(path, ("UPDATE probes SET result = result || ? WHERE config_key = ? AND backend ="
                      " 'fused'", (" " * (MAX_ROW + 10), ck)))  # fmt: skip
    return damage


#: Packs refused by the checks of the upper half (the helper's) or the lower one (this process's).
REFUSED = {
    "huge_row_upper": (_huge_row(">="), rf"a row of [0-9]+ bytes \(limit {MAX_ROW}\)"),
    "huge_row_lower": (_huge_row("<"), rf"a row of [0-9]+ bytes \(limit {MAX_ROW}\)"),
    # the first key, typed as a blob, sorts after every text key: the helper's scan meets it
    # after a greater key
    "out_of_order_upper": (lambda p: _forge(p, (
        "UPDATE probes SET config_key = CAST(config_key AS BLOB) WHERE config_key = (SELECT"
        " min(config_key) FROM probes) AND backend = 'flash'", ())),
        r"the pack's rows are not in key order \(a damaged file\)"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_pack_refused_in_either_half_applies_nothing(big, tmp_path, helper, monkeypatch, kind):
    """A refusal met by the helper (or by this process beside it) refuses the pack: it is not
    checked again in one process, and nothing is applied."""
    _, path = big
    damage, refusal = REFUSED[kind]
    damage(path)
    tries = []
    real = pack._copy_pack

    def copy_pack(*args):
        tries.append(args[3:])
        return real(*args)

    monkeypatch.setattr(pack, "_copy_pack", copy_pack)
    fresh = _fresh(tmp_path)
    before = _tables(fresh.path)
    with pytest.raises(pack.PackError, match=f"^{refusal}$"):
        transfer.import_(fresh, path)
    assert helper == [_middle(path)] and tries == [(True,)]
    assert _tables(fresh.path) == before and fresh.check_integrity() is None


@pytest.mark.parametrize("how", ["no_interpreter", "missing_interpreter", "start_fails"])
def test_a_helper_that_cannot_start_falls_back_to_one_process(big, tmp_path, helper, monkeypatch,
                                                              cache_log, how):  # fmt: skip
    store, path = big
    alone, alone_tables = _one_process(path, tmp_path / "alone.sqlite", monkeypatch)
    if how == "start_fails":
        def start(cls, job, emit):
            helper.append(job["lo"])
            raise pack.HelperFailed("no way")

        monkeypatch.setattr(pack.Helper, "start", classmethod(start))
    else:
        monkeypatch.setattr(sys, "executable",
                            "" if how == "no_interpreter" else str(tmp_path / "no-python"))
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    assert helper == [_middle(path)]  # tried once, then checked in this process
    assert (report.imported, report.rejected) == (300, [])
    assert _tables(fresh.path) == alone_tables
    assert [m for m in cache_log.at(20) if "checking helper failed" in m]


_DIES = """
import os, sys


class _Dies:
    def __init__(self, out, at):
        self.out, self.at = out, at

    def write(self, text):
        if self.at in text:
            os._exit(3)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


if os.environ.get("TE_TEST_HELPER_DIES"):
    sys.stdout = _Dies(sys.stdout, os.environ["TE_TEST_HELPER_DIES"])
"""


@pytest.mark.parametrize("at", ['"r"', '"done"'])
def test_a_helper_that_dies_falls_back_to_one_process(big, tmp_path, helper, monkeypatch,
                                                      cache_log, at):  # fmt: skip
    """The helper dies before it hands on its range, or after (its range copied already): the
    import is rolled back and checked again in one process, and imports every row once."""
    store, path = big
    _forge(path, ("UPDATE probes SET crc = crc + 1 WHERE config_key = ? AND backend = 'flash'",
                  (max(key(i)[0] for i in range(150)),)))  # one rejected row in the upper half
    alone, alone_tables = _one_process(path, tmp_path / "alone.sqlite", monkeypatch)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_DIES)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("TE_TEST_HELPER_DIES", at)
    sent = []
    real_emit = pack._Copier.emit

    def emit(self, lo, hi, skip):
        sent.append((lo, str(hi)))
        return real_emit(self, lo, hi, skip)

    monkeypatch.setattr(pack._Copier, "emit", emit)
    fresh = _fresh(tmp_path)
    report = transfer.import_(fresh, path)
    mid = _middle(path)
    assert helper == [mid]
    died = [m for m in cache_log.at(20) if "checking helper failed" in m]
    assert len(died) == 1 and "exit status 3" in died[0]
    # the lower half's range, the helper's (when it died after handing it on), one process's
    want = [("", mid), ("", "None")] + ([(mid, "None")] if at == '"done"' else [])
    assert sorted(sent) == sorted(want)
    assert (report.imported, report.skipped, len(report.rejected)) == (299, 0, 1)
    assert report.rejected == alone.rejected and _tables(fresh.path) == alone_tables


_IMPORTER = """
import sys
from te_fl_attention.cache import ProbeCache, pack, transfer
pack.SPLIT_MIN_ROWS, pack._cpus = 10, lambda: 2
real = pack.Helper.start.__func__


def start(cls, job, emit):
    helper = real(cls, job, emit)
    print("helper", helper.proc.pid, flush=True)
    return helper


pack.Helper.start = classmethod(start)
transfer.import_(ProbeCache(sys.argv[1]), sys.argv[2])
print("done", flush=True)
"""


def _gone(pid: int, timeout: float) -> bool:
    """Wait until process ``pid`` has ended (or is a zombie)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def test_kill_9_of_an_importer_with_a_helper_leaves_all_or_none(store, tmp_path):
    _fill(store, 2000)
    path = tmp_path / "rows.pack"
    n = pack.export_pack(store, path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    seen = {}
    for delay in (0.0, 0.02, 0.04, 0.2):  # (the helper has read its job: it checks)
        target = tmp_path / f"t{delay}.sqlite"
        ProbeCache(target).put(key(0, "triton"), result(0, "triton"))
        child = subprocess.Popen([sys.executable, "-c", _IMPORTER, str(target), str(path)],
                                 env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = child.stdout.readline().split()
        assert line[0] == "helper", line
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
        pid = int(line[1])
        if not _gone(pid, 20):  # (the orphaned helper ends at its next write to the pipe)
            os.kill(pid, signal.SIGKILL)
        check = ProbeCache(target)
        assert check.check_integrity() is None
        rows = len(check) - 1
        assert rows in (0, n)
        seen[delay] = rows
        check.close()
    assert seen[0.0] == 0  # killed while its helper was starting: nothing applied
    print("kill -9 left", seen, "of", n)

"""SQLite packs (:mod:`te_fl_attention.cache.pack`): export/import/merge, the conflict rules,
hostile and corrupt packs, a store that cannot be written, concurrency and kill -9, and the trust
rule (a pack row cannot widen what the local rules refuse)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from cache_testutil import (
    FP,
    ROOT,
    VK,
    export_fp32_pack,
    import_and_assert_fused_refused,
    key,
    result,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import ProbeCache, compact, pack, transfer
from te_fl_attention.cache import rows as rows_mod
from te_fl_attention.cache.keys import CacheKey
from te_fl_attention.cache.rows import MAX_ROW, row_crc
from te_fl_attention.reasons import ProbeResult


def _fill(store: ProbeCache, n: int, start: int = 0, *, created_at: float | None = None) -> None:
    items = [(key(i, b), result(i, b), {"num_heads": i, "window": [-1, -1]},
              {"name": "h100", "sm": 90}) for i in range(start, start + n)
             for b in ("fused", "flash")]  # fmt: skip
    store.put_many(items)
    if created_at is not None:
        store.run(lambda c: c.execute("UPDATE probes SET created_at = ?", (created_at,)),
                  write=True, miss=None)  # fmt: skip


def _rows(store: ProbeCache) -> dict[CacheKey, dict]:
    return {r.key: r.to_dict() for r in store.iter_rows()}


@pytest.fixture
def packed(store, tmp_path):
    _fill(store, 20)
    path = tmp_path / "rows.pack"
    assert pack.export_pack(store, path) == 40
    return store, path


def _edit(path, *sql: str, params=()) -> None:
    """Change a pack file behind the exporter's back (CHECKs not enforced: a hostile writer)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA ignore_check_constraints=ON")
    conn.execute("PRAGMA writable_schema=ON")
    for i, q in enumerate(sql):
        conn.execute(q, params if i == 0 else ())
    conn.close()


def _resign(ck: str, text: str, columns: str = "") -> str:
    """SQL that makes config ``ck``'s fused row of a pack a full row (no template) of result
    ``text`` with its right checksum (and ``columns``, more ``SET`` assignments)."""
    crc = row_crc(CacheKey(ck, "fused", FP, VK), text)
    return (f"UPDATE probes SET result = '{text}', crc = {crc}, rid = NULL, e1 = NULL, e2 = NULL,"
            f" e3 = NULL{columns} WHERE config_key = '{ck}' AND backend = 'fused'")  # fmt: skip


def _results(conn: sqlite3.Connection, where: str) -> list[tuple[str, int, str]]:
    """``(config_key, ctx, result text)`` of a pack's rows matching ``where`` (on ``p``), a
    compact row's text rebuilt from its template."""
    out = []
    for ck, ctx, text, template, *values in conn.execute(
            "SELECT p.config_key, p.ctx, p.result, t.template, p.elapsed_ms, p.e1, p.e2, p.e3"
            f" FROM probes p LEFT JOIN templates t ON t.rid = p.rid WHERE {where}"):  # fmt: skip
        if template is not None:
            text = compact.expand(compact.pieces(template.encode()), *values).decode()
        out.append((ck, ctx, text))
    return out


def _count(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM probes").fetchone()[0]
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ round trip
def test_round_trip_keeps_rows_and_keys(packed, tmp_path):
    store, path = packed
    assert pack.is_pack(path) and not pack.is_pack(store.path)
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, path)
    assert (report.imported, report.skipped, report.rejected) == (40, 0, [])
    assert _rows(fresh) == _rows(store)
    assert {r.key for r in fresh.iter_rows()} == {r.key for r in store.iter_rows()}
    assert fresh.get(key(4, "flash")) == result(4, "flash")
    again = transfer.import_(fresh, path)
    assert (again.imported, again.skipped) == (0, 40)
    assert fresh.check_integrity() is None


def test_export_writes_a_new_file_only_and_filters_by_device(store, tmp_path):
    _fill(store, 3)
    other = "ab" * 32
    store.put(key(99, "fused", fp=other), result(99), device={"name": "a100"})
    path = tmp_path / "a.pack"
    assert pack.export_pack(store, path, device_fp=other) == 1
    with pytest.raises(FileExistsError):
        pack.export_pack(store, path)
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".a.pack")] == []
    assert _count(path) == 1


def test_the_pack_schema_carries_the_checks(packed):
    _, path = packed
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE probes SET created_at = -1")
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE probes SET result = '{\"backend\": \"evil\"}'")
    with pytest.raises(sqlite3.IntegrityError):  # (a full row's text is checked as in format 1)
        conn.execute("UPDATE probes SET result = '{\"backend\": \"evil\"}', rid = NULL,"
                     " e1 = NULL, e2 = NULL, e3 = NULL")  # fmt: skip
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE templates SET holes = 9")
    conn.close()


def test_import_never_overwrites_and_merge_keeps_the_newer(tmp_path):
    old = ProbeCache(tmp_path / "old.sqlite")
    _fill(old, 4, created_at=1000.0)
    new = ProbeCache(tmp_path / "new.sqlite")
    items = [(key(i, "fused"), ProbeResult("fused", False, evidence="newer")) for i in range(2, 6)]
    new.put_many(items)
    pa, pb = tmp_path / "a.pack", tmp_path / "b.pack"
    pack.export_pack(old, pa)
    pack.export_pack(new, pb)
    target = ProbeCache(tmp_path / "t.sqlite")
    transfer.import_(target, pa)
    report = transfer.import_(target, pb)
    assert (report.imported, report.skipped) == (2, 2)  # keys 4, 5 new; 2, 3 kept as stored
    assert target.get(key(2, "fused")) == result(2, "fused")
    merged = transfer.merge(pa, pb, tmp_path / "m.sqlite")
    assert (merged.written, merged.conflicts, merged.duplicates) == (10, 2, 0)
    m = ProbeCache(tmp_path / "m.sqlite", readonly=True)
    assert m.get(key(2, "fused")).evidence == "newer"  # newer wins
    assert m.get(key(1, "flash")) == result(1, "flash")
    again = transfer.merge(pa, pa, tmp_path / "m2.sqlite")
    assert (again.written, again.duplicates, again.conflicts) == (8, 8, 0)


def test_merge_of_a_pack_and_a_jsonl_export(packed, tmp_path):
    store, path = packed
    transfer.export(store, tmp_path / "rows.jsonl")
    report = transfer.merge(path, tmp_path / "rows.jsonl", tmp_path / "m.pack.sqlite")
    assert report.written == 40 and report.duplicates == 40
    report = transfer.merge(path, path, tmp_path / "m.jsonl")
    assert report.written == 40


# ----------------------------------------------------------------------------- rows that fail
def test_bad_rows_are_counted_and_skipped_with_one_warning(packed, tmp_path, cache_log):
    _, path = packed
    k = [key(i, "fused") for i in range(5)]
    one = " WHERE config_key = ? AND backend = 'fused'"
    bad_crc = "UPDATE probes SET crc = crc + 1" + one
    future = f"UPDATE probes SET created_at = {time.time() + 86400}" + one
    evil = "UPDATE probes SET backend = 'evil'" + one

    _edit(path, bad_crc, params=(k[0][0],))
    _edit(path, future, params=(k[1][0],))
    _edit(path, evil, params=(k[2][0],))
    unknown = {**result(3, "fused").to_dict(), "extra": 1}
    _edit(path, _resign(k[3][0], json.dumps(unknown)))
    control = {**result(4, "fused").to_dict(), "evidence": "bell\u0007"}  # cleaned, accepted
    _edit(path, _resign(k[4][0], json.dumps(control)))
    escape = "UPDATE probes SET package_version = '0.1' || char(27) || '[31m'" + one
    _edit(path, escape, params=(key(5)[0],))
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, path)
    assert report.imported == 35 and len(report.rejected) == 5
    reasons = " ".join(r for _, r in report.rejected)
    assert "checksum" in reasons and "unknown field" in reasons
    assert fresh.get(key(4, "fused")).evidence == "bell\ufffd"
    assert fresh.get(key(1, "fused")) is None
    assert len([m for m in cache_log.at(30) if "rejected" in m]) == 1


def test_rows_that_break_the_checks_pass_the_integrity_check_and_the_row_checks_catch_them(
        packed, tmp_path):  # fmt: skip
    """SQLite never parses a read-only database's CHECKs, so the import's ``quick_check`` (of
    the pack attached read-only) passes rows that break them: the row checks must catch them."""
    _, path = packed
    one = " WHERE config_key = ? AND backend = 'fused'"
    _edit(path, "UPDATE probes SET supported = 7, backend = 'evil'" + one, params=(key(0)[0],))
    writable = sqlite3.connect(path)  # (read-write, its CHECKs parsed: the row is seen)
    try:
        assert writable.execute("PRAGMA quick_check").fetchall() != [("ok",)]
    finally:
        writable.close()
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("ATTACH ? AS pk", (f"file:{path}?mode=ro",))
        pack._quick_check(conn)  # passes: no refusal
    finally:
        conn.close()
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, path)
    assert report.imported == 39 and [r for _, r in report.rejected] == [pack._FAILS_SQL]
    assert fresh.get(key(0, "fused")) is None and fresh.get(key(0, "flash")) is not None


@pytest.mark.parametrize("good_first", [True, False])
@pytest.mark.parametrize("number", ["01.5", "00", "-1.5", "1e3", "1000000000.5"])
def test_a_result_that_differs_from_a_good_one_only_in_its_elapsed_ms_is_validated(
        packed, tmp_path, number, good_first):  # fmt: skip
    """The verdict cache masks plain in-range ``elapsed_ms`` values only: a text with a leading
    zero (not JSON), a sign, an exponent or a value out of range gets a verdict of its own."""
    _, path = packed
    base = {**result(1, "fused").to_dict(), "elapsed_ms": 1.5}
    text = json.dumps(base, separators=(",", ":"))
    first, second = sorted((1, 2), key=lambda i: key(i)[0], reverse=not good_first)
    _edit(path, *(_resign(key(i)[0], text.replace('"elapsed_ms":1.5', f'"elapsed_ms":{value}'),
                          ", supported = 1, stage = 'rule'")
                  for i, value in ((first, "1.5"), (second, number))))  # fmt: skip
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    report = transfer.import_(fresh, path)
    assert fresh.get(key(first, "fused")).elapsed_ms == 1.5
    valid = number == "1e3"  # (1000.0: in range, written another way)
    assert (fresh.get(key(second, "fused")) is not None) == valid
    assert report.imported == 40 - (not valid) and len(report.rejected) == (not valid)


# --------------------------------------------------------------------------------- hostile packs
HOSTILE = {
    "trigger": ["CREATE TRIGGER t AFTER INSERT ON meta BEGIN DELETE FROM meta; END"],
    "view": ["CREATE VIEW v AS SELECT * FROM probes"],
    "extra_table": ["CREATE TABLE extra (x)"],
    "extra_index": ["CREATE INDEX i ON probes (created_at)"],
    "newer_version": ["UPDATE meta SET value = '3' WHERE name = 'format_version'",
                      "PRAGMA user_version = 3"],
    "row_count": ["UPDATE meta SET value = '7' WHERE name = 'rows'"],
    "no_checks": ["UPDATE sqlite_master SET sql = replace(sql, 'CHECK (typeof(crc)',"
                  " 'CHECK (1 OR typeof(crc)') WHERE name = 'probes'"],  # valid SQL, weakened
    "bad_context": ["UPDATE contexts SET ctx = ctx + 1", "UPDATE probes SET ctx = ctx + 1"],
    "huge_row": [f"UPDATE probes SET result = result || '{' ' * (MAX_ROW + 10)}'"
                 f" WHERE config_key = '{key(0)[0]}' AND backend = 'fused'"],
}


#: The refusal each hostile pack gets (the check that must catch it, not merely some error).
REFUSALS = {
    "trigger": "unexpected schema objects: trigger t",
    "view": "unexpected schema objects: view v",
    "extra_table": "unexpected schema objects: table extra",
    "extra_index": "unexpected schema objects: index i",
    "newer_version": r"format_version 3 is not supported \(this package reads 1, 2\)",
    "row_count": "the pack holds 40 rows, its meta says 7",
    "no_checks": "table probes is not the pack's table",
    "bad_context": "context [0-9]+ is not the id of its device and software stack",
    "huge_row": rf"a row of [0-9]+ bytes \(limit {MAX_ROW}\)",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_pack_is_refused_and_nothing_applied(packed, tmp_path, kind):
    store, path = packed
    _edit(path, *HOSTILE[kind])
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    with pytest.raises(pack.PackError, match=f"^{REFUSALS[kind]}$"):
        transfer.import_(fresh, path)
    assert len(fresh) == 1 and fresh.check_integrity() is None
    with pytest.raises(pack.PackError):
        transfer.merge(path, store.path, tmp_path / "m.sqlite")
    assert not (tmp_path / "m.sqlite").exists()


def test_a_corrupt_or_truncated_pack_is_refused(packed, tmp_path):
    _, path = packed
    data = bytearray(path.read_bytes())
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    for name, blob in {"garbled": data[:4096] + os.urandom(len(data) - 4096),
                       "truncated": data[: len(data) // 2]}.items():  # fmt: skip
        bad = tmp_path / f"{name}.pack"
        bad.write_bytes(bytes(blob))
        with pytest.raises(pack.PackError):
            transfer.import_(fresh, bad)
    assert len(fresh) == 0


def test_a_pack_whose_schema_text_is_not_utf8_is_refused_by_name(packed, tmp_path):
    # SQLite's message about a damaged schema quotes its text; Python's sqlite3 then raises
    # UnicodeDecodeError, not an sqlite3 error (found by benchmarks/fuzz_inputs.py's pack kind)
    store, path = packed
    data = bytearray(path.read_bytes())
    at = data.index(b"CREATE TABLE probes") + len("CREATE ")
    data[at : at + 2] = b"\xce,"
    path.write_bytes(bytes(data))
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    with pytest.raises(pack.PackError, match=r"^cannot read the pack: its schema is damaged"):
        transfer.import_(fresh, path)
    assert len(fresh) == 1 and fresh.check_integrity() is None
    with pytest.raises(pack.PackError, match=f"^refusing the pack {re.escape(str(path))}: cannot"):
        transfer.merge(path, store.path, tmp_path / "m.sqlite")
    assert not (tmp_path / "m.sqlite").exists()


def test_a_damaged_pack_met_before_its_checks_is_refused_not_raised(packed, tmp_path):
    # a merge reads the pack's rows first (to count duplicates and conflicts), before the
    # integrity check and the row checks have run: damage met there is the pack's refusal
    store, path = packed
    data = bytearray(path.read_bytes())
    page = len(data) // 4096 // 2 * 4096  # a page of the probes table
    data[page + 8 : page + 4096] = random.Random(0).randbytes(4088)  # (the same damage each run)
    path.write_bytes(bytes(data))
    with pytest.raises(pack.PackError, match=f"^refusing the pack {re.escape(str(path))}: "):
        transfer.merge(path, store.path, tmp_path / "m.sqlite")
    assert not (tmp_path / "m.sqlite").exists()
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    with pytest.raises(pack.PackError):
        transfer.import_(fresh, path)
    assert len(fresh) == 1 and fresh.check_integrity() is None


def test_a_device_name_with_control_characters_is_stored_as_the_validator_cleans_it(
        packed, tmp_path):  # fmt: skip
    _, path = packed
    _edit(path, "UPDATE contexts SET device = ?",
          params=('{"name":"h100\\u001b]0;pwned\\u0007","sm":90}',))  # fmt: skip
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    assert transfer.import_(fresh, path).imported == 40
    stored = fresh.run(lambda c: c.execute("SELECT device FROM contexts").fetchall(),
                       write=False, miss=None)  # fmt: skip
    assert [json.loads(d) for (d,) in stored] == [{"name": "h100\ufffd]0;pwned\ufffd", "sm": 90}]
    assert {r.device["name"] for r in fresh.iter_rows()} == {"h100\ufffd]0;pwned\ufffd"}


def test_damage_in_the_store_is_the_stores_problem_not_the_packs(packed, tmp_path):
    # the pack passes its quick_check, the store fails its own: the import reports that the
    # store could not be written (nothing was), not a refusal of a good pack
    _, path = packed
    target = ProbeCache(tmp_path / "damaged.sqlite")
    target.put_many([(key(i, b), result(i, b)) for i in range(1000, 1600)
                     for b in ("fused", "flash")])  # fmt: skip
    target.checkpoint()
    target.close()
    data = bytearray((tmp_path / "damaged.sqlite").read_bytes())
    size = int.from_bytes(data[16:18], "big")
    page = len(data) // size // 2 * size  # a leaf of the probes table
    data[page + 8 : page + size] = random.Random(0).randbytes(size - 8)
    (tmp_path / "damaged.sqlite").write_bytes(bytes(data))
    target = ProbeCache(tmp_path / "damaged.sqlite")
    report = transfer.import_(target, path)
    assert report.imported == 0 and report.not_written == 40
    assert "malformed" in report.problem


def test_not_sqlite_and_fifos_are_not_packs(tmp_path):
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    (tmp_path / "noise").write_bytes(b"SQLite format 3\x00" + os.urandom(200))
    assert not pack.is_pack(tmp_path / "noise")
    report = transfer.import_(fresh, tmp_path / "noise")
    assert report.imported == 0 and report.rejected
    os.mkfifo(tmp_path / "fifo")
    assert not pack.is_pack(tmp_path / "fifo")
    with pytest.raises(OSError):
        transfer.import_(fresh, tmp_path / "fifo")
    with pytest.raises(OSError):
        pack.import_pack(fresh, tmp_path / "fifo")


def test_a_pack_whose_sqlite_header_is_damaged_is_refused_by_name(packed, tmp_path):
    """Read as JSON Lines (not a pack by its header): the refusal says what the file is not."""
    _, path = packed
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[:6] = b"XXXXXX"  # the SQLite magic gone
    (tmp_path / "bad.pack").write_bytes(bytes(data))
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    assert not pack.is_pack(tmp_path / "bad.pack")
    report = transfer.import_(fresh, tmp_path / "bad.pack")
    assert report.imported == 0 and len(report.rejected) == 1
    why = report.rejected[0][1]
    assert "not a JSON Lines export, an SQLite pack or a store" in why and "not valid JSON" in why
    assert len(fresh) == 0


# ------------------------------------------------------------------------- stores that fail
def test_import_into_a_read_only_store_writes_nothing(packed, tmp_path):
    from te_fl_attention.cli import cache as cmd

    _, path = packed
    target = tmp_path / "ro.sqlite"
    ProbeCache(target).put(key(500), result(500))
    out: list[str] = []
    ro = ProbeCache(target, readonly=True)
    assert cmd.cmd_import(str(path), out.append, cache=ro) == 1
    assert "nothing was imported" in " ".join(out)
    report = pack.import_pack(ro, path)
    assert report.imported == 0 and report.not_written == 40
    assert _count(target) == 1


def test_import_into_a_full_store_reports_nothing_written(small_disk, tmp_path):
    from te_fl_attention.cli import cache as cmd

    src = ProbeCache(tmp_path / "src.sqlite")
    # (a distinct detail per row: rows sharing a template would make a small pack)
    src.put_many([(key(i), ProbeResult("fused", True, detail={"blob": f"{i}" + "x" * 2000}))
                  for i in range(2000)])  # fmt: skip
    pack.export_pack(src, tmp_path / "big.pack")
    store = ProbeCache(small_disk / "s.sqlite")
    store.put(key(9999), result(9999))
    out: list[str] = []
    assert cmd.cmd_import(str(tmp_path / "big.pack"), out.append, cache=store) == 1
    assert "NOT written" in " ".join(out) or "could not be written" in " ".join(out)
    assert _count(small_disk / "s.sqlite") == 1
    # a merge of the same pack onto the full disk: a clear error, no output, no traceback
    out.clear()
    merged = small_disk / "m.sqlite"
    assert cmd.cmd_merge(str(tmp_path / "big.pack"), str(tmp_path / "src.sqlite"), str(merged),
                         out.append) == 1  # fmt: skip
    assert "cannot write the merged store" in " ".join(out), out
    assert not merged.exists()


# ------------------------------------------------------------------ concurrency and kill -9
_WRITER = """
import sys
from cache_testutil import key, result
from te_fl_attention.cache import ProbeCache
s = ProbeCache(sys.argv[1])
for i in range(int(sys.argv[2]), int(sys.argv[2]) + 300):
    s.put(key(i, "unfused"), result(i, "unfused"))
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'cache'}"}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env)


def test_a_pack_import_beside_another_writer_loses_no_row(store, tmp_path):
    _fill(store, 1500)
    path = tmp_path / "rows.pack"
    pack.export_pack(store, path)
    target = tmp_path / "target.sqlite"
    ProbeCache(target).put(key(0, "triton"), result(0, "triton"))
    writer = _child(_WRITER, str(target), "100000")
    report = transfer.import_(ProbeCache(target), path)
    assert writer.wait(60) == 0
    assert report.imported == 3000
    assert _count(target) == 3000 + 300 + 1


_IMPORTER = """
import sys
from te_fl_attention.cache import ProbeCache, transfer
print("start", flush=True)
transfer.import_(ProbeCache(sys.argv[1]), sys.argv[2])
"""


def test_kill_9_of_an_importer_leaves_all_or_none(store, tmp_path):
    _fill(store, 5000)
    path = tmp_path / "rows.pack"
    n = pack.export_pack(store, path)
    seen = set()
    for delay in (0.2, 0.5, 0.9, 1.4):
        target = tmp_path / f"t{delay}.sqlite"
        ProbeCache(target).put(key(0, "triton"), result(0, "triton"))
        child = _child(_IMPORTER, str(target), str(path))
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        check = ProbeCache(target)
        assert check.check_integrity() is None
        rows = len(check) - 1
        assert rows in (0, n)
        seen.add(rows)
        check.close()
    print("kill -9 left", sorted(seen), "of", n)  # (which of the two depends on the timing)


# ---------------------------------------------------------------------------------- trust rule
def test_a_pack_row_claiming_fused_for_fp32_cannot_make_select_choose_it(tmp_path, new_job,
                                                                         capsys):  # fmt: skip
    """As for JSON Lines (tests/test_selector_trust.py): a pack whose fused row for an fp32
    config on h100 claims supported (checksum and columns made consistent) imports fine, yet
    ``explain`` and ``select()`` still refuse fused: the rule stage narrows it at use."""
    out = tmp_path / "rows.pack"
    export_fp32_pack(new_job, capsys, out)
    conn = sqlite3.connect(out, isolation_level=None)
    (ck, ctx, text), = _results(conn, "p.backend = 'fused'")
    fp, vk = conn.execute("SELECT device_fp, versions_key FROM contexts WHERE ctx = ?",
                          (ctx,)).fetchone()  # fmt: skip
    res = json.loads(text)
    res.update(supported=True, reasons=[], stage="graph_build")
    text = json.dumps(res, separators=(",", ":"))
    conn.execute("UPDATE probes SET result = ?, supported = 1, stage = 'graph_build', crc = ?,"
                 " rid = NULL, e1 = NULL, e2 = NULL, e3 = NULL WHERE backend = 'fused'",
                 (text, row_crc(CacheKey(ck, "fused", fp, vk), text)))  # fmt: skip
    conn.close()
    import_and_assert_fused_refused(new_job, capsys, out)


# --------------------------------------------------------------------------- the pipelined copy
@pytest.mark.parametrize("chunk", [1, 3, 8192])
def test_ranges_copy_exactly_the_rows_the_checks_pass(packed, tmp_path, monkeypatch, chunk):
    """Checked ranges of keys are copied while the next is checked: whatever the range size, the
    rows written are the rows that pass, bad rows in any range stay out, and the counts hold."""
    store, path = packed
    monkeypatch.setattr(pack, "CHUNK_ROWS", chunk)
    ordered = sorted({key(i)[0] for i in range(20)})
    bad = [ordered[0], ordered[7], ordered[-1]]  # the first, a middle and the last range
    for ck in bad:
        _edit(path, "UPDATE probes SET crc = crc + 1 WHERE config_key = ? AND backend = 'flash'",
              params=(ck,))  # fmt: skip
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    report = transfer.import_(fresh, path)
    assert (report.imported, report.skipped, len(report.rejected)) == (37, 0, 3)
    want = {k: v for k, v in _rows(store).items() if not (k.backend == "flash" and k[0] in bad)}
    got = _rows(fresh)
    got.pop(key(1000))
    assert got == want and fresh.check_integrity() is None
    merged = transfer.merge(path, store.path, tmp_path / "m.sqlite")
    assert merged.written == 40


def test_a_refusal_in_a_later_range_applies_nothing(packed, tmp_path, monkeypatch):
    """A huge row met after earlier ranges were copied rolls back the copied ranges too."""
    _, path = packed
    monkeypatch.setattr(pack, "CHUNK_ROWS", 2)
    last = max(key(i)[0] for i in range(20))
    _edit(path, f"UPDATE probes SET result = result || '{' ' * (MAX_ROW + 10)}'"
          " WHERE config_key = ? AND backend = 'fused'", params=(last,))  # fmt: skip
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    with pytest.raises(pack.PackError, match="bytes"):
        transfer.import_(fresh, path)
    assert len(fresh) == 0 and fresh.check_integrity() is None


def test_a_pack_that_changes_while_it_is_read_is_refused(packed, tmp_path, monkeypatch):
    """The header's change counter is read before the checks and again before the commit: a
    real write by another connection in between (here right after the whole-pack checks, when
    no lock is held yet) refuses the pack."""
    _, path = packed
    real_counter, real_check = pack._change_counter, pack._check_pack
    calls = []

    def counter(p):
        calls.append(p)
        return real_counter(p)

    def check_then_write(conn):
        found = real_check(conn)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("UPDATE meta SET value = value || ' ' WHERE name = 'exported_at'")
        other.close()
        return found

    monkeypatch.setattr(pack, "_change_counter", counter)
    monkeypatch.setattr(pack, "_check_pack", check_then_write)
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    with pytest.raises(pack.PackError, match="changed"):
        transfer.import_(fresh, path)
    assert len(fresh) == 0 and len(calls) == 2


def test_rows_out_of_key_order_refuse_the_pack(packed):
    """The checks read in key order and hand on ranges of keys; a scan out of order (a damaged
    b-tree) could copy a row before its check, so it refuses the pack."""
    _, path = packed
    first = min(key(i)[0] for i in range(20))
    _edit(path, "UPDATE probes SET crc = crc + 1 WHERE config_key = ? AND backend = 'flash'",
          params=(first,))  # fmt: skip
    conn = sqlite3.connect(":memory:")
    try:  # two rows of two configs, as the checking scan reads them
        conn.execute("ATTACH ? AS pk", (f"file:{path}?mode=ro",))
        found = pack._check_pack(conn)
        scan = conn.execute(pack._scan(found.version, pack._rows_where(found.contexts,
                                                                      found.version)))  # fmt: skip
        rows = [next(scan), next(r for r in scan if r[0] != first.encode())]
    finally:
        conn.close()
    lo, hi = rows[0][:3], rows[1][:3]
    assert lo == (first.encode(), b"flash", rows[0][2]) and hi[0] > lo[0]
    check = pack._Pass()
    with pytest.raises(pack.PackError, match="key order"):
        check.rows(iter(rows[::-1]), found.contexts, found.templates, lambda *a: None)
    sent = []
    pack._Pass().rows(iter(rows), found.contexts, found.templates, lambda *a: sent.append(a))
    assert sent == [("", None, [lo])]  # in order: checked, the bad checksum left out


_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(obj=st.dictionaries(st.text(max_size=12), _SCALARS | st.lists(_SCALARS, max_size=4),
                           max_size=8),  # fmt: skip
       ascii_only=st.booleans())
def test_a_config_the_byte_test_passes_is_one_the_validator_keeps_unchanged(obj, ascii_only):
    """The quick test of a config's bytes (nothing suspect, flat; after SQL's json_valid) never
    passes a config the validator would reject or clean."""
    data = json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    parsed = json.loads(data)
    if not pack._suspect(data) and pack._flat_shape(data):
        assert rows_mod.validate_flat(parsed, "config") == parsed


def test_the_integrity_check_runs_beside_the_row_checks_and_its_refusal_applies_nothing(
        packed, tmp_path, monkeypatch):  # fmt: skip
    """``quick_check`` runs on the copier thread while the calling thread checks the rows; no copy
    starts before it passes, and when it fails after every range was checked and queued, the
    pack is refused and nothing applied."""
    _, path = packed
    rows_done, seen = threading.Event(), []
    real_rows = pack._Pass.rows

    def rows(self, *args):
        real_rows(self, *args)
        rows_done.set()

    def quick_check(conn):
        assert rows_done.wait(30)  # every range is checked and queued, none copied yet
        seen.append(conn.execute("SELECT count(*) FROM main.probes").fetchone()[0])
        raise pack.PackError("integrity check failed: (test)")

    monkeypatch.setattr(pack._Pass, "rows", rows)
    monkeypatch.setattr(pack, "_quick_check", quick_check)
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    with pytest.raises(pack.PackError, match="integrity check failed"):
        transfer.import_(fresh, path)
    assert seen == [1] and len(fresh) == 1 and fresh.check_integrity() is None


def _pages(path, *tables: str) -> list[int]:
    """The pages (numbered from 1) of a pack's ``tables``, as SQLite's ``dbstat`` lists them."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [p for p, in conn.execute("SELECT pageno FROM dbstat WHERE name IN"
                                          f" ({','.join('?' * len(tables))})", tables)]  # fmt: skip
    except sqlite3.OperationalError:
        pytest.skip("needs SQLite's dbstat table")
    finally:
        conn.close()


def _garble(data: bytes, page: int, pages: list[int], seed: int) -> bytes:
    """``data`` with 200 random bytes written inside each of ``pages`` (past its header)."""
    bad = bytearray(data)
    rng = random.Random(seed)
    for i in pages:
        start = (i - 1) * page + rng.randrange(8, page - 300)
        bad[start:start + 200] = rng.randbytes(200)
    return bytes(bad)


def test_a_damaged_pack_is_refused_by_its_integrity_check_whatever_the_row_checks_met(
        packed, tmp_path):  # fmt: skip
    """The pages of the row tables (probes, configs) garbled: the row checks may meet anything
    (an SQLite error, rows out of order, bad checksums); the refusal is the one ``quick_check``
    gives, as SQLite's own ``quick_check`` of the file says (its report, or its error)."""
    _, path = packed
    data = path.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    rows = _pages(path, "probes", "configs")
    assert len(rows) >= 3
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    bad_path = tmp_path / "bad.pack"
    damaged = 0
    for seed in range(12):
        bad_path.write_bytes(_garble(data, page, rows, seed))
        conn = sqlite3.connect(f"file:{bad_path}?mode=ro", uri=True)
        try:
            found = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)")]
            expected = "integrity check failed: "
        except sqlite3.DatabaseError as exc:
            found, expected = [], f"cannot read the pack: {exc}"
        finally:
            conn.close()
        if found == ["ok"]:  # (only free space or cell text garbled: the row checks' matter)
            continue
        damaged += 1
        with pytest.raises(pack.PackError) as refused:
            transfer.import_(fresh, bad_path)
        assert str(refused.value).startswith(expected), (seed, str(refused.value))
    assert damaged >= 8 and len(fresh) == 0


def test_a_damaged_templates_page_is_refused_before_any_row_is_read(packed, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """Format 2's whole-pack checks read every template before the rows (and before the
    ``quick_check``): a garbled templates page refuses the pack there (SQLite's report of the
    damage, or a template whose text is not its id's), no row checked, nothing applied."""
    _, path = packed
    data = path.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    templates = _pages(path, "templates")
    assert len(templates) >= 2
    scans: list[object] = []
    monkeypatch.setattr(pack._Pass, "rows", lambda *a, **k: scans.append(a))
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    fresh.put(key(1000), result(1000))
    bad_path = tmp_path / "bad.pack"
    for seed in range(6):
        bad_path.write_bytes(_garble(data, page, templates, seed))
        with pytest.raises(pack.PackError) as refused:
            transfer.import_(fresh, bad_path)
        assert re.match(r"cannot read the pack: |template [0-9]+ is not the template its id"
                        r" names$", str(refused.value)), (seed, str(refused.value))  # fmt: skip
    assert scans == [] and len(fresh) == 1 and fresh.check_integrity() is None


@pytest.mark.parametrize("claimed", [39, 41, 0])
def test_a_row_count_other_than_meta_claims_is_refused_after_every_range_was_copied(
        packed, tmp_path, monkeypatch, claimed):  # fmt: skip
    """The row checks' scan counts the rows; a count other than ``meta``'s refuses the pack at
    the end of the scan, and the ranges already copied are rolled back."""
    _, path = packed
    monkeypatch.setattr(pack, "CHUNK_ROWS", 2)
    _edit(path, f"UPDATE meta SET value = '{claimed}' WHERE name = 'rows'")
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    with pytest.raises(pack.PackError, match=f"holds 40 rows, its meta says {claimed}"):
        transfer.import_(fresh, path)
    assert len(fresh) == 0 and fresh.check_integrity() is None


@pytest.mark.parametrize("huge_row", [False, True])
def test_an_error_in_the_integrity_check_itself_never_leaves_the_import_waiting(
        packed, tmp_path, monkeypatch, huge_row):  # fmt: skip
    """An unexpected error inside ``quick_check`` (not a refusal) still releases a calling thread
    that waits for its verdict: the import ends with an error and applies nothing."""
    _, path = packed
    if huge_row:  # the row checks fail too: the calling thread waits for the check's verdict
        _edit(path, *HOSTILE["huge_row"])

    def broken(conn):
        raise RuntimeError("boom")

    monkeypatch.setattr(pack, "_quick_check", broken)
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    errors: list[BaseException] = []

    def run():
        try:
            transfer.import_(fresh, path)
        except BaseException as exc:  # noqa: BLE001 (checked below)
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    expected = pack.PackError if huge_row else RuntimeError
    assert len(errors) == 1 and isinstance(errors[0], expected), errors
    assert len(fresh) == 0

"""The store's schema 2 (the compact row layout, :mod:`te_fl_attention.cache.compact`): a schema-1
store migrated in place (rows kept, also across kill -9 and two processes at once) or read as it
is when read-only; compact rows rebuilt byte for byte or read as misses when damaged; configs
stored against a base."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_testutil import FP, ROOT, VK, full_result, key, result
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention import FusedAttnConfig
from te_fl_attention.cache import ProbeCache, _lifecycle, compact
from te_fl_attention.cache.rows import CacheRow, dumps, finite, make_row, row_params
from te_fl_attention.reasons import ProbeResult, Reason

RICH = ProbeResult(
    "flash", True, (Reason("a", "b", "import", observed=[1, {"x": 2}], limit=3, hint="h"),),
    stage="run", evidence="flash-attn 2.8.3", elapsed_ms=1.5, detail={"variant": "fa2"},
    variants=(ProbeResult("fa2", True, elapsed_ms=0.25),
              ProbeResult("fa3", False, (Reason("sm", "needs sm90", observed=80, limit=90),),
                          elapsed_ms=12.125)),
)  # fmt: skip


def _rows(n: int) -> list[CacheRow]:
    """``n`` rows of both layouts (compact-able and full), with configs (some a whole
    ``FusedAttnConfig``) and devices."""
    out = []
    for i in range(n):
        res = full_result(i) if i % 4 == 0 else result(i)
        cfg = FusedAttnConfig(num_heads=1 + i % 8).to_dict() if i % 2 else {"i": i}
        out.append(make_row(key(i), res, cfg, {"name": "h100"}, created_at=1000.0 + i))
    return out


def _schema1(path: Path, rows: list[CacheRow]) -> None:
    """A schema-1 store, as the package wrote it before schema 2 (by hand: its DDL and rows)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    for ddl in _lifecycle._SCHEMA_1.values():
        conn.execute(ddl)
    conn.execute(f"PRAGMA application_id={_lifecycle.APPLICATION_ID}")
    conn.execute("PRAGMA user_version=1")
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [
        ("schema_version", "1"), ("created_by", "0.0.1"), ("created_at", "1000.0")])  # fmt: skip
    for row in rows:
        p = row_params(row)
        device = None if row.device is None else dumps(row.device)
        conn.execute("INSERT OR IGNORE INTO contexts VALUES (?,?,?,?)",
                     (p[2], row.key.device_fp, row.key.versions_key, device))  # fmt: skip
        if row.config is not None:
            conn.execute("INSERT OR IGNORE INTO configs VALUES (?,?)",
                         (row.key.config_key, dumps(row.config)))  # fmt: skip
        conn.execute("INSERT INTO probes VALUES (?,?,?,?,?,?,?,?,?,?)", p)
    conn.execute("COMMIT")
    conn.close()


def _raw(path: Path, sql: str, args: tuple = ()) -> list:
    conn = sqlite3.connect(path)
    try:
        with conn:
            return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _tables(path: Path) -> dict[str, str]:
    return dict(_raw(path, "SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))


def _version(path: Path) -> tuple[int, str]:
    return (_raw(path, "PRAGMA user_version")[0][0],
            _raw(path, "SELECT value FROM meta WHERE name='schema_version'")[0][0])  # fmt: skip


def _quarantined(path: Path) -> list[Path]:
    return list(path.parent.glob(f"{path.name}.corrupt-*"))


def _assert_all_rows(store: ProbeCache, rows: list[CacheRow]) -> None:
    """Every row reads back equal, by each read path."""
    keys = [row.key for row in rows]
    for row in rows:
        assert store.get(row.key) == row.probe_result
    assert store.get_many(keys) == {row.key: row.probe_result for row in rows}
    assert store.get_rows(keys) == {row.key: row for row in rows}
    got = {r.key: r for r in store.iter_rows()}
    assert all(got[row.key] == row for row in rows)
    found = store.load_slice(FP, VK)
    assert found is not None
    assert all(found[(r.key.config_key, r.key.backend)] == r.probe_result for r in rows)


# ------------------------------------------------------------------------------ schema
def test_a_fresh_and_a_migrated_store_have_the_same_schema(tmp_path):
    fresh = tmp_path / "fresh.sqlite"
    with ProbeCache(fresh) as store:
        store.put(key(1), result(1))
        assert store.schema == _lifecycle.SCHEMA_VERSION == 2
    assert _version(fresh) == (2, "2")
    assert _lifecycle._same_ddl(_tables(fresh), _lifecycle._SCHEMA)
    old = tmp_path / "old.sqlite"
    _schema1(old, _rows(3))
    assert _version(old) == (1, "1") and _lifecycle._same_ddl(_tables(old), _lifecycle._SCHEMA_1)
    assert not _lifecycle._same_ddl(_tables(old), _lifecycle._SCHEMA)
    with ProbeCache(old) as store:
        assert len(store) == 3 and store.schema == 2 and store.mode == "rw"
    assert _version(old) == (2, "2")
    # What SQLite wrote for ADD COLUMN is the DDL a fresh store is created with.
    assert _lifecycle._same_ddl(_tables(old), _lifecycle._SCHEMA)
    norm = {n: " ".join(q.split()) for n, q in _tables(old).items()}
    assert norm == {n: " ".join(q.split()) for n, q in _tables(fresh).items()}
    assert _raw(old, "SELECT count(*) FROM meta WHERE name='migrated_at'") == [(1,)]
    assert not _quarantined(old)


def test_migration_keeps_every_row_and_writes_new_rows_compact(tmp_path, cache_log):
    path = tmp_path / "p.sqlite"
    old = _rows(40)
    _schema1(path, old)
    store = ProbeCache(path)
    _assert_all_rows(store, old)
    # New rows: for old configs (stored once, as they are) and for new ones.
    new = [make_row(key(i, "flash"), result(i, "flash"), old[i].config, {"name": "h100"},
                    created_at=2000.0 + i) for i in range(1, 6)]  # fmt: skip
    new += [make_row(key(i, "flash"), result(i, "flash"), FusedAttnConfig(num_heads=i).to_dict(),
                     {"name": "h100"}, created_at=2000.0 + i) for i in range(101, 106)]  # fmt: skip
    assert store.put_many(new) == 10
    old_kinds = _raw(path, "SELECT DISTINCT rid IS NULL FROM probes WHERE backend='fused'")
    new_kinds = _raw(path, "SELECT DISTINCT rid IS NULL FROM probes WHERE backend='flash'")
    assert old_kinds == [(1,)] and new_kinds == [(0,)]  # old rows stay full, new ones compact
    assert _raw(path, "SELECT count(*) FROM probes WHERE result = ''") == [(10,)]
    assert _raw(path, "SELECT count(*) FROM configs WHERE base IS NOT NULL") == [(5,)]
    _assert_all_rows(store, old + new)
    assert len(list(store.iter_rows())) == 50 and store._bad_rows == 0
    store.close()
    with ProbeCache(path) as again:  # and after reopening (no second migration)
        _assert_all_rows(again, old + new)
    assert not _quarantined(path) and cache_log.at(30) == []


def test_the_migration_is_logged_only_by_the_process_that_made_it(tmp_path, cache_log):
    path = tmp_path / "p.sqlite"
    _schema1(path, _rows(4))
    with ProbeCache(path) as store:
        assert len(store) == 4 and store.schema == 2
        migrated = [m for m in cache_log.at(20) if "migrated" in m]
        assert len(migrated) == 1 and "schema 1 migrated to 2" in migrated[0]
        # Another process's migration already done: nothing to do, nothing said.
        store.run(store._migrate, write=True, miss=None)
        assert [m for m in cache_log.at(20) if "migrated" in m] == migrated
    assert _raw(path, "SELECT count(*) FROM meta WHERE name='migrated_at'") == [(1,)]


def test_a_schema_1_store_opened_read_only_is_read_as_it_is(tmp_path, cache_log):
    path = tmp_path / "p.sqlite"
    rows = _rows(20)
    _schema1(path, rows)
    before = _tables(path)
    store = ProbeCache(path, readonly=True)
    _assert_all_rows(store, rows)
    assert store.schema == 1 and store.mode == "ro" and store._bad_rows == 0
    store.put(key(99), result(99))  # kept in memory: the file is never written
    assert store.get(key(99)) == result(99) and store.in_memory_writes == 1
    store.close()
    assert _version(path) == (1, "1") and _tables(path) == before
    assert _raw(path, "SELECT count(*) FROM probes") == [(20,)]
    assert cache_log.at(30) == []


# ------------------------------------------------------------------------------ processes
_OPEN_CHILD = """
import json, sys, time
from te_fl_attention.cache import ProbeCache
print("ready", flush=True)
sys.stdin.readline()
store = ProbeCache(sys.argv[1])
n = len(store)
print(json.dumps({"mode": store.mode, "schema": store.schema, "rows": n}), flush=True)
time.sleep(60)
"""


def _child(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _OPEN_CHILD, str(path)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _schema_after_kill(path: Path, rows: list[CacheRow]) -> int:
    """The schema a killed migration left: 1 or 2, whole, with every row (then usable)."""
    version, meta = _version(path)
    assert (version, meta) in ((1, "1"), (2, "2"))
    schema = _lifecycle._SCHEMA if version == 2 else _lifecycle._SCHEMA_1
    assert _lifecycle._same_ddl(_tables(path), schema)
    assert _raw(path, "PRAGMA integrity_check") == [("ok",)]
    assert _raw(path, "SELECT count(*) FROM probes") == [(len(rows),)]
    with ProbeCache(path) as store:
        for row in rows[:: max(1, len(rows) // 50)]:
            assert store.get(row.key) == row.probe_result
        assert len(store) == len(rows) and store.mode == "rw" and store.schema == 2
    assert not _quarantined(path)
    return version


def test_kill_9_during_migration_leaves_one_schema_or_the_other(tmp_path):
    src = tmp_path / "src.sqlite"
    rows = _rows(3000)
    _schema1(src, rows)
    # How long an open that migrates takes, from "go" to its answer.
    timed = tmp_path / "timed.sqlite"
    shutil.copy(src, timed)
    proc = _child(timed)
    start = time.monotonic()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["schema"] == 2
    took = time.monotonic() - start
    _kill(proc)
    assert _schema_after_kill(timed, rows) == 2
    rng = random.Random(11)
    seen = set()
    delays = [None, 0.0, *(rng.uniform(0, took * 1.2) for _ in range(10))]
    for n, delay in enumerate(delays):
        path = tmp_path / f"k{n}" / "p.sqlite"
        path.parent.mkdir()
        shutil.copy(src, path)
        proc = _child(path)
        if delay is not None:  # None: killed before it opened the store
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(delay)
        _kill(proc)
        seen.add(_schema_after_kill(path, rows))
    assert 1 in seen  # (at least the child killed before "go")


def test_two_processes_migrating_the_same_store_share_one_store(tmp_path):
    path = tmp_path / "p.sqlite"
    rows = _rows(200)
    _schema1(path, rows)
    children = [_child(path) for _ in range(3)]
    for proc in children:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    try:
        answers = [json.loads(proc.stdout.readline()) for proc in children]
    finally:
        for proc in children:
            _kill(proc)
    assert answers == [{"mode": "rw", "schema": 2, "rows": 200}] * 3
    assert _version(path) == (2, "2") and not _quarantined(path)
    assert _raw(path, "SELECT count(*) FROM meta WHERE name='migrated_at'") == [(1,)]
    with ProbeCache(path) as store:
        store.put(key(500), result(500))
        _assert_all_rows(store, rows)
        assert len(store) == 201 and store._bad_rows == 0


# ------------------------------------------------------------------------------ round trip
def _split(res: ProbeResult) -> tuple[str, float, tuple | None]:
    """A result's stored text, its ``elapsed_ms`` column and its split (as a store makes them)."""
    p = row_params(make_row(key(1), res))
    return p[9], p[5], compact.split_result(p[9], p[1], p[3], p[4], p[5])


def _assert_rebuilt(text: str, elapsed: float, split: tuple) -> None:
    t, e1, e2, e3 = split
    data = text.encode()
    template = t.text.encode()
    assert t.rid == compact.text_id(template) and 0 <= t.rid < 2**63
    parts = compact.pieces(template)
    assert len(parts) - 1 == t.holes
    assert compact.expand(parts, elapsed, e1, e2, e3) == data
    assert [e1, e2, e3][t.holes - 1:] == [None] * (compact.HOLES - t.holes)


@pytest.mark.parametrize("res", [
    result(1), result(3), RICH, dataclasses.replace(RICH, elapsed_ms=0.0),
    dataclasses.replace(RICH, variants=RICH.variants + (ProbeResult("fa4", True, elapsed_ms=3.0),)),
    ProbeResult("unfused", True, detail={"elapsed_ms": 7.5, "nested": {"elapsed_ms": 0.5}}),
    ProbeResult("fused", True, elapsed_ms=123456789.00390625),
], ids=["one", "refused", "variants", "zero", "four-values", "detail", "large"])  # fmt: skip
def test_compact_round_trip_is_byte_exact(res):
    text, elapsed, split = _split(res)
    assert split is not None
    _assert_rebuilt(text, elapsed, split)
    values = [res.elapsed_ms, *split[1:]]
    assert split[0].holes == sum(v is not None for v in values)


def test_rows_sharing_a_template_differ_only_in_their_values():
    a, b = (_split(dataclasses.replace(RICH, elapsed_ms=e))[2] for e in (1.5, 99.0625))
    assert a is not None and b is not None and a[0] == b[0] and a[1:] == b[1:]
    other = _split(dataclasses.replace(RICH, evidence="flash-attn 2.8.4"))[2]
    assert other is not None and other[0].rid != a[0].rid


@pytest.mark.parametrize("written", ["1e3", "01.5", "0", "-1.5", "1.5e-05", "NaN",
                                     "12345678901.5"])  # fmt: skip
def test_an_elapsed_ms_written_otherwise_stays_full(written):
    text = dumps(result(1).to_dict()).replace('"elapsed_ms":0.3333333333333333',
                                              f'"elapsed_ms":{written}')  # fmt: skip
    assert f'"elapsed_ms":{written}' in text
    elapsed = finite(float(written))
    assert compact.split_result(text, "fused", 1, "rule", elapsed) is None


def test_more_values_than_holes_or_a_first_value_elsewhere_stays_full(store):
    assert _split(full_result(1))[2] is None  # HOLES + 1 values
    text = dumps(result(1).to_dict())
    assert compact.split_result(text, "fused", 1, "rule", 2.0) is None  # not its elapsed_ms
    assert compact.split_result(dumps({"backend": "fused"}), "fused", 1, "rule", 0.0) is None
    # -0.0 (not a plain value) first, 0.0 (one) in a variant: equal, but not the same text
    signed = ProbeResult("fused", True, elapsed_ms=-0.0,
                         variants=(ProbeResult("fa2", True, elapsed_ms=0.0),))  # fmt: skip
    assert _split(signed)[2] is None
    store.put(key(1), signed)
    assert dumps(store.get_row(key(1)).result) == dumps(signed.to_dict())


def test_a_store_keeps_a_text_written_otherwise_in_full(store):
    """A row whose text the compact layout refuses is stored as it came (``result_json``)."""
    for i, written in enumerate(["1e3", "0", "-1.5", "1.5e-05"]):
        text = dumps(result(1).to_dict()).replace('"elapsed_ms":0.3333333333333333',
                                                  f'"elapsed_ms":{written}')  # fmt: skip
        row = make_row(key(i), json.loads(text))
        store.put_many([dataclasses.replace(row, result_json=text)], checked=True)
        assert _raw(store.path, "SELECT rid, result FROM probes WHERE config_key=?",
                    (key(i).config_key,)) == [(None, text)]  # fmt: skip
        assert store.get_row(key(i)).result == json.loads(text)


_value = st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=4)
_elapsed = st.floats() | st.sampled_from([0.0, 1e-7, 1e9, 1e16, 123456789.5, -0.0, 2.5])
_detail = st.dictionaries(st.sampled_from(["elapsed_ms", "variant", '"elapsed_ms":1.0', "x"]),
                          _value | _elapsed, max_size=3)  # fmt: skip
_reason = st.builds(Reason, st.text(max_size=4), st.text(max_size=6),
                    observed=_value | _detail, limit=_value)  # fmt: skip


def _results(variants: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(ProbeResult, st.sampled_from(["fused", "flash", "fa2", "unfused"]),
                     st.booleans(), st.lists(_reason, max_size=2).map(tuple),
                     stage=st.sampled_from(["rule", "run"]),
                     evidence=st.text(max_size=8) | st.just('"elapsed_ms":0'),
                     elapsed_ms=_elapsed, detail=_detail, variants=variants)  # fmt: skip


_random_results = _results(st.lists(_results(st.just(())), max_size=5).map(tuple))


@settings(max_examples=400, deadline=None, database=None)
@given(res=_random_results)
def test_fuzz_split_is_full_or_rebuilds_exactly(res):
    text, elapsed, split = _split(res)
    if split is not None:
        _assert_rebuilt(text, elapsed, split)
        assert _split(res)[2] == split  # the same template again (known templates)


@settings(max_examples=60, deadline=None, database=None)
@given(results=st.lists(_random_results, min_size=1, max_size=6))
def test_fuzz_store_round_trip(tmp_path_factory, results):
    path = tmp_path_factory.mktemp("fuzz") / "p.sqlite"
    with ProbeCache(path) as store:
        rows = [make_row(key(i), r) for i, r in enumerate(results)]
        store.put_many(rows)
        got = {r.key: r for r in store.iter_rows()}
        hits = store.get_many([row.key for row in rows])
        for row in rows:
            assert dumps(got[row.key].result) == dumps(row.result)
            assert repr(hits[row.key]) == repr(ProbeResult.from_dict(row.result))
        assert store._bad_rows == 0


# ------------------------------------------------------------------------------ damage
def _crc(k, rid, elapsed, e1, e2=None, e3=None) -> int:
    from te_fl_attention.cache.rows import ctx_id

    return compact.compact_crc(k.config_key, k.backend, ctx_id(k.device_fp, k.versions_key), rid,
                               elapsed, e1, e2, e3)  # fmt: skip


def _damage(path: Path, how: str) -> None:
    """Damage key(1)'s compact row (its template is shared with key(5)'s, not with key(2)'s)."""
    k = key(1)
    rid, elapsed, e1 = _raw(path, "SELECT rid, elapsed_ms, e1 FROM probes WHERE config_key=?",
                            (k.config_key,))[0]  # fmt: skip
    where = (k.config_key,)
    sql, args = {
        "crc": ("UPDATE probes SET crc = crc + 1 WHERE config_key=?", where),
        "elapsed": ("UPDATE probes SET elapsed_ms = elapsed_ms + 1 WHERE config_key=?", where),
        "e1": ("UPDATE probes SET e1 = e1 + 0.5 WHERE config_key=?", where),
        "e1-text": ("UPDATE probes SET e1 = 'x' WHERE config_key=?", where),
        "elapsed-blob": ("UPDATE probes SET elapsed_ms = x'00' WHERE config_key=?", where),
        # checksums that match: what is left to catch it is the template
        "extra-value": ("UPDATE probes SET e3 = 1.0, crc = ? WHERE config_key=?",
                        (_crc(k, rid, elapsed, e1, None, 1.0), *where)),
        "missing-value": ("UPDATE probes SET e1 = NULL, crc = ? WHERE config_key=?",
                          (_crc(k, rid, elapsed, None), *where)),
        "no-template": ("UPDATE probes SET rid = ?, crc = ? WHERE config_key=?",
                        (rid ^ 1, _crc(k, rid ^ 1, elapsed, e1), *where)),
        "template-edit": ("UPDATE templates SET template = replace(template, 'true', 'fals')"
                          " WHERE rid=?", (rid,)),
    }[how]  # fmt: skip
    conn = sqlite3.connect(path)
    try:
        with conn:
            assert conn.execute(sql, args).rowcount == 1
    finally:
        conn.close()


_DAMAGES = ["crc", "elapsed", "e1", "e1-text", "elapsed-blob", "extra-value", "missing-value",
            "no-template", "template-edit"]  # fmt: skip


@pytest.mark.parametrize("how", _DAMAGES)
def test_a_damaged_compact_row_is_a_counted_miss(store, how, cache_log):
    two = dataclasses.replace(RICH, variants=RICH.variants[:1])  # two values: e1 is set
    results = {1: two, 5: dataclasses.replace(two, elapsed_ms=9.5), 2: RICH, 3: result(3)}
    store.put_many([(key(i), r) for i, r in results.items()])
    rids = dict(_raw(store.path, "SELECT config_key, rid FROM probes"))
    assert rids[key(1).config_key] == rids[key(5).config_key] != rids[key(2).config_key]
    assert None not in rids.values()
    assert store.get_many([key(i) for i in results]) == {key(i): r for i, r in results.items()}
    _damage(store.path, how)
    lost = {1, 5} if how == "template-edit" else {1}
    kept = {key(i): r for i, r in results.items() if i not in lost}
    for i in results:  # each read path: a miss, never a wrong hit; others unharmed
        assert store.get(key(i)) == (None if i in lost else results[i])
    assert store.get_many([key(i) for i in results]) == kept
    assert {r.key for r in store.iter_rows()} == set(kept)
    assert set(store.get_rows([key(i) for i in results])) == set(kept)
    found = store.load_slice(FP, VK)
    assert found == {(k.config_key, k.backend): r for k, r in kept.items()}
    assert store._bad_rows >= 5 * len(lost)
    assert any("damaged row" in m for m in cache_log.at(30))
    store.put(key(1), results[1])  # rewritten: whole again (the template too)
    assert store.get(key(1)) == results[1]


# ------------------------------------------------------------------------------ configs
def test_a_package_config_is_stored_against_its_base(store):
    cfg = FusedAttnConfig(num_heads=16, head_dim_qk=128, head_dim_v=128).to_dict()
    store.put(key(1), result(1), config=cfg)
    store.put(key(2), result(2), config=FusedAttnConfig().to_dict())
    (base, text), (base2, text2) = _raw(store.path, "SELECT base, config FROM configs"
                                                    " ORDER BY config_key = ?",
                                        (key(2).config_key,))  # fmt: skip
    assert base is not None and base == base2
    default = FusedAttnConfig().to_dict()
    assert json.loads(text) == {k: v for k, v in cfg.items() if default[k] != v}
    assert json.loads(text) and text2 == "{}" and len(text) < len(dumps(cfg)) // 4
    bases = _raw(store.path, "SELECT base, config FROM bases")
    assert bases == [(base, dumps(FusedAttnConfig().to_dict()))]
    assert compact.text_id(bases[0][1].encode()) == base
    rows = {r.key: r for r in store.iter_rows()}
    assert rows[key(1)].config == cfg and list(rows[key(1)].config) == list(cfg)
    assert rows[key(2)].config == FusedAttnConfig().to_dict()
    assert store.get_row(key(1)).config == cfg


def _other_configs() -> dict[str, dict]:
    cfg = FusedAttnConfig().to_dict()
    first = next(iter(cfg))
    return {
        "extra": {**cfg, "future_field": 1},
        "missing": {k: v for k, v in cfg.items() if k != "dropout"},
        "reordered": {k: cfg[k] for k in reversed(cfg)},
        "renamed": {("x" if k == first else k): v for k, v in cfg.items()},
        "other": {"i": 1},
    }


@pytest.mark.parametrize("name", list(_other_configs()))
def test_a_config_with_other_fields_is_stored_in_full(store, name):
    cfg = _other_configs()[name]
    store.put(key(1), result(1), config=cfg)
    assert _raw(store.path, "SELECT base, config FROM configs") == [(None, dumps(cfg))]
    got = store.get_row(key(1)).config
    assert got == cfg and list(got) == list(cfg)


def test_a_config_value_of_another_type_comes_back_as_it_went(store):
    cfg = {**FusedAttnConfig().to_dict(), "num_heads": 16.0, "is_training": 1, "dropout": 0}
    store.put(key(1), result(1), config=cfg)
    got = store.get_row(key(1)).config
    assert got == cfg and [type(v) for v in got.values()] == [type(v) for v in cfg.values()]


def test_prune_and_clear_drop_unused_templates_and_bases(store):
    """``prune``/``clear`` remove rows, then the configs, templates and bases no row uses; rows
    written again store theirs again."""
    cfg = FusedAttnConfig(num_heads=4).to_dict()
    store.put_many([make_row(key(i), result(i), cfg if i else {"i": 0}, created_at=c)
                    for i, c in enumerate([time.time() - 3600] * 3 + [time.time()] * 3)])
    count = {t: f"SELECT count(*) FROM {t}" for t in ("configs", "templates", "bases")}
    assert [_raw(store.path, q)[0][0] for q in count.values()] == [6, 6, 1]
    assert store.prune(older_than_s=60) == 3
    kept = {key(i): result(i) for i in range(3, 6)}
    assert [_raw(store.path, q)[0][0] for q in count.values()] == [3, 3, 1]
    assert store.get_many([key(i) for i in range(6)]) == kept
    assert store.prune(not_versions_key="e" * 64) == 3
    assert [_raw(store.path, q)[0][0] for q in count.values()] == [0, 0, 0]
    store.put_many([(key(i), result(i), cfg) for i in range(6)])
    assert store.get_many([key(i) for i in range(6)]) == {key(i): result(i) for i in range(6)}
    assert store.get_row(key(0)).config == cfg
    assert store.clear() == 6
    assert [_raw(store.path, q)[0][0] for q in count.values()] == [0, 0, 0]
    store.put(key(7), result(7), config=cfg)
    assert store.get(key(7)) == result(7) and store.get_row(key(7)).config == cfg

"""A job's slice of the store: every row of (device, software stack) read in one query, decoded
on first use, so later configs are answered from memory; bounded, and never stale for rows that
other processes write after it was read."""

from __future__ import annotations

import pytest

from te_fl_attention import FusedAttnConfig, Policy, Selector
from te_fl_attention.cache import ProbeCache
from te_fl_attention.cache import sqlite as sqlite_store
from te_fl_attention.device import profile
from te_fl_attention.probes import default_probes

DEV = profile("h100")
CONFIGS = [FusedAttnConfig(head_dim_qk=d, head_dim_v=d, num_heads=h)
           for d in (64, 128) for h in (8, 16, 32)]  # fmt: skip


def _fill(path) -> list:
    store = ProbeCache(path)
    sel = Selector(default_probes(graph=False), cache=store)
    decisions = [sel.decide(c, DEV, Policy()) for c in CONFIGS]
    store.close()
    return decisions


def _selector(path) -> tuple[Selector, ProbeCache, list]:
    store = ProbeCache(path)
    calls: list = []
    real = store.get_many
    store.get_many = lambda keys: calls.append(list(keys)) or real(keys)  # type: ignore
    return Selector(default_probes(graph=False), cache=store), store, calls


def test_one_query_answers_every_config_of_the_job(tmp_path):
    cold = _fill(tmp_path / "p.sqlite")
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    loads: list = []
    real_load = store.load_slice
    store.load_slice = lambda *a, **k: loads.append(a) or real_load(*a, **k)  # type: ignore
    sel.prepare(DEV)
    warm = [sel.decide(FusedAttnConfig(**c.to_dict()), DEV, Policy()) for c in CONFIGS]
    assert [d.results for d in warm] == [d.results for d in cold]
    assert {d.source for d in warm} == {"cache"}
    assert len(loads) == 1 and calls == []  # one slice query, no per-config read
    assert sel.stats == {"memo_hits": 0, "cache_hits": 4 * len(CONFIGS), "probes": 0}


def test_a_row_written_after_the_slice_was_read_is_still_found(tmp_path):
    _fill(tmp_path / "p.sqlite")
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    sel.prepare(DEV)
    late = FusedAttnConfig(head_dim_qk=256, head_dim_v=256)
    writer = ProbeCache(tmp_path / "p.sqlite")  # another process's store handle
    Selector(default_probes(graph=False), cache=writer).decide(late, DEV, Policy())
    writer.close()
    d = sel.decide(late, DEV, Policy())
    assert d.source == "cache" and sel.stats["probes"] == 0 and len(calls) == 1


def test_a_slice_over_the_bound_falls_back_to_per_config_reads(tmp_path, monkeypatch):
    _fill(tmp_path / "p.sqlite")
    monkeypatch.setattr(sqlite_store, "SLICE_MAX_ROWS", 3)
    store = ProbeCache(tmp_path / "p.sqlite")
    assert store.load_slice(DEV.fingerprint(), "0" * 64) == {}  # another stack: empty slice
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    sel.prepare(DEV)
    assert store.load_slice(DEV.fingerprint(), sel.keys.versions(DEV), max_rows=3) is None
    assert store.load_slice(DEV.fingerprint(), sel.keys.versions(DEV), max_bytes=1) is None
    d = sel.decide(CONFIGS[0], DEV, Policy())
    assert d.source == "cache" and len(calls) == 1


def _store_in_full(conn, path, backend: str) -> None:
    """Rewrite ``backend``'s compact rows as full rows (their JSON text in ``result``, as a
    schema-1 store holds them)."""
    from te_fl_attention.cache.rows import make_row, row_params

    store = ProbeCache(path, readonly=True)
    rows = list(store.iter_rows(backend=backend))
    store.close()
    assert rows
    for row in rows:
        p = row_params(make_row(row.key, row.result, created_at=row.created_at))
        n = conn.execute("UPDATE probes SET result=?, crc=?, rid=NULL, e1=NULL, e2=NULL,"
                         " e3=NULL WHERE config_key=? AND backend=? AND ctx=?",
                         (p[9], p[8], *p[:3])).rowcount  # fmt: skip
        assert n == 1


# Compact rows: their checksum, a value or their template damaged; full rows: checksum or text.
_DAMAGE = {
    "crc": "UPDATE probes SET crc = crc + 1 WHERE backend = 'unfused'",
    "elapsed": "UPDATE probes SET elapsed_ms = elapsed_ms + 1 WHERE backend = 'unfused'",
    "template": "UPDATE templates SET template = '{' WHERE backend = 'unfused'",
    "full-crc": "UPDATE probes SET crc = crc + 1 WHERE backend = 'unfused'",
    "json": "UPDATE probes SET result = '{' WHERE backend = 'unfused'",
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_row_in_the_slice_is_a_miss_and_probed_again(tmp_path, damage):
    _fill(tmp_path / "p.sqlite")
    import sqlite3

    conn = sqlite3.connect(tmp_path / "p.sqlite")
    full = damage in ("full-crc", "json")
    if full:
        _store_in_full(conn, tmp_path / "p.sqlite", "unfused")
        conn.commit()
        sel, store, _ = _selector(tmp_path / "p.sqlite")  # (still read as they were)
        sel.prepare(DEV)
        assert sel.decide(CONFIGS[0], DEV, Policy()).source == "cache"
        assert sel.stats["probes"] == 0 and store._bad_rows == 0
        store.close()
    kinds = conn.execute("SELECT DISTINCT rid IS NULL FROM probes WHERE backend = 'unfused'")
    assert [k for (k,) in kinds] == [int(full)]
    assert conn.execute(_DAMAGE[damage]).rowcount >= 1
    conn.commit()
    conn.close()
    sel, store, _ = _selector(tmp_path / "p.sqlite")
    sel.prepare(DEV)
    d = sel.decide(CONFIGS[0], DEV, Policy())
    assert sel.stats["probes"] == 1 and d.result("unfused").supported
    assert store._bad_rows >= 1


def test_a_large_slice_keeps_the_bytes_and_decodes_rows_on_first_use(tmp_path, monkeypatch):
    cold = _fill(tmp_path / "p.sqlite")
    monkeypatch.setattr(sqlite_store, "SLICE_BULK_DECODE", 2)
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    sel.prepare(DEV)
    rows = sel._slice(DEV)
    assert rows and all(type(r) is tuple for r in rows.values())  # not decoded yet
    warm = [sel.decide(c, DEV, Policy()) for c in CONFIGS]
    assert [d.results for d in warm] == [d.results for d in cold] and calls == []
    assert rows == {}  # each row was handed over once; the result memo holds it now


def test_prepare_runs_whole_selections_and_leaves_no_trace(tmp_path, monkeypatch):
    """prepare's dry selections go through decide (policy, memo, slice, rules) but leave the
    slice, the memos and the counters as they were, and a stored row of a config equal to one
    of its samples is still served as stored."""
    from te_fl_attention import selector as selector_mod

    sample = FusedAttnConfig(**selector_mod._SAMPLES[1])
    store = ProbeCache(tmp_path / "p.sqlite")
    stored = Selector(default_probes(graph=False), cache=store).decide(sample, DEV, Policy())
    store.close()
    _fill(tmp_path / "p.sqlite")
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    ran: list = []
    real_decide = sel.decide
    monkeypatch.setattr(sel, "decide", lambda *a, **k: ran.append(a[0]) or real_decide(*a, **k))
    before = dict(store.load_slice(DEV.fingerprint(), sel.keys.versions(DEV)))
    sel.prepare(DEV)
    assert len(ran) == 8  # every dry run was a whole selection
    assert sel._slice(DEV) == before and sel._memo == {} and sel._results == {}
    assert sel.stats == {"memo_hits": 0, "cache_hits": 0, "probes": 0} and calls == []
    again = sel.decide(FusedAttnConfig(**sample.to_dict()), DEV, Policy())
    assert again.results == stored.results and again.source == "cache"


def test_prepare_does_not_run_whole_selections_under_verify(tmp_path, monkeypatch):
    _fill(tmp_path / "p.sqlite")
    monkeypatch.setenv("TE_FL_ATTN_VERIFY", "1")
    sel, store, calls = _selector(tmp_path / "p.sqlite")
    ran: list = []
    monkeypatch.setattr(sel, "decide", lambda *a, **k: ran.append(a))
    sel.prepare(DEV)
    assert ran == [] and sel.stats["probes"] == 0

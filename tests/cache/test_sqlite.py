"""ProbeCache / MemoryCache API and fork safety."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import time

import pytest
from cache_testutil import FP, VK, full_result, key, result

from te_fl_attention.cache import (
    CacheKey,
    MemoryCache,
    ProbeCache,
)
from te_fl_attention.cache.rows import make_row
from te_fl_attention.reasons import ProbeResult


@pytest.fixture(params=["sqlite", "memory"])
def any_cache(request, store_path):
    cache = ProbeCache(store_path) if request.param == "sqlite" else MemoryCache()
    yield cache
    cache.close()


def test_get_put_roundtrip(any_cache):
    assert any_cache.get(key(1)) is None
    any_cache.put(key(1), result(1), config={"num_heads": 16}, device={"name": "h100"})
    assert any_cache.get(key(1)) == result(1)
    assert len(any_cache) == 1
    row = any_cache.get_row(key(1))
    assert row is not None and row.config == {"num_heads": 16}
    assert row.device == {"name": "h100"} and row.created_at > 0


def test_put_replaces_same_key(any_cache):
    any_cache.put(key(1), result(1))
    any_cache.put(key(1), result(3))
    assert any_cache.get(key(1)) == result(3)
    assert len(any_cache) == 1


def test_put_many_and_get_many(any_cache):
    items = [(key(i), result(i)) for i in range(50)]
    assert any_cache.put_many(items) == 50
    hits = any_cache.get_many([key(i) for i in range(60)])
    assert set(hits) == {key(i) for i in range(50)}
    assert all(hits[key(i)] == result(i) for i in range(50))


def test_on_conflict_modes(any_cache):
    any_cache.put_many([make_row(key(1), result(1), created_at=100.0)])
    assert any_cache.put_many([make_row(key(1), result(2), created_at=200.0)],
                              on_conflict="ignore") == 0  # fmt: skip
    assert any_cache.get(key(1)) == result(1)
    any_cache.put_many([make_row(key(1), result(2), created_at=50.0)], on_conflict="newer")
    assert any_cache.get(key(1)) == result(1)
    any_cache.put_many([make_row(key(1), result(2), created_at=300.0)], on_conflict="newer")
    assert any_cache.get(key(1)) == result(2)


def test_bad_key_is_an_error(any_cache):
    with pytest.raises(ValueError, match="config_key"):
        any_cache.put(CacheKey("xyz", "fused", FP, VK), result(1))
    with pytest.raises(ValueError, match="backend"):
        any_cache.put(key(1, backend="cuda"), result(1))


def test_stats_iter_rows_prune_clear(any_cache):
    other_vk = "c" * 64
    any_cache.put_many([(key(i), result(i)) for i in range(10)])
    any_cache.put_many([(key(i, "flash", vk=other_vk), result(i, "flash")) for i in range(5)])
    st = any_cache.stats()
    assert st["entries"] == 15
    assert st["by_backend"] == {"fused": 10, "flash": 5}
    assert st["by_device"] == {FP: 15}
    assert st["by_versions_key"] == {VK: 10, other_vk: 5}
    assert st["by_verdict"]["supported"] + st["by_verdict"]["unsupported"] == 15
    rows = list(any_cache.iter_rows())
    assert len(rows) == 15 and [r.key for r in rows] == sorted(r.key for r in rows)
    assert len(list(any_cache.iter_rows(backend="flash"))) == 5
    prefix = key(3).config_key[:10]
    assert {r.key for r in any_cache.iter_rows(config_prefix=prefix)} == {
        key(3), key(3, "flash", vk=other_vk)}  # fmt: skip
    assert len(any_cache.recent(3)) == 3
    assert any_cache.prune(not_versions_key=VK) == 5
    assert len(any_cache) == 10
    assert any_cache.prune(older_than_s=3600) == 0
    time.sleep(0.05)
    assert any_cache.prune(older_than_s=0.01) == 10
    any_cache.put(key(1), result(1))
    assert any_cache.clear() == 1 and len(any_cache) == 0


def test_iter_rows_pages(store):
    store.put_many([(key(i), result(i)) for i in range(45)])
    assert len(list(store.iter_rows(page=7))) == 45


def test_reopen_keeps_data(store_path):
    with ProbeCache(store_path) as c:
        c.put(key(1), result(1))
    with ProbeCache(store_path) as c:
        assert c.get(key(1)) == result(1)
        assert c.mode == "rw"


# A full row's text, or a compact row's template, edited: "supported" flips.
_FLIP = {
    "full": "UPDATE probes SET result = replace(result, 'true', 'false')",
    "compact": "UPDATE templates SET template = replace(template, 'true', 'false')",
}


@pytest.mark.parametrize("layout", ["full", "compact"])
def test_damaged_row_reads_as_a_miss(store, store_path, cache_log, layout):
    make = full_result if layout == "full" else result
    store.put(key(1), make(1))
    store.put(key(2), make(2))
    store.close()
    conn = sqlite3.connect(store_path)
    full = conn.execute("SELECT count(*) FROM probes WHERE rid IS NULL").fetchone()[0]
    assert full == (2 if layout == "full" else 0)
    assert conn.execute(_FLIP[layout]).rowcount == 2
    conn.commit()
    conn.close()
    assert store.get(key(1)) is None  # checksum no longer matches: a miss, not a wrong hit
    assert store.get(key(2)) is None
    assert list(store.iter_rows()) == []
    assert len(cache_log.at(30)) == 1


def test_nan_elapsed_is_stored(store):
    r = ProbeResult("fused", True, elapsed_ms=float("nan"))
    store.put(key(1), r)
    got = store.get(key(1))
    assert got is not None and got.supported and got.elapsed_ms != got.elapsed_ms


# ------------------------------------------------------------------------------------------ fork
def _child_put_get(path: str, parent_key: CacheKey, child_key: CacheKey) -> None:
    c = ProbeCache(path)
    assert c.get(parent_key) == result(1)
    c.put(child_key, result(2))


def _child_reuse(store: ProbeCache, parent_key: CacheKey, child_key: CacheKey) -> None:
    assert store.get(parent_key) == result(1)  # the inherited object reopens in the child
    store.put(child_key, result(2))


@pytest.mark.parametrize("reuse", [False, True])
def test_fork_safety(store, store_path, reuse):
    store.put(key(1), result(1))
    ctx = mp.get_context("fork")
    target, args = ((_child_reuse, (store, key(1), key(2))) if reuse
                    else (_child_put_get, (str(store_path), key(1), key(2))))  # fmt: skip
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert store.get(key(2)) == result(2)
    store.put(key(3), result(3))
    assert ProbeCache(store_path).get(key(3)) == result(3)


def test_pid_change_without_hook_reopens(store):
    store.put(key(1), result(1))
    store._pid = -1  # as if forked by a path that skipped the at-fork hook
    assert store.get(key(1)) == result(1)
    store.put(key(2), result(2))
    assert store.get(key(2)) == result(2)

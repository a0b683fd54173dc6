"""Damaged, foreign, newer and unwritable stores: moved aside or degraded, never an error."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import random
import sqlite3
import tempfile
from pathlib import Path

import pytest
from cache_testutil import Records, key, result
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import ProbeCache, open_cache

ROWS = 60


@functools.cache
def _pristine() -> bytes:
    """The bytes of a healthy, cleanly closed store holding ROWS rows."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.sqlite"
        cache = ProbeCache(path)
        cache.put_many([(key(i), result(i), {"i": i}, {"name": "gpu"}) for i in range(ROWS)])
        cache.close()
        assert not Path(f"{path}-wal").exists()
        return path.read_bytes()


@pytest.fixture
def pristine() -> bytes:
    return _pristine()


def _quarantined(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.glob(f"{path.name}.corrupt-*")
                  if not p.name.endswith(("-wal", "-shm")))  # fmt: skip


def _exercise(path: Path) -> ProbeCache:
    """Read everything (reads only), then check a fresh put/get works."""
    cache = ProbeCache(path)
    for i in range(ROWS):
        got = cache.get(key(i))
        assert got is None or got == result(i)  # a miss is fine, a wrong hit is not
    list(cache.iter_rows())
    cache.stats()
    len(cache)
    return cache


def _check_works(cache: ProbeCache) -> None:
    cache.put(key(10_000), result(10_000))
    assert cache.get(key(10_000)) == result(10_000)


def _assert_moved_aside(path: Path, original: bytes, log: Records) -> None:
    moved = _quarantined(path)
    assert len(moved) == 1, f"expected one quarantined file, found {moved}"
    assert moved[0].read_bytes() == original
    warnings = log.at(logging.WARNING)
    assert len(warnings) == 1 and "moved it to" in warnings[0]


# -------------------------------------------------------------------------------- random damage
@settings(max_examples=200, deadline=None, database=None)
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1,
                      max_size=12))  # fmt: skip
def test_random_byte_flips(flips):
    data = bytearray(_pristine())
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    log = Records()
    logger = logging.getLogger("te_fl_attention.cache")
    logger.addHandler(log)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "flipped.sqlite"
            path.write_bytes(bytes(data))
            cache = _exercise(path)
            moved = _quarantined(path)
            assert len(moved) <= 1
            if moved:  # held exactly the damaged bytes (SQLite may only touch the header)
                assert moved[0].read_bytes()[100:] == bytes(data)[100:]
            _check_works(cache)
            cache.close()
            assert len(log.at(logging.WARNING)) <= 2
    finally:
        logger.removeHandler(log)


def test_truncation_to_random_lengths(pristine, tmp_path, cache_log):
    rng = random.Random(7)
    lengths = {1, 50, 99, 100, 101, 4095, 4096, 4097, len(pristine) - 1}
    lengths |= {rng.randrange(1, len(pristine)) for _ in range(12)}
    for n in sorted(lengths):
        cache_log.records.clear()
        path = tmp_path / f"t{n}" / "probes.sqlite"
        path.parent.mkdir()
        path.write_bytes(pristine[:n])
        cache = _exercise(path)
        _assert_moved_aside(path, pristine[:n], cache_log)
        _check_works(cache)
        cache.close()


def test_zero_length_file_is_a_new_store(tmp_path, cache_log):
    path = tmp_path / "empty.sqlite"
    path.write_bytes(b"")
    cache = _exercise(path)
    _check_works(cache)
    assert cache.mode == "rw" and not _quarantined(path)
    assert cache_log.at(logging.WARNING) == []
    cache.close()
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"meta", "contexts", "configs", "probes"}


@pytest.mark.parametrize("content", [
    b"this is a text file, not a database\n" * 200,
    b"SQLite format 3\x00" + bytes(range(256)) * 40,
    os.urandom(8192),
])  # fmt: skip
def test_not_sqlite(tmp_path, cache_log, content):
    path = tmp_path / "junk.sqlite"
    path.write_bytes(content)
    cache = _exercise(path)
    _assert_moved_aside(path, content, cache_log)
    _check_works(cache)


def _foreign_db(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('alice')")
    conn.commit()
    conn.close()


def _extra_table(path: Path) -> None:
    ProbeCache(path).put(key(1), result(1))
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE surprise (x)")
    conn.commit()
    conn.close()


def _newer_user_version(path: Path) -> None:
    ProbeCache(path).put(key(1), result(1))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()


def _newer_meta(path: Path) -> None:
    ProbeCache(path).put(key(1), result(1))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value='2' WHERE name='schema_version'")
    conn.commit()
    conn.close()


def _missing_table(path: Path) -> None:
    ProbeCache(path).put(key(1), result(1))
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE configs")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("make", [_foreign_db, _extra_table, _newer_user_version, _newer_meta,
                                  _missing_table])  # fmt: skip
def test_foreign_or_newer_schema(tmp_path, cache_log, make):
    path = tmp_path / "odd.sqlite"
    make(path)
    for side in ("-wal", "-shm"):
        assert not Path(f"{path}{side}").exists()
    original = path.read_bytes()
    cache_log.records.clear()
    cache = _exercise(path)
    _assert_moved_aside(path, original, cache_log)
    assert cache.get(key(1)) is None  # the new store starts empty
    _check_works(cache)


def test_damage_found_during_get(tmp_path, cache_log):
    path = tmp_path / "late.sqlite"
    with ProbeCache(path) as c:
        c.put_many([(key(i), result(i)) for i in range(3000)])
    data = bytearray(path.read_bytes())
    page = 4096
    for off in range(6 * page, len(data) - page, page):  # wreck the data pages, keep the schema
        data[off : off + page] = b"\xa5" * page
    path.write_bytes(bytes(data))
    cache = ProbeCache(path)
    assert cache.mode == "rw"  # the header and schema still look fine
    for i in range(0, 3000, 97):
        got = cache.get(key(i))
        assert got is None or got == result(i)
    _assert_moved_aside(path, bytes(data), cache_log)
    _check_works(cache)


def test_store_in_use_elsewhere_is_not_moved(tmp_path, cache_log):
    path = tmp_path / "busy.sqlite"
    path.write_bytes(b"not a database" * 100)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as another process with the store open would
    try:
        cache = ProbeCache(path)
        assert cache.get(key(1)) is None
        cache.put(key(1), result(1))
        assert cache.get(key(1)) == result(1)  # kept in memory
        assert cache.mode == "memo" and not _quarantined(path)
        assert path.read_bytes() == b"not a database" * 100
        assert len(cache_log.at(logging.WARNING)) == 1
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------- cannot write
def test_readonly_env(tmp_path, monkeypatch, cache_log):
    path = tmp_path / "ro.sqlite"
    with ProbeCache(path) as c:
        c.put(key(1), result(1))
    before = path.read_bytes()
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(path))
    monkeypatch.setenv("TE_FL_ATTN_CACHE_READONLY", "1")
    cache = open_cache()
    assert cache.get(key(1)) == result(1)
    for i in range(2, 20):
        cache.put(key(i), result(i))
    assert cache.get(key(5)) == result(5)  # from memory
    assert len(cache) == 19
    cache.close()
    assert path.read_bytes() == before
    assert cache_log.at(logging.WARNING) == []
    assert len(cache_log.at(logging.INFO)) == 1


def test_readonly_env_missing_file(tmp_path, monkeypatch, cache_log):
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "nothing.sqlite"))
    monkeypatch.setenv("TE_FL_ATTN_CACHE_READONLY", "1")
    cache = open_cache()
    assert cache.get(key(1)) is None
    cache.put(key(1), result(1))
    assert cache.get(key(1)) == result(1)
    assert not (tmp_path / "nothing.sqlite").exists()
    assert cache_log.at(logging.WARNING) == []


def test_readonly_filesystem_simulated(tmp_path, monkeypatch, cache_log):
    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(sqlite3, "connect", refuse)
    cache = ProbeCache(tmp_path / "x.sqlite")
    assert cache.get(key(1)) is None
    for i in range(10):
        cache.put(key(i), result(i))
    assert cache.get(key(3)) == result(3) and cache.mode == "memo"
    assert len(cache_log.at(logging.WARNING)) == 1


def test_write_refused_keeps_reads(tmp_path, cache_log):
    path = tmp_path / "q.sqlite"
    cache = ProbeCache(path)
    cache.put(key(1), result(1))
    cache._conn.execute("PRAGMA query_only=ON")  # every write now fails with SQLITE_READONLY
    cache.put(key(2), result(2))
    cache.put(key(3), result(3))
    assert cache.mode == "ro"
    assert cache.get(key(1)) == result(1)  # still read from the file
    assert cache.get(key(2)) == result(2)  # from memory
    assert len(cache_log.at(logging.WARNING)) == 1
    assert "cannot be written" in cache_log.at(logging.WARNING)[0]


def test_disk_full(tmp_path, cache_log):
    cache = ProbeCache(tmp_path / "full.sqlite")
    cache.put(key(0), result(0))
    pages = cache._conn.execute("PRAGMA page_count").fetchone()[0]
    cache._conn.execute(f"PRAGMA max_page_count={pages + 2}")
    big = [(key(i), result(i), {"pad": "x" * 2000}) for i in range(1, 200)]
    cache.put_many(big)
    assert cache.mode == "ro"
    assert cache.get(key(0)) == result(0) and cache.get(key(150)) == result(150)
    assert len(cache_log.at(logging.WARNING)) == 1


def test_unwritable_location(tmp_path, cache_log):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    cache = ProbeCache(blocker / "sub" / "probes.sqlite")
    cache.put(key(1), result(1))
    assert cache.get(key(1)) == result(1)
    assert cache.mode == "memo"
    assert len(cache_log.at(logging.WARNING)) == 1

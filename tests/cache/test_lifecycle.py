"""Damaged, foreign, newer and unwritable stores: moved aside or degraded, never an error; and
the storage edges of a store's path (FIFOs, full disks, long names, symlinks, permissions)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import random
import sqlite3
import tempfile
from pathlib import Path

import pytest
from cache_testutil import Records, key, result, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import ProbeCache, _lifecycle, open_cache

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
    assert tables == {"meta", "contexts", "configs", "probes", "templates", "bases"}
    assert conn.execute("PRAGMA user_version").fetchone()[0] == _lifecycle.SCHEMA_VERSION == 2
    conn.close()


def _page_size(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def test_a_new_store_takes_the_page_size_an_older_store_keeps_its_own(tmp_path, cache_log,
                                                                       monkeypatch):  # fmt: skip
    new = tmp_path / "new.sqlite"
    cache = ProbeCache(new)
    cache.put(key(1), result(1))
    cache.close()
    assert _page_size(new) == _lifecycle.PAGE_SIZE == 16384
    # A store written by an earlier version (4,096-byte pages, the same schema) is used as it is:
    # read, written, never moved aside, its pages unchanged.
    old = tmp_path / "old.sqlite"
    with monkeypatch.context() as m:
        m.setattr(_lifecycle, "PAGE_SIZE", 4096)
        cache = ProbeCache(old)
        cache.put(key(1), result(1))
        cache.close()
    assert _page_size(old) == 4096
    cache = ProbeCache(old)
    assert cache.get(key(1)) == result(1)
    cache.put(key(2), result(2))
    assert cache.mode == "rw" and len(cache) == 2
    cache.close()
    assert _page_size(old) == 4096 and not _quarantined(old)
    assert cache_log.at(logging.WARNING) == []


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


def _stored_then(path: Path, *statements: str) -> None:
    """A store holding one row, then ``statements`` run on its file by another writer."""
    ProbeCache(path).put(key(1), result(1))
    conn = sqlite3.connect(path)
    for sql in statements:
        conn.execute(sql)
    conn.commit()
    conn.close()


def _extra_table(path: Path) -> None:
    _stored_then(path, "CREATE TABLE surprise (x)")


def _newer_user_version(path: Path) -> None:
    _stored_then(path, "PRAGMA user_version=99")


def _newer_meta(path: Path) -> None:
    _stored_then(path, "UPDATE meta SET value='3' WHERE name='schema_version'")


def _older_meta(path: Path) -> None:
    """``user_version`` 2 (schema-2 tables) but ``meta`` says 1: not a schema we know."""
    _stored_then(path, "UPDATE meta SET value='1' WHERE name='schema_version'")


def _missing_table(path: Path) -> None:
    _stored_then(path, "DROP TABLE configs")


@pytest.mark.parametrize("make", [_foreign_db, _extra_table, _newer_user_version, _newer_meta,
                                  _older_meta, _missing_table])  # fmt: skip
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


# ------------------------------------------------------------------ storage edges: FIFOs, full
# disks, names too long, unsearchable directories, symlinks, permissions (from issue 12)
def _warnings(cache_log) -> list[str]:
    return cache_log.at(logging.WARNING)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def test_rows_are_served_read_only_when_the_disk_is_full(small_disk):
    store = ProbeCache(small_disk / "probes.sqlite")
    store.put_many([(key(i), result(i)) for i in range(20)])
    store.close()
    _fill(small_disk)
    again = ProbeCache(small_disk / "probes.sqlite")
    assert again.get(key(3)) == result(3)
    again.put(key(500), result(500))  # kept in memory
    assert again.get(key(500)) == result(500) and again.mode in ("ro", "rw")
    again.close()


def test_a_fifo_at_the_store_path_never_hangs(tmp_path):
    fifo = tmp_path / "probes.sqlite"
    os.mkfifo(fifo)
    for args in (["cache", "stats"], ["explain", "--seqlen", "128", "--device", "h100"]):
        proc = run_cli(args, {"TE_FL_ATTN_CACHE": str(fifo)}, timeout=60)
        assert proc.returncode == 0, proc
        assert "FIFO" in proc.stderr and "TE_FL_ATTN_CACHE" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_name_too_long_is_memory_mode_with_one_warning(tmp_path, cache_log):
    store = ProbeCache(tmp_path / ("x" * 300 + ".sqlite"))
    store.put(key(1), result(1))
    assert store.get(key(1)) == result(1) and store.mode == "memo"
    assert len(store.stats()["by_backend"]) == 1
    (warning,) = _warnings(cache_log)
    assert "TE_FL_ATTN_CACHE" in warning and "too long" in warning


def test_an_unsearchable_directory_is_memory_mode_with_one_warning(tmp_path, cache_log,
                                                                   monkeypatch):  # fmt: skip
    path = tmp_path / "locked" / "probes.sqlite"
    real_lstat = os.lstat

    def lstat(p, *a, **k):  # root ignores permissions: refuse like an unsearchable directory
        if str(p).startswith(str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", str(p))
        return real_lstat(p, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat)
    store = ProbeCache(path)
    store.put(key(1), result(1))
    assert store.get(key(1)) == result(1) and store.mode == "memo"
    (warning,) = _warnings(cache_log)
    assert "TE_FL_ATTN_CACHE" in warning and "Permission denied" in warning


def test_a_symlink_out_of_the_cache_dir_is_never_followed(tmp_path, cache_log):
    cache_dir, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache_dir.mkdir()
    elsewhere.mkdir()
    (cache_dir / "probes.sqlite").symlink_to(elsewhere / "victim.sqlite")  # dangling
    store = ProbeCache(cache_dir / "probes.sqlite")
    store.put(key(1), result(1))
    assert store.mode == "memo" and list(elsewhere.iterdir()) == []
    assert "symbolic link" in _warnings(cache_log)[0]


def test_an_explicit_path_needs_its_directory_the_default_one_is_created(tmp_path, monkeypatch,
                                                                         cache_log):  # fmt: skip
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "a" / "b" / "c.sqlite"))
    cache = open_cache()
    cache.put(key(1), result(1))
    assert cache.mode == "memo" and not (tmp_path / "a").exists()
    assert "does not exist" in _warnings(cache_log)[0]
    monkeypatch.delenv("TE_FL_ATTN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0)
    try:
        cache = open_cache()
        cache.put(key(1), result(1))
    finally:
        os.umask(old)
    assert cache.mode == "rw" and cache.path.is_relative_to(tmp_path / "xdg")
    assert cache.path.parent.stat().st_mode & 0o777 == 0o700
    cache.close()


def test_store_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = ProbeCache(tmp_path / "new" / "probes.sqlite")
        store.put(key(1), result(1))
        files = sorted(p for p in (tmp_path / "new").iterdir())
        assert {p.name for p in files} >= {"probes.sqlite", "probes.sqlite.lock"}
        for p in files:
            assert p.stat().st_mode & 0o777 == 0o600, p
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
        store.close()
    finally:
        os.umask(old)

"""The SQLite file's lifecycle, for :class:`.sqlite.ProbeCache`: opening, the shared lock,
path checks, schema validation and creation, quarantine (moving a damaged file aside),
degrading to memory, and running statements (:meth:`SQLiteFile.run`: busy retries, never
raises). See :mod:`.sqlite` for the guarantees.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from .. import files as _files
from .keys import package_version

try:  # POSIX only; elsewhere stores are never moved while possibly open elsewhere
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("te_fl_attention.cache")

#: Bumped when the table layout changes. Stored as ``PRAGMA user_version`` and in ``meta``.
#: Schema 2 (:mod:`.compact`) is schema 1 with the compact columns and tables added: a
#: schema-1 store is migrated in place when opened for writing (its rows kept as they are) and
#: read as it is otherwise.
SCHEMA_VERSION = 2
#: ``PRAGMA application_id`` of our stores ("TEFA").
APPLICATION_ID = 0x54454641
BUSY_TIMEOUT_S = 30.0
#: Page size of a new store (an existing store keeps its own; README, "Probe cache").
PAGE_SIZE = 16384
#: After ``busy_timeout`` expires, keep retrying with backoff up to this long in total.
BUSY_GIVE_UP_S = 120.0

_T = TypeVar("_T")

_SCHEMA_1 = {
    "meta": "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "contexts": (
        "CREATE TABLE contexts (ctx INTEGER PRIMARY KEY, device_fp TEXT NOT NULL,"
        " versions_key TEXT NOT NULL, device TEXT)"
    ),
    "configs": (
        "CREATE TABLE configs (config_key TEXT PRIMARY KEY, config TEXT NOT NULL) WITHOUT ROWID"
    ),
    "probes": (
        "CREATE TABLE probes (config_key TEXT NOT NULL, backend TEXT NOT NULL,"
        " ctx INTEGER NOT NULL, supported INTEGER NOT NULL, stage TEXT NOT NULL,"
        " elapsed_ms REAL NOT NULL, created_at REAL NOT NULL, package_version TEXT NOT NULL,"
        " crc INTEGER NOT NULL, result TEXT NOT NULL,"
        " PRIMARY KEY (config_key, backend, ctx)) WITHOUT ROWID"
    ),
}
#: Schema 1 to 2 (SQLite's ``ADD COLUMN`` writes the DDL of :data:`_SCHEMA`'s tables).
_MIGRATE_2 = (
    "ALTER TABLE configs ADD COLUMN base INTEGER",
    "ALTER TABLE probes ADD COLUMN rid INTEGER",
    "ALTER TABLE probes ADD COLUMN e1 REAL",
    "ALTER TABLE probes ADD COLUMN e2 REAL",
    "ALTER TABLE probes ADD COLUMN e3 REAL",
)
_NEW_2 = {
    "templates": (
        "CREATE TABLE templates (rid INTEGER PRIMARY KEY, backend TEXT NOT NULL,"
        " supported INTEGER NOT NULL, stage TEXT NOT NULL, holes INTEGER NOT NULL,"
        " template TEXT NOT NULL)"
    ),
    "bases": "CREATE TABLE bases (base INTEGER PRIMARY KEY, config TEXT NOT NULL)",
}
_SCHEMA = {
    "meta": _SCHEMA_1["meta"],
    "contexts": _SCHEMA_1["contexts"],
    "configs": (
        "CREATE TABLE configs (config_key TEXT PRIMARY KEY, config TEXT NOT NULL, base INTEGER)"
        " WITHOUT ROWID"
    ),
    "probes": (
        "CREATE TABLE probes (config_key TEXT NOT NULL, backend TEXT NOT NULL,"
        " ctx INTEGER NOT NULL, supported INTEGER NOT NULL, stage TEXT NOT NULL,"
        " elapsed_ms REAL NOT NULL, created_at REAL NOT NULL, package_version TEXT NOT NULL,"
        " crc INTEGER NOT NULL, result TEXT NOT NULL, rid INTEGER, e1 REAL, e2 REAL, e3 REAL,"
        " PRIMARY KEY (config_key, backend, ctx)) WITHOUT ROWID"
    ),
    **_NEW_2,
}
_SCHEMAS = {1: _SCHEMA_1, 2: _SCHEMA}


def _same_ddl(tables: dict[str, str], schema: dict[str, str]) -> bool:
    return set(tables) == set(schema) and all(
        " ".join(tables[n].split()) == " ".join(ddl.split()) for n, ddl in schema.items())

# SQLite primary result codes, grouped by what we do about them.
_BUSY_CODES = {5, 6, 15}  # BUSY, LOCKED, PROTOCOL
_CORRUPT_CODES = {1, 11, 17, 20, 26}  # ERROR (schema gone), CORRUPT, SCHEMA, MISMATCH, NOTADB
_UNWRITABLE_CODES = {3, 7, 8, 10, 13, 14, 23}  # PERM, NOMEM, READONLY, IOERR, FULL, CANTOPEN, AUTH


class StoreUnusable(Exception):
    """The file is not a usable store of ours (raised internally; triggers quarantine)."""


#: What a damaged or unavailable file can raise: sqlite3 errors, and UnicodeDecodeError when
#: SQLite's error message quotes damaged schema text.
DB_ERRORS = (sqlite3.Error, UnicodeDecodeError)


def classify(exc: BaseException) -> str:
    """``busy`` | ``corrupt`` | ``unwritable`` | ``other`` for an sqlite3 error."""
    if isinstance(exc, UnicodeDecodeError):
        return "corrupt"
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        primary = code & 0xFF
        if primary in _BUSY_CODES:
            return "busy"
        if primary in _CORRUPT_CODES:
            return "corrupt"
        if primary in _UNWRITABLE_CODES:
            return "unwritable"
        return "other"
    msg = str(exc).lower()
    if "locked" in msg or "busy" in msg:
        return "busy"
    if "malformed" in msg or "not a database" in msg or "no such table" in msg:
        return "corrupt"
    if any(s in msg for s in ("readonly", "read-only", "disk i/o", "disk is full",
                              "unable to open", "permission")):  # fmt: skip
        return "unwritable"
    return "other"



# ------------------------------------------------------------------------- open stores and fork
OPEN_STORES: weakref.WeakSet[SQLiteFile] = weakref.WeakSet()
_ABANDONED: list[sqlite3.Connection] = []  # inherited across fork without the hook: never closed


def _close_before_fork() -> None:
    for store in list(OPEN_STORES):
        store._release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_close_before_fork)


@contextlib.contextmanager
def write_txn(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; on any exception roll back (quietly) and re-raise."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


class SQLiteFile:
    """The file half of :class:`.sqlite.ProbeCache` (its ``__init__`` sets these attributes)."""

    path: Path
    readonly: bool
    create_dir: bool
    problem: str | None
    busy_timeout_s: float
    _lock: threading.RLock
    _conn: sqlite3.Connection | None
    _pid: int
    _lock_fd: int | None
    _writable: bool
    _dead: bool
    _known_ctx: dict[int, bool]
    _known_cfg: set[str]
    #: The open file's schema (1: a schema-1 store read without migrating it).
    schema: int
    _warned: set[str]

    # ---------------------------------------------------------------- logging / degrading
    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(msg, *args)

    def _degrade(self, reason: str, *, keep_reads: bool) -> None:
        """Stop writing (and reading, unless ``keep_reads``) the file for this process."""
        self._writable = False
        self.problem = reason
        if not keep_reads:
            self._drop_connection()
            self._dead = True
        if self.readonly:  # expected in read-only mode: no warning
            log.debug("probe cache %s: %s", self.path, reason)
        else:
            self._warn("degrade", "probe cache %s cannot be written (%s); new results are kept "
                       "in memory for this process%s (TE_FL_ATTN_CACHE names the cache file; "
                       "off: no file)", self.path, reason,
                       "; stored results are still used" if keep_reads else "")  # fmt: skip

    def _unusable(self, reason: str) -> None:
        """The file is damaged/foreign and cannot be replaced: memory only for this process."""
        self._drop_connection()
        self._writable = False
        self._dead = True
        self.problem = reason
        if self.readonly:
            log.debug("probe cache %s is unusable (%s)", self.path, reason)
        else:
            self._warn("unusable", "probe cache %s is unusable (%s); new results are kept in "
                       "memory for this process (TE_FL_ATTN_CACHE names the cache file; off: "
                       "no file)", self.path, reason)  # fmt: skip

    # ---------------------------------------------------------------- connection lifecycle
    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._known_ctx.clear()
        self._known_cfg.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _release(self) -> None:
        """Close the connection and the lock file (before fork, and in :meth:`close`)."""
        with self._lock:
            self._drop_connection()
            if self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
                self._lock_fd = None

    def close(self) -> None:
        """Close the file; the store reopens it on next use."""
        self._release()

    def __del__(self) -> None:
        # sqlite3 connections sit in a reference cycle (their statement cache) and the lock is a
        # bare fd: release both now rather than at some later GC pass (never in a forked child).
        # try/except, not contextlib: at interpreter exit module globals may already be gone.
        try:
            if self._pid == os.getpid():
                self._release()
        except Exception:  # noqa: BLE001
            pass

    def _connection(self) -> sqlite3.Connection | None:
        """The process's connection, opened on first use (``None``: memo only)."""
        pid = os.getpid()
        if pid != self._pid:  # forked without the at-fork hook: never touch the parent's handle
            if self._conn is not None:
                _ABANDONED.append(self._conn)  # closing it here could disturb the parent's locks
            self._conn = None
            if self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)  # the parent's flock stays (it holds its own fd)
            self._lock_fd = None
            self._known_ctx = {}
            self._known_cfg = set()
            self._pid = pid
        if self._conn is None and not self._dead:
            self._open()
        return self._conn

    def _connect(self, readonly: bool, *, immutable: bool = False) -> sqlite3.Connection:
        if readonly:
            uri = f"file:{quote(str(self.path))}?mode=ro"
            if immutable or not os.access(self.path.parent, os.W_OK):
                uri += "&immutable=1"  # WAL needs a -shm file; nobody can be writing here anyway
            conn = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)  # fmt: skip
        else:
            conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)  # fmt: skip
        conn.text_factory = _text  # a damaged row must read as a miss, not fail the query
        conn.execute("PRAGMA cache_size=-16384")
        return conn

    def _lock_path(self) -> str:
        return f"{self.path}.lock"

    def _take_shared_lock(self) -> None:
        if fcntl is None or self._lock_fd is not None:
            return
        try:
            flags = os.O_RDONLY if self.readonly else os.O_RDWR | os.O_CREAT
            flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
            fd = os.open(self._lock_path(), flags, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return
        except OSError:
            return
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:  # someone holds it exclusively for too long
                    os.close(fd)
                    return
                time.sleep(0.005)
        self._lock_fd = fd

    def _path_problem(self) -> tuple[str, bool] | None:
        """Why the path must not be opened, and whether the file exists (looked at with
        ``lstat``/``stat`` only: opening a FIFO or a device could block or read forever)."""
        path = self.path
        try:
            st: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            return f"cannot look at it: {exc.strerror or exc}", False
        if st is not None and stat.S_ISLNK(st.st_mode):
            real = os.path.realpath(path)
            home = os.path.realpath(path.parent)
            if os.path.dirname(real) != home:
                return f"it is a symbolic link to {real}, outside {home}", True
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            except OSError as exc:
                return f"cannot look at it: {exc.strerror or exc}", False
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                return f"it is {_files.kind(st.st_mode)}, not a regular file", True
            return None
        if self.readonly:
            return "no such file", False
        try:
            pst = os.stat(path.parent)
        except FileNotFoundError:
            if self.create_dir:
                return None
            return f"its directory {path.parent} does not exist", False
        except OSError as exc:
            return f"cannot look at {path.parent}: {exc.strerror or exc}", False
        if not stat.S_ISDIR(pst.st_mode):
            return f"{path.parent} is not a directory", False
        return None

    def _open(self) -> None:
        """Open (creating or rebuilding if needed) and validate; degrade on failure."""
        problem = self._path_problem()
        if problem is not None:
            if self.readonly and problem[0] == "no such file":
                self._degrade("no such file", keep_reads=False)
            else:
                self._unusable(problem[0])
            return
        if not self.readonly:
            try:
                _files.make_private_dirs(self.path.parent)
                _create_private_file(self.path)
            except OSError as exc:
                self._open_for_reading(f"cannot create {self.path}: {exc.strerror or exc}")
                return
        self._take_shared_lock()
        deadline = time.monotonic() + BUSY_GIVE_UP_S
        rebuilt = False
        attempt = 0
        while True:
            conn: sqlite3.Connection | None = None
            try:
                problem = None if self.readonly else _header_problem(self.path)
                if problem:
                    raise StoreUnusable(problem)
                conn = self._connect(self.readonly)
                self._validate(conn, create=not self.readonly)
                self._conn = conn
                return
            except StoreUnusable as exc:
                reason = str(exc)
            except DB_ERRORS as exc:
                kind, reason = classify(exc), str(exc)
                if conn is not None:
                    conn.close()
                    conn = None
                if kind == "busy" and time.monotonic() < deadline:
                    attempt += 1
                    time.sleep(_backoff(attempt))
                    continue
                if kind != "corrupt":
                    self._open_for_reading(reason)
                    return
            if conn is not None:
                conn.close()
            # The file is damaged, foreign or newer than us.
            if self.readonly or rebuilt:
                self._unusable(reason)
                return
            if not self._quarantine(reason):
                return
            rebuilt = True
            with contextlib.suppress(OSError):
                _create_private_file(self.path)

    def _open_for_reading(self, reason: str) -> None:
        """The file cannot be opened for writing: read what we can, keep new results in memory."""
        conn = None
        exists = os.path.isfile(self.path) and os.path.getsize(self.path) > 0
        for immutable in (False, True) if not self.readonly and exists else ():
            try:  # immutable: e.g. a full disk, where even the -shm file cannot be made
                conn = self._connect(True, immutable=immutable)
                self._validate(conn, create=False)
                break
            except (*DB_ERRORS, StoreUnusable):
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
                conn = None
        self._conn = conn
        self._degrade(reason, keep_reads=conn is not None)

    def _validate(self, conn: sqlite3.Connection, *, create: bool) -> None:
        """Check the file is a current store of ours; create the schema in an empty file."""
        conn.execute("BEGIN")  # one consistent snapshot for all the checks
        try:
            app = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {str(n): str(q) for n, q in conn.execute(
                "SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}  # fmt: skip
            names = set(tables)
            meta = (dict(conn.execute("SELECT name, value FROM meta").fetchall())
                    if "meta" in names else {})  # fmt: skip
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")
        if not names and app == 0 and version == 0:
            if not create:
                raise StoreUnusable("empty file")
            self._create(conn)
            return
        if app != APPLICATION_ID:
            raise StoreUnusable(f"not a te_fl_attention cache (tables: {', '.join(sorted(names))})")
        meta_text = str(meta.get("schema_version", ""))
        meta_version = int(meta_text) if meta_text.isdigit() else -1
        if max(version, meta_version) > SCHEMA_VERSION:
            raise StoreUnusable(f"schema version {max(version, meta_version)} is newer than this "
                                f"package's {SCHEMA_VERSION}")  # fmt: skip
        schema = _SCHEMAS.get(version)
        if schema is None or meta_version != version or not _same_ddl(tables, schema):
            raise StoreUnusable(f"unexpected schema (version {version}/{meta_text or '?'}, "
                                f"tables: {', '.join(sorted(names))})")  # fmt: skip
        if create:
            self._set_wal(conn)
            if version < SCHEMA_VERSION:
                self._migrate(conn)
                version = SCHEMA_VERSION
        self.schema = version

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Schema 1 to 2 in one write transaction (the rows are kept as they are: schema 2 reads
        them); nothing when another process migrated it meanwhile."""
        with write_txn(conn):
            migrate = conn.execute("PRAGMA user_version").fetchone()[0] == 1
            if migrate:
                for sql in (*_MIGRATE_2, *_NEW_2.values()):
                    conn.execute(sql)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'",
                             (str(SCHEMA_VERSION),))  # fmt: skip
                conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('migrated_at', ?)",
                             (repr(time.time()),))  # fmt: skip
        if migrate:
            log.info("probe cache %s: schema 1 migrated to %d (rows kept)", self.path,
                     SCHEMA_VERSION)  # fmt: skip

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        conn.execute("PRAGMA synchronous=NORMAL")
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL journal (got {mode}): disk I/O")

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # (before the file's first write)
        self._set_wal(conn)
        with write_txn(conn):
            names = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}  # fmt: skip
            if not names:
                for ddl in _SCHEMA.values():
                    conn.execute(ddl)
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                conn.executemany("INSERT INTO meta (name, value) VALUES (?, ?)", [
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created_by", package_version()),
                    ("created_at", repr(time.time())),
                ])  # fmt: skip
        if names:  # another process created it meanwhile (nothing written): validate what it made
            self._validate(conn, create=False)
            return
        self.schema = SCHEMA_VERSION

    def _quarantine(self, reason: str) -> bool:
        """Move the file aside (if nobody else has it open) and start afresh; False: memo only."""
        self._drop_connection()
        exclusive = self._try_exclusive()
        if exclusive is False:
            self._unusable(f"{reason}; not moved aside: other processes have it open")
            return False
        try:
            dest = _move_aside(self.path)
        except OSError as exc:
            self._degrade(f"unusable ({reason}) and cannot be moved aside: {exc}", keep_reads=False)
            return False
        finally:
            if exclusive and self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
        if dest is not None:
            log.warning("probe cache %s is unusable (%s); moved it to %s and started a new one",
                        self.path, reason, dest)  # fmt: skip
            self._warned.add("unusable")
        return True

    def _try_exclusive(self) -> bool | None:
        """Upgrade our lock to exclusive: True, False (others hold it), None (no locking)."""
        if fcntl is None or self._lock_fd is None:
            return None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            return False

    # ---------------------------------------------------------------- running statements
    def run(self, fn: Callable[[sqlite3.Connection], _T], *, write: bool, miss: _T) -> _T:
        """Run ``fn(conn)`` under the lock, retrying when busy; on failure degrade, never raise."""
        deadline = 0.0
        attempt = 0
        recovered = False
        while True:
            with self._lock:
                conn = self._connection()
                if conn is None or (write and not self._writable):
                    return miss
                try:
                    return fn(conn)
                except DB_ERRORS as exc:
                    if conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    kind, reason = classify(exc), str(exc)
                    if kind == "corrupt":
                        if recovered or self.readonly:
                            self._unusable(reason)
                            return miss
                        recovered = True
                        if self._quarantine(reason):
                            continue  # retry once on the rebuilt store
                        return miss
                    if kind == "unwritable" or (kind == "other" and write):
                        self._degrade(reason, keep_reads=write)
                        return miss
                    if kind == "other":
                        self._warn("read", "probe cache %s: read failed (%s); treating it as a "
                                   "miss", self.path, reason)  # fmt: skip
                        return miss
            now = time.monotonic()
            if not deadline:
                deadline = now + BUSY_GIVE_UP_S
            elif now > deadline:
                self._warn("busy", "probe cache %s stayed locked for %.0f s; keeping this "
                           "result in memory", self.path, BUSY_GIVE_UP_S)  # fmt: skip
                return miss
            attempt += 1
            time.sleep(_backoff(attempt))


def _text(data: bytes) -> str:
    """SQLite text -> str; invalid UTF-8 (a damaged page) is replaced, so its CRC fails."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace")


def _backoff(attempt: int) -> float:
    """Jittered exponential backoff: ~0.5 ms doubling to 50 ms."""
    return min(0.0005 * 2 ** min(attempt, 10), 0.05) * random.uniform(0.5, 1.5)


def _header_problem(path: Path) -> str | None:
    """A cheap look at the file header: why it cannot be a healthy SQLite file, or ``None``."""
    try:
        size = path.stat().st_size
        if size == 0:
            return None
        with _files.open_regular(path) as f:
            head = f.read(100)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # let SQLite report it
    if len(head) < 100:
        return f"file too short to be an SQLite database ({size} bytes)"
    if not head.startswith(b"SQLite format 3\x00"):
        return "not an SQLite database"
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return f"bad page size {page_size}"
    pages = int.from_bytes(head[28:32], "big")
    wal = Path(f"{path}-wal")
    if pages and head[24:28] == head[92:96] and not wal.exists():
        if size < pages * page_size:
            return f"truncated: {size} bytes, header says {pages * page_size}"
    return None


def _create_private_file(path: Path) -> None:
    """Create an empty store file ``0600`` if none is there (SQLite gives its -wal and -shm
    files the same mode). Never follows a symbolic link; an existing file is left alone."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _move_aside(path: Path) -> Path | None:
    """Rename ``path`` (and its WAL) to ``<path>.corrupt-<timestamp>``; None if it is gone."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = Path(f"{path}.corrupt-{stamp}")
    n = 0
    while dest.exists():
        n += 1
        dest = Path(f"{path}.corrupt-{stamp}-{n}")
    os.replace(path, dest)
    for suffix in ("-wal", "-journal"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            with contextlib.suppress(OSError):
                os.replace(side, Path(f"{dest}{suffix}"))
    with contextlib.suppress(OSError):
        os.remove(f"{path}-shm")
    return dest


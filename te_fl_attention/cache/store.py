"""`ProbeCache`: probe results persisted in one SQLite file, shared by every process on a machine.

Design:

* WAL journal, ``synchronous=NORMAL``: a ``put`` that returned survives the process being killed
  (not necessarily a power cut). Readers never block writers.
* One connection per process, opened lazily; connections are closed before ``fork`` and reopened
  in both parent and child. ``SQLITE_BUSY`` is retried (``busy_timeout`` then our own backoff), so
  concurrent writers never see an error.
* Rows are keyed ``(config_key, backend, ctx)`` where ``ctx`` is a 63-bit id derived from
  ``(device_fp, versions_key)``; the ``contexts`` table maps it back (and holds the device JSON),
  ``configs`` holds each config's JSON once. Each row carries a CRC over its key and result, so
  a damaged row is a miss, never a wrong hit.
* A store that is not ours, damaged or from a newer schema is moved aside as
  ``<path>.corrupt-<timestamp>`` and rebuilt, with one warning. Moving aside needs an exclusive
  ``flock`` on ``<path>.lock`` (every open store holds a shared one), so a file other processes
  are using is never moved; this process then keeps results in memory instead.
* A store that cannot be written degrades to an in-process memo with one warning (rows already
  stored are still served, read-only); :attr:`ProbeCache.problem` says why.
* The path is looked at before anything opens it: a FIFO, device or directory there, a symbolic
  link that leads out of the cache directory, or a path that cannot be looked at (permission,
  name too long) is never opened: memory mode, with one warning naming ``TE_FL_ATTN_CACHE``. The
  default cache directory is created ``0700`` and the store file ``0600`` (whatever the umask);
  an explicitly named path's directory must exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import sqlite3
import stat
import threading
import time
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import quote

from ..reasons import ProbeResult
from ..switches import switch
from . import _files, _json
from .keys import CacheKey, package_version

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

try:  # POSIX only; elsewhere stores are never moved while possibly open elsewhere
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("te_fl_attention.cache")

#: Bumped when the table layout changes. Stored as ``PRAGMA user_version`` and in ``meta``.
SCHEMA_VERSION = 1
#: ``PRAGMA application_id`` of our stores ("TEFA").
APPLICATION_ID = 0x54454641
BUSY_TIMEOUT_S = 30.0
#: After ``busy_timeout`` expires, keep retrying with backoff up to this long in total.
BUSY_GIVE_UP_S = 120.0
#: ``prune --older-than`` also deletes rows stamped more than this far in the future.
FUTURE_SKEW_S = 300.0

OnConflict = Literal["replace", "ignore", "newer"]
_T = TypeVar("_T")

_SCHEMA = {
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

_COLUMNS = (
    "config_key, backend, ctx, supported, stage, elapsed_ms, created_at, package_version, crc,"
    " result"
)
_UPDATE = (
    "supported=excluded.supported, stage=excluded.stage, elapsed_ms=excluded.elapsed_ms,"
    " created_at=excluded.created_at, package_version=excluded.package_version,"
    " crc=excluded.crc, result=excluded.result"
)
_INSERT = {
    "replace": f"INSERT INTO probes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)"
    f" ON CONFLICT (config_key, backend, ctx) DO UPDATE SET {_UPDATE}",
    "ignore": f"INSERT INTO probes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)"
    " ON CONFLICT DO NOTHING",
    "newer": f"INSERT INTO probes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)"
    f" ON CONFLICT (config_key, backend, ctx) DO UPDATE SET {_UPDATE}"
    " WHERE excluded.created_at > probes.created_at",
}
_INSERT_CTX = (
    "INSERT INTO contexts (ctx, device_fp, versions_key, device) VALUES (?,?,?,?)"
    " ON CONFLICT (ctx) DO UPDATE SET device=excluded.device"
    " WHERE contexts.device IS NULL AND excluded.device IS NOT NULL"
)
_INSERT_CFG = "INSERT INTO configs (config_key, config) VALUES (?,?) ON CONFLICT DO NOTHING"
# Lookups read the result as its stored UTF-8 bytes (checksummed and parsed without decoding);
# a value that is not text (a damaged row) reads as NULL, a miss.
_RESULT_UTF8 = "CASE WHEN typeof(result) = 'text' THEN CAST(result AS BLOB) END"
_GET = f"SELECT crc, {_RESULT_UTF8} FROM probes WHERE config_key=? AND backend=? AND ctx=?"
_GET_CONFIG = f"SELECT backend, crc, {_RESULT_UTF8} FROM probes WHERE config_key=? AND ctx=?"
_EXISTS = "SELECT 1 FROM probes WHERE config_key=? AND backend=? AND ctx=?"
_ROWS = (
    "SELECT p.config_key, p.backend, p.ctx, p.created_at, p.package_version, p.crc, p.result,"
    " c.device_fp, c.versions_key, c.device, g.config FROM probes p"
    " LEFT JOIN contexts c ON c.ctx = p.ctx LEFT JOIN configs g ON g.config_key = p.config_key"
)

# SQLite primary result codes, grouped by what we do about them.
_BUSY_CODES = {5, 6, 15}  # BUSY, LOCKED, PROTOCOL
_CORRUPT_CODES = {1, 11, 17, 20, 26}  # ERROR (schema gone), CORRUPT, SCHEMA, MISMATCH, NOTADB
_UNWRITABLE_CODES = {3, 7, 8, 10, 13, 14, 23}  # PERM, NOMEM, READONLY, IOERR, FULL, CANTOPEN, AUTH

_dumps = functools.partial(json.dumps, separators=(",", ":"))
_json_loads = _json.loads
_from_dict = ProbeResult.from_dict
#: A made-up stored result (reasons, variants, detail) that :meth:`ProbeCache.warm_up` decodes.
_WARM_ROW = _dumps({
    "backend": "flash", "supported": True, "reasons": [], "stage": "rule", "evidence": "rules",
    "elapsed_ms": 0.25, "detail": {"variant": "fa2"}, "variants": [
        {"backend": "fa2", "supported": True, "reasons": [], "stage": "rule",
         "evidence": "rules", "elapsed_ms": 0.0, "detail": {}, "variants": []},
        {"backend": "fa3", "supported": False, "reasons": [
            {"code": "sm", "message": "needs sm90", "stage": "rule", "observed": 80,
             "limit": [90, 90], "hint": None}],
         "stage": "rule", "evidence": "rules", "elapsed_ms": 0.0, "detail": {}, "variants": []},
    ],
}).encode()  # fmt: skip


class StoreUnusable(Exception):
    """The file is not a usable store of ours (raised internally; triggers quarantine)."""


#: What a damaged or unavailable file can raise: sqlite3 errors, and UnicodeDecodeError when
#: SQLite's error message quotes damaged schema text.
_DB_ERRORS = (sqlite3.Error, UnicodeDecodeError)


def _classify(exc: BaseException) -> str:
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


@functools.lru_cache(maxsize=1024)
def ctx_id(device_fp: str, versions_key: str) -> int:
    """The 63-bit row id of a (device, software stack) pair."""
    digest = hashlib.sha256(f"{device_fp}:{versions_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def row_crc(key: CacheKey, result_json: str) -> int:
    """CRC32 over a row's key and result text: a damaged row reads as a miss."""
    return zlib.crc32("\0".join((*key, result_json)).encode())


def _row_crc_bytes(key: CacheKey, result_utf8: bytes) -> int:
    """:func:`row_crc` of a result read as its UTF-8 bytes (equal for the same text)."""
    return zlib.crc32(result_utf8, zlib.crc32(f"{key[0]}\0{key[1]}\0{key[2]}\0{key[3]}\0".encode()))


def _finite(value: Any) -> float:
    """A finite float for a REAL column (SQLite stores NaN as NULL)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def _as_dict(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    return dict(obj)


def _loads_dict(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class CacheRow:
    """One stored result with its bookkeeping (what ``iter_rows``/``export`` see).

    ``result`` is the :meth:`ProbeResult.to_dict` form; ``config``/``device`` are the optional
    JSON forms of the config and device (for display only: the key is what matters).
    ``result_json``: ``result``'s JSON text when it is already known (an import parsed and checked
    it), stored as is; ``None``: written when stored. Never compared.
    """

    key: CacheKey
    result: Mapping[str, Any]
    created_at: float
    package_version: str
    config: Mapping[str, Any] | None = None
    device: Mapping[str, Any] | None = None
    result_json: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def probe_result(self) -> ProbeResult:
        return ProbeResult.from_dict(self.result)

    def to_dict(self) -> dict[str, Any]:
        """The export form (one JSON Lines row)."""
        return {
            "config_key": self.key.config_key,
            "backend": self.key.backend,
            "device_fp": self.key.device_fp,
            "versions_key": self.key.versions_key,
            "result": dict(self.result),
            "config": dict(self.config) if self.config is not None else None,
            "device": dict(self.device) if self.device is not None else None,
            "created_at": self.created_at,
            "package_version": self.package_version,
        }


#: What ``put_many`` accepts: rows, or ``(key, result)`` / ``(key, result, config, device)``.
PutItem = Any


def make_row(
    key: CacheKey,
    result: ProbeResult | Mapping[str, Any],
    config: FusedAttnConfig | Mapping[str, Any] | None = None,
    device: DeviceProfile | Mapping[str, Any] | None = None,
    *,
    created_at: float | None = None,
) -> CacheRow:
    """A :class:`CacheRow` for a fresh result (validates the key)."""
    result_d = result.to_dict() if isinstance(result, ProbeResult) else dict(result)
    return CacheRow(
        key=CacheKey(*key).check(),
        result=result_d,
        created_at=time.time() if created_at is None else float(created_at),
        package_version=package_version(),
        config=_as_dict(config),
        device=_as_dict(device),
    )


@contextlib.contextmanager
def _write_txn(conn: sqlite3.Connection) -> Iterator[None]:
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


def _keep_set(keys: str | Iterable[str] | None) -> frozenset[str] | None:
    if keys is None:
        return None
    return frozenset([keys] if isinstance(keys, str) else keys)


def _to_row(item: PutItem, checked: bool = False) -> CacheRow:
    if isinstance(item, CacheRow):
        if not checked:
            item.key.check()
        return item
    return make_row(*item)


def _checked_row(key: CacheKey, result: dict[str, Any], created_at: float, package_version: str,
                 config: dict[str, Any] | None, device: dict[str, Any] | None,
                 result_json: str | None) -> CacheRow:  # fmt: skip
    """``CacheRow(...)`` for values an import has just checked (fills the frozen instance
    directly: the dataclass ``__init__`` only sets these fields)."""
    row = object.__new__(CacheRow)
    row.__dict__.update(key=key, result=result, created_at=created_at,
                        package_version=package_version, config=config, device=device,
                        result_json=result_json)  # fmt: skip
    return row


def _row_params(row: CacheRow) -> tuple[Any, ...]:
    """The ``probes`` insert parameters of a row."""
    key = row.key
    text = row.result_json
    if text is None:
        text = _dumps(row.result)
    res = row.result
    return (
        key.config_key, key.backend, ctx_id(key.device_fp, key.versions_key),
        1 if res.get("supported") else 0, str(res.get("stage", "rule")),
        _finite(res.get("elapsed_ms")), _finite(row.created_at), str(row.package_version),
        row_crc(key, text), text,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ base class
class _BaseCache:
    """What :class:`ProbeCache` and :class:`MemoryCache` share (the in-process part)."""

    path: Path | None = None

    def __init__(self) -> None:
        self._memo: dict[CacheKey, tuple[CacheRow, ProbeResult]] = {}
        self._configs: dict[str, Mapping[str, Any]] = {}  # config JSON, once per config key
        self._devices: dict[tuple[str, str], Mapping[str, Any]] = {}  # device JSON per context
        self._lock = threading.RLock()

    # memo helpers
    def _memo_put(self, row: CacheRow, on_conflict: OnConflict = "replace") -> bool:
        old = self._memo.get(row.key)
        if old is not None and (
            on_conflict == "ignore"
            or (on_conflict == "newer" and row.created_at <= old[0].created_at)
        ):
            return False
        self._memo[row.key] = (row, ProbeResult.from_dict(row.result))
        if row.config is not None:
            self._configs.setdefault(row.key.config_key, row.config)
        if row.device is not None:
            self._devices.setdefault((row.key.device_fp, row.key.versions_key), row.device)
        return True

    def _memo_row(self, row: CacheRow) -> CacheRow:
        """A memo row with the config/device JSON filled in from other rows (as SQLite does)."""
        if row.config is None or row.device is None:
            config = row.config or self._configs.get(row.key.config_key)
            device = row.device or self._devices.get((row.key.device_fp, row.key.versions_key))
            if config is not row.config or device is not row.device:
                return dataclasses.replace(row, config=config, device=device)
        return row

    def _memo_prune(self, older_than_s: float | None, keep: frozenset[str] | None) -> int:
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        future = time.time() + FUTURE_SKEW_S
        doomed = [
            k for k, (row, _) in self._memo.items()
            if (cutoff is not None and not cutoff <= row.created_at <= future)
            or (keep is not None and k.versions_key not in keep)
        ]  # fmt: skip
        for k in doomed:
            del self._memo[k]
        return len(doomed)

    @staticmethod
    def _tally(rows: Iterable[CacheRow]) -> dict[str, Any]:
        by_backend: Counter[str] = Counter()
        by_device: Counter[str] = Counter()
        by_versions: Counter[str] = Counter()
        by_verdict: Counter[str] = Counter()
        names: dict[str, str] = {}
        for row in rows:
            by_backend[row.key.backend] += 1
            by_device[row.key.device_fp] += 1
            by_versions[row.key.versions_key] += 1
            by_verdict["supported" if row.result.get("supported") else "unsupported"] += 1
            if row.device and isinstance(row.device.get("name"), str):
                names[row.key.device_fp] = row.device["name"]
        return {
            "entries": sum(by_backend.values()),
            "by_backend": dict(by_backend),
            "by_device": dict(by_device),
            "device_names": names,
            "by_versions_key": dict(by_versions),
            "by_verdict": {
                "supported": by_verdict["supported"],
                "unsupported": by_verdict["unsupported"],
            },  # fmt: skip
        }

    # public API shared by both
    def put(
        self,
        key: CacheKey,
        result: ProbeResult,
        *,
        config: FusedAttnConfig | Mapping[str, Any] | None = None,
        device: DeviceProfile | Mapping[str, Any] | None = None,
    ) -> None:
        """Store ``result`` under ``key`` (replacing a row with the same key)."""
        self.put_many([make_row(key, result, config, device)], checked=True)

    def put_many(
        self, items: Iterable[PutItem], *, on_conflict: OnConflict = "replace",
        checked: bool = False,
    ) -> int:  # fmt: skip
        raise NotImplementedError

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]:
        """The hits among ``keys`` (misses are absent)."""
        out: dict[CacheKey, ProbeResult] = {}
        for key in keys:
            hit = self.get(key)
            if hit is not None:
                out[CacheKey(*key)] = hit
        return out

    def get(self, key: CacheKey) -> ProbeResult | None:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Start-up work for lookups (nothing to do in memory; see :meth:`ProbeCache.warm_up`)."""

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        raise NotImplementedError

    def get_row(self, key: CacheKey) -> CacheRow | None:
        """The stored row for ``key`` with its bookkeeping (``created_at``...), or ``None``."""
        return self.get_rows([key]).get(CacheKey(*key))

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


class MemoryCache(_BaseCache):
    """The same API as :class:`ProbeCache`, in process memory only (``TE_FL_ATTN_CACHE=off``)."""

    mode = "memory"

    def __repr__(self) -> str:
        return f"MemoryCache({len(self)} entries)"

    def get(self, key: CacheKey) -> ProbeResult | None:
        hit = self._memo.get(key)
        return hit[1] if hit else None

    def put_many(
        self, items: Iterable[PutItem], *, on_conflict: OnConflict = "replace",
        checked: bool = False,
    ) -> int:  # fmt: skip
        """Store many rows; returns how many were written (see :meth:`ProbeCache.put_many`)."""
        with self._lock:
            return sum(self._memo_put(_to_row(item, checked), on_conflict) for item in items)

    def __len__(self) -> int:
        return len(self._memo)

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        """The stored rows (with bookkeeping) among ``keys``."""
        out = {}
        for k in keys:
            hit = self._memo.get(CacheKey(*k))
            if hit is not None:
                out[hit[0].key] = self._memo_row(hit[0])
        return out

    def iter_rows(
        self,
        *,
        backend: str | None = None,
        config_prefix: str | None = None,
        device_fp: str | None = None,
    ) -> Iterator[CacheRow]:
        """Every row (optionally filtered), in key order."""
        with self._lock:
            rows = [self._memo_row(row) for row, _ in self._memo.values()]
        for row in sorted(rows, key=lambda r: r.key):
            if backend is not None and row.key.backend != backend:
                continue
            if config_prefix is not None and not row.key.config_key.startswith(config_prefix):
                continue
            if device_fp is not None and row.key.device_fp != device_fp:
                continue
            yield row

    def recent(self, limit: int, *, backend: str | None = None) -> list[CacheRow]:
        """The ``limit`` most recently stored rows (``limit <= 0``: all), newest first."""
        rows = sorted(self.iter_rows(backend=backend), key=lambda r: r.created_at, reverse=True)
        return rows[:limit] if limit > 0 else rows

    def stats(self) -> dict[str, Any]:
        """Counts by backend, device, software stack and verdict."""
        return {"path": None, "mode": self.mode, "size_bytes": 0,
                **self._tally(self.iter_rows())}  # fmt: skip

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int:  # fmt: skip
        """Drop rows older than ``older_than_s`` and/or from another software stack."""
        with self._lock:
            return self._memo_prune(older_than_s, _keep_set(not_versions_key))

    def clear(self) -> int:
        """Drop every row; returns how many."""
        with self._lock:
            n = len(self._memo)
            self._memo.clear()
            self._configs.clear()
            return n

    def close(self) -> None:
        """Nothing to release (kept for API symmetry)."""


# ------------------------------------------------------------------------------- the SQLite store
_OPEN_STORES: weakref.WeakSet[ProbeCache] = weakref.WeakSet()
_ABANDONED: list[sqlite3.Connection] = []  # inherited across fork without the hook: never closed


def _close_before_fork() -> None:
    for store in list(_OPEN_STORES):
        store._release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_close_before_fork)


class ProbeCache(_BaseCache):
    """Probe results in one SQLite file (see the module docstring for the guarantees).

    No method raises on a storage problem: reads miss, writes fall back to process memory, and
    each kind of trouble is logged once per store on ``te_fl_attention.cache``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        create_dir: bool = True,
    ) -> None:
        super().__init__()
        self.path = Path(path).expanduser()
        self.readonly = readonly
        #: Create the store's directory (0700) when missing; ``False``: it must exist.
        self.create_dir = create_dir
        #: Why the store is not (fully) usable, once it is not: ``None`` while all is well.
        self.problem: str | None = None
        self.busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._lock_fd: int | None = None
        self._writable = not readonly
        self._dead = False  # True: no readable store (memo only) for this process
        self._known_ctx: dict[int, bool] = {}  # ctx -> stored with device JSON
        self._known_cfg: set[str] = set()
        self._bad_rows = 0
        #: Rows that ``put_many``/a bulk writer had to keep in memory (the file was not written).
        self.in_memory_writes = 0
        self._warned: set[str] = set()
        _OPEN_STORES.add(self)

    def __repr__(self) -> str:
        return f"ProbeCache({str(self.path)!r}, mode={self.mode!r})"

    @property
    def mode(self) -> str:
        """``rw``, ``ro`` (read-only: by request or after a write failure) or ``memo``."""
        if self._dead:
            return "memo"
        return "rw" if self._writable else "ro"

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
            except _DB_ERRORS as exc:
                kind, reason = _classify(exc), str(exc)
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
            except (*_DB_ERRORS, StoreUnusable):
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
        same_ddl = names == set(_SCHEMA) and all(
            " ".join(tables[n].split()) == " ".join(ddl.split()) for n, ddl in _SCHEMA.items()
        )
        if version != SCHEMA_VERSION or meta_version != version or not same_ddl:
            raise StoreUnusable(f"unexpected schema (version {version}/{meta_text or '?'}, "
                                f"tables: {', '.join(sorted(names))})")  # fmt: skip
        if create:
            self._set_wal(conn)

    def _set_wal(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        conn.execute("PRAGMA synchronous=NORMAL")
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL journal (got {mode}): disk I/O")

    def _create(self, conn: sqlite3.Connection) -> None:
        self._set_wal(conn)
        conn.execute("BEGIN IMMEDIATE")
        try:
            names = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}  # fmt: skip
            if names:  # another process created it meanwhile: validate what it made
                conn.execute("ROLLBACK")
                self._validate(conn, create=False)
                return
            for ddl in _SCHEMA.values():
                conn.execute(ddl)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.executemany("INSERT INTO meta (name, value) VALUES (?, ?)", [
                ("schema_version", str(SCHEMA_VERSION)),
                ("created_by", package_version()),
                ("created_at", repr(time.time())),
            ])  # fmt: skip
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

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
    def _call(self, fn: Callable[[sqlite3.Connection], _T], *, write: bool, miss: _T) -> _T:
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
                except _DB_ERRORS as exc:
                    if conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    kind, reason = _classify(exc), str(exc)
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

    # ---------------------------------------------------------------- reads
    def _decode(self, key: CacheKey, crc: Any, data: Any) -> ProbeResult | None:
        """The result of a ``_GET``/``_GET_CONFIG`` row (``data``: its UTF-8 bytes), or ``None``
        (counted, warned once) when its checksum or content is bad."""
        try:
            if type(data) is not bytes or _row_crc_bytes(key, data) != crc:
                raise ValueError("checksum mismatch")
            return _from_dict(_json_loads(data))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            self._bad_row()
            return None

    def get(self, key: CacheKey) -> ProbeResult | None:
        """The stored result for ``key``, or ``None``."""
        if self._memo:
            hit = self._memo.get(key)
            if hit is not None:
                return hit[1]
        try:
            params = (key[0], key[1], ctx_id(key[2], key[3]))
        except (TypeError, IndexError, AttributeError):
            return None
        row = self._call(lambda c: c.execute(_GET, params).fetchone(), write=False, miss=None)
        return None if row is None else self._decode(CacheKey(*key), row[0], row[1])

    def get_many(self, keys: Iterable[CacheKey]) -> dict[CacheKey, ProbeResult]:
        """The hits among ``keys``, read in one transaction (misses are absent)."""
        out: dict[CacheKey, ProbeResult] = {}
        memo = self._memo
        groups: dict[tuple[str, int], dict[str, CacheKey]] = {}
        for k in keys:
            key = k if type(k) is CacheKey else CacheKey(*k)
            hit = memo.get(key) if memo else None
            if hit is not None:
                out[key] = hit[1]
                continue
            group = (key[0], ctx_id(key[2], key[3]))
            wanted = groups.get(group)
            if wanted is None:
                groups[group] = {key[1]: key}
            else:
                wanted[key[1]] = key
        if not groups:
            return out

        def read(conn: sqlite3.Connection) -> list[tuple[CacheKey, Any, Any]]:
            # One statement per (config, device, stack): a selection reads all its candidates
            # at once. Several statements share one read transaction.
            found = []
            if len(groups) == 1:  # one statement: its own read transaction
                for (config_key, ctx), wanted in groups.items():
                    for backend, crc, data in conn.execute(_GET_CONFIG, (config_key, ctx)):
                        k = wanted.get(backend)
                        if k is not None:
                            found.append((k, crc, data))
                return found
            conn.execute("BEGIN")
            try:
                for (config_key, ctx), wanted in groups.items():
                    for backend, crc, data in conn.execute(_GET_CONFIG, (config_key, ctx)):
                        k = wanted.get(backend)
                        if k is not None:
                            found.append((k, crc, data))
                return found
            finally:
                conn.execute("COMMIT")

        decode = self._decode
        for key, crc, data in self._call(read, write=False, miss=[]):
            result = decode(key, crc, data)
            if result is not None:
                out[key] = result
        return out

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        """The stored rows (with bookkeeping) among ``keys``, read in one transaction."""
        keys = [CacheKey(*k) for k in keys]
        out: dict[CacheKey, CacheRow] = {}
        sql = _ROWS + " WHERE p.config_key=? AND p.backend=? AND p.ctx=?"

        def read(conn: sqlite3.Connection) -> list[Any]:
            conn.execute("BEGIN")
            try:
                return [conn.execute(sql, (k[0], k[1], ctx_id(k[2], k[3]))).fetchone()
                        for k in keys]  # fmt: skip
            finally:
                conn.execute("COMMIT")

        found = self._call(read, write=False, miss=[None] * len(keys)) if keys else []
        for key, r in zip(keys, found, strict=True):
            memo = self._memo.get(key)
            row = self._memo_row(memo[0]) if memo else (self._row_from_db(r) if r else None)
            if row is not None and row.key == key:
                out[key] = row
        return out

    def __len__(self) -> int:
        n = self._call(lambda c: c.execute("SELECT count(*) FROM probes").fetchone()[0],
                       write=False, miss=0)  # fmt: skip
        return int(n) + len(self._memo)

    def warm_up(self) -> None:
        """Start-up work for lookups (:meth:`Selector.prepare` runs it): open and check the file,
        compile the lookup statements, read the top of the table, and run the decoding once on a
        made-up row, so that a first lookup pays only for its own rows. Reads no real row."""
        probe = ("0" * 64, 0)

        def touch(conn: sqlite3.Connection) -> None:
            conn.execute(_GET_CONFIG, probe).fetchall()
            conn.execute(_GET, (probe[0], "unfused", probe[1])).fetchall()

        self._call(touch, write=False, miss=None)
        key = CacheKey("0" * 64, "flash", "0" * 64, "0" * 64)
        for _ in range(8):  # a few runs: the interpreter specialises code that ran a few times
            self._decode(key, _row_crc_bytes(key, _WARM_ROW), _WARM_ROW)

    def iter_rows(
        self,
        *,
        backend: str | None = None,
        config_prefix: str | None = None,
        device_fp: str | None = None,
        page: int = 2000,
    ) -> Iterator[CacheRow]:
        """Every readable row (optionally filtered), in key order, read ``page`` rows at a time.

        Rows kept in memory (after a write failure) come last. Damaged rows are skipped.
        """
        where: list[str] = []
        params: list[Any] = []
        if backend is not None:
            where.append("p.backend = ?")
            params.append(backend)
        if config_prefix:
            where.append("p.config_key >= ? AND p.config_key < ?")
            params += [config_prefix, config_prefix + "g"]
        if device_fp is not None:
            where.append("c.device_fp = ?")
            params.append(device_fp)
        last: tuple[str, str, int] | None = None
        while True:
            clauses = list(where)
            args = list(params)
            if last is not None:
                clauses.append("(p.config_key, p.backend, p.ctx) > (?, ?, ?)")
                args += list(last)
            sql = _ROWS + (" WHERE " + " AND ".join(clauses) if clauses else "")
            sql += " ORDER BY p.config_key, p.backend, p.ctx LIMIT ?"
            args.append(page)
            batch = self._call(lambda c, q=sql, a=args: c.execute(q, a).fetchall(),
                               write=False, miss=[])  # fmt: skip
            for r in batch:
                row = self._row_from_db(r)
                if row is not None and row.key not in self._memo:
                    yield row
            if len(batch) < page:
                break
            last = (batch[-1][0], batch[-1][1], batch[-1][2])
        for key, (row, _) in sorted(self._memo.items()):
            if backend is not None and key.backend != backend:
                continue
            if config_prefix and not key.config_key.startswith(config_prefix):
                continue
            if device_fp is not None and key.device_fp != device_fp:
                continue
            yield self._memo_row(row)

    def recent(self, limit: int, *, backend: str | None = None) -> list[CacheRow]:
        """The ``limit`` most recently stored rows (``limit <= 0``: all), newest first."""
        sql = _ROWS + (" WHERE p.backend = ?" if backend is not None else "")
        sql += " ORDER BY p.created_at DESC" + (" LIMIT ?" if limit > 0 else "")
        args: list[Any] = [backend] if backend is not None else []
        if limit > 0:
            args.append(limit)
        found = self._call(lambda c: c.execute(sql, args).fetchall(), write=False, miss=[])
        rows = [row for row in map(self._row_from_db, found) if row is not None]
        memo = [self._memo_row(row) for row, _ in self._memo.values()
                if backend in (None, row.key.backend)]  # fmt: skip
        if memo:
            keys = {row.key for row in memo}
            rows = [row for row in rows if row.key not in keys] + memo
            rows.sort(key=lambda r: r.created_at, reverse=True)
        return rows[:limit] if limit > 0 else rows

    def _row_from_db(self, r: tuple[Any, ...]) -> CacheRow | None:
        """A row from a ``_ROWS`` query; ``None`` (counted, warned once) if damaged."""
        try:
            ck, backend, _ctx, created, pkg, crc, text, fp, vk, device, config = r
            if fp is None and vk is None:
                return None  # no context row: cannot name its key
            if not all(isinstance(x, str) for x in (ck, backend, fp, vk, text)):
                raise TypeError("damaged column types")
            key = CacheKey(ck, backend, fp, vk)
            result = _loads_dict(text) if row_crc(key, text) == crc else None
            if result is None:
                raise ValueError("checksum mismatch")
            return CacheRow(key, result, float(created), str(pkg), _loads_dict(config),
                            _loads_dict(device))  # fmt: skip
        except (TypeError, ValueError):
            self._bad_row()
            return None

    def _bad_row(self) -> None:
        self._bad_rows += 1
        self._warn("bad_row", "probe cache %s: ignoring a damaged row (it reads as a miss)",
                   self.path)  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Counts by backend, device, software stack and verdict, plus file size and mode."""

        def read(conn: sqlite3.Connection) -> dict[str, Any]:
            conn.execute("BEGIN")
            try:
                by_backend = conn.execute(
                    "SELECT backend, count(*) FROM probes GROUP BY backend"
                ).fetchall()
                per_ctx = conn.execute(
                    "SELECT c.device_fp, c.versions_key, c.device, n FROM (SELECT ctx, count(*)"
                    " AS n FROM probes GROUP BY ctx) p LEFT JOIN contexts c ON c.ctx = p.ctx"
                ).fetchall()
                verdict = conn.execute(
                    "SELECT supported, count(*) FROM probes GROUP BY supported"
                ).fetchall()
            finally:
                conn.execute("COMMIT")
            by_device: Counter[str] = Counter()
            by_versions: Counter[str] = Counter()
            names: dict[str, str] = {}
            for fp, vk, device, n in per_ctx:  # str(): a damaged file may hold other types
                by_device[str(fp or "unknown")] += n
                by_versions[str(vk or "unknown")] += n
                d = _loads_dict(device)
                if d and isinstance(d.get("name"), str):
                    names[str(fp)] = d["name"]
            ok = sum(n for v, n in verdict if v == 1)
            total = sum(n for _, n in by_backend)
            return {
                "entries": total,
                "by_backend": {str(b): n for b, n in by_backend},
                "by_device": dict(by_device),
                "device_names": names,
                "by_versions_key": dict(by_versions),
                "by_verdict": {"supported": ok, "unsupported": total - ok},
            }

        out = self._call(read, write=False, miss=None) or self._tally(())
        if self._memo:
            memo = self._tally(row for row, _ in self._memo.values())
            out["entries"] += memo["entries"]
            for field in ("by_backend", "by_device", "by_versions_key", "by_verdict"):
                for k, v in memo[field].items():
                    out[field][k] = out[field].get(k, 0) + v
            out["device_names"].update(memo["device_names"])
        size = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                size += os.stat(f"{self.path}{suffix}").st_size
        return {"path": str(self.path), "mode": self.mode, "size_bytes": size,
                "schema_version": SCHEMA_VERSION, **out}  # fmt: skip

    # ---------------------------------------------------------------- writes
    def put_many(
        self, items: Iterable[PutItem], *, on_conflict: OnConflict = "replace",
        checked: bool = False,
    ) -> int:  # fmt: skip
        """Store many rows in one transaction; returns how many rows were written.

        ``items``: :class:`CacheRow` or ``(key, result[, config, device])`` tuples.
        ``on_conflict``: ``replace`` (default), ``ignore`` (keep what is stored) or ``newer``
        (replace only with a later ``created_at``). ``checked``: the rows' keys are known good.
        """
        rows = [_to_row(item, checked) for item in items]
        if not rows:
            return 0
        params = [_row_params(row) for row in rows]
        written = self._write(rows, params, on_conflict)
        if written is None:  # not writable: keep them in memory
            with self._lock:
                n = sum(self._memo_put(row, on_conflict) for row in rows)
                self.in_memory_writes += n
                return n
        return written

    def _write(
        self, rows: list[CacheRow], params: list[tuple[Any, ...]], on_conflict: OnConflict
    ) -> int | None:
        ctxs: dict[int, tuple[Any, ...]] = {}
        cfgs: dict[str, str] = {}
        for row, p in zip(rows, params, strict=True):
            ctx = p[2]
            if row.device is not None or ctx not in ctxs:
                ctxs[ctx] = (ctx, row.key.device_fp, row.key.versions_key,
                             _dumps(row.device) if row.device is not None else None)  # fmt: skip
            if row.config is not None and row.key.config_key not in cfgs:
                cfgs[row.key.config_key] = _dumps(row.config)
        return self._write_params(params, ctxs, cfgs, on_conflict)

    def _write_params(
        self, params: list[tuple[Any, ...]], ctxs: dict[int, tuple[Any, ...]],
        cfgs: dict[str, str], on_conflict: OnConflict,
    ) -> int | None:  # fmt: skip
        """Write rows given as ``probes`` parameters, with their ``contexts``/``configs`` rows,
        in one transaction; the number written, or ``None`` if the store cannot be written."""
        sql = _INSERT[on_conflict]

        def write(conn: sqlite3.Connection) -> int:
            known = self._known_ctx
            new_ctx = [v for k, v in ctxs.items()
                       if k not in known or (v[3] is not None and not known[k])]  # fmt: skip
            new_cfg = [kv for kv in cfgs.items() if kv[0] not in self._known_cfg]
            if len(params) == 1 and not new_ctx and not new_cfg:
                n = conn.execute(sql, params[0]).rowcount  # one statement, autocommit
                _verify_written(conn, params)
                return n
            with _write_txn(conn):
                if new_ctx:
                    conn.executemany(_INSERT_CTX, new_ctx)
                if new_cfg:
                    conn.executemany(_INSERT_CFG, new_cfg)
                n = conn.executemany(sql, params).rowcount
                _verify_written(conn, params)
            for v in new_ctx:
                known[v[0]] = known.get(v[0], False) or v[3] is not None
            self._known_cfg.update(k for k, _ in new_cfg)
            return n

        n = self._call(write, write=True, miss=-1)
        return None if n < 0 else n

    def bulk_writer(self, on_conflict: OnConflict = "ignore") -> BulkWriter:
        """A :class:`BulkWriter` into this store (what imports use)."""
        return BulkWriter(self, on_conflict)

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int:  # fmt: skip
        """Delete rows older than ``older_than_s`` and/or whose versions key is not
        ``not_versions_key`` (one key, or a collection of keys to keep)."""
        keep = _keep_set(not_versions_key)
        if older_than_s is None and keep is None:
            return 0
        clauses: list[str] = []
        args: list[Any] = []
        if older_than_s is not None:  # and rows stamped in the future: they cannot dodge it
            clauses.append("created_at < ? OR created_at > ?")
            args += [time.time() - older_than_s, time.time() + FUTURE_SKEW_S]
        if keep is not None:
            marks = ",".join("?" * len(keep)) or "NULL"
            clauses.append(f"ctx IN (SELECT ctx FROM contexts WHERE versions_key NOT IN ({marks}))")
            args.extend(sorted(keep))

        def delete(conn: sqlite3.Connection) -> int:
            with _write_txn(conn):
                n = conn.execute("DELETE FROM probes WHERE " + " OR ".join(clauses),
                                 args).rowcount  # fmt: skip
                conn.execute("DELETE FROM configs WHERE config_key NOT IN "
                             "(SELECT config_key FROM probes)")  # fmt: skip
            self._known_cfg.clear()
            return n

        with self._lock:
            memo = self._memo_prune(older_than_s, keep)
        return max(0, self._call(delete, write=True, miss=0)) + memo

    def clear(self) -> int:
        """Delete every row (and compact the file when nobody is using it); returns how many."""

        def delete(conn: sqlite3.Connection) -> int:
            with _write_txn(conn):
                n = conn.execute("DELETE FROM probes").rowcount
                conn.execute("DELETE FROM configs")
            self._known_cfg.clear()
            with contextlib.suppress(sqlite3.Error):
                conn.execute("VACUUM")
            return n

        with self._lock:
            memo = len(self._memo)
            self._memo.clear()
        return max(0, self._call(delete, write=True, miss=0)) + memo

    def check_integrity(self) -> str | None:
        """Run SQLite's ``quick_check`` over the whole file (milliseconds per 10k rows: for
        imports, merges and tools, never the lookup path). A store that fails it is quarantined
        (moved aside and started afresh, or, while other processes use it, not used by this
        process): it is never written to again. Returns the problem, or ``None``."""
        found = self._call(lambda c: [str(r[0]) for r in c.execute("PRAGMA quick_check(5)")],
                           write=False, miss=None)  # fmt: skip
        if found is None:
            return self.problem
        if found == ["ok"]:
            return None
        reason = "integrity check failed: " + "; ".join(found)[:300]
        with self._lock:
            if self.readonly:
                self._unusable(reason)
            else:
                self._quarantine(reason)
        return reason

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (best effort; for benchmarks and tools)."""
        self._call(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall(),
                   write=True, miss=None)  # fmt: skip


class BulkWriter:
    """Checked rows on their way into a :class:`ProbeCache`, held as compact insert parameters
    (the parsed rows can go at once) and written by :meth:`flush`, one transaction per call:
    what :meth:`ProbeCache.put_many` with ``checked=True`` does for the same rows.

    :meth:`add` takes ``plain=True`` only for rows whose config/device came from
    :func:`._json.loads_flagged` with its flag set (plain JSON values: written with orjson).
    """

    def __init__(self, store: ProbeCache, on_conflict: OnConflict = "ignore") -> None:
        self.store = store
        self.on_conflict: OnConflict = on_conflict
        self.params: list[tuple[Any, ...]] = []
        self._ctxs: dict[int, tuple[Any, ...]] = {}
        self._cfgs: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.params)

    def add(self, row: CacheRow, plain: bool = False) -> None:
        p = _row_params(row)
        self.params.append(p)
        ctx, device, config = p[2], row.device, row.config
        if device is not None or ctx not in self._ctxs:
            self._ctxs[ctx] = (ctx, row.key.device_fp, row.key.versions_key,
                               None if device is None else _json.dumps_loaded(device, plain))
        if config is not None and p[0] not in self._cfgs:
            self._cfgs[p[0]] = _json.dumps_loaded(config, plain)

    def flush(self) -> int:
        """Write what was added; returns how many rows were written (kept in memory when the
        store cannot be written, as ``put_many`` does)."""
        if not self.params:
            return 0
        params, ctxs, cfgs = self.params, self._ctxs, self._cfgs
        self.params, self._ctxs, self._cfgs = [], {}, {}
        written = self.store._write_params(params, ctxs, cfgs, self.on_conflict)
        if written is None:
            rows = [_row_from_params(p, ctxs, cfgs) for p in params]
            with self.store._lock:
                n = sum(self.store._memo_put(row, self.on_conflict) for row in rows)
                self.store.in_memory_writes += n
                return n
        return written


def _row_from_params(p: tuple[Any, ...], ctxs: dict[int, tuple[Any, ...]],
                     cfgs: dict[str, str]) -> CacheRow:  # fmt: skip
    """The :class:`CacheRow` a :class:`BulkWriter` row stands for (to keep it in memory)."""
    ck, backend, ctx, _, _, _, created, pkg, _, text = p
    _, fp, vk, device = ctxs[ctx]
    return CacheRow(CacheKey(ck, backend, fp, vk), json.loads(text), created, pkg,
                    _loads_dict(cfgs.get(ck)), _loads_dict(device), text)  # fmt: skip


# ------------------------------------------------------------------------------------- helpers
def _verify_written(conn: sqlite3.Connection, params: list[tuple[Any, ...]]) -> None:
    """Look up (a sample of) the rows just written: a damaged b-tree can lose them silently."""
    step = max(1, len(params) // 32)
    for p in params[::step]:
        if conn.execute(_EXISTS, p[:3]).fetchone() is None:
            raise sqlite3.DatabaseError("database disk image is malformed (a row just written "
                                        "cannot be found)")  # fmt: skip


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


# ---------------------------------------------------------------------------- location / defaults
_OFF = {"off", "0", "none", "false", "no", "disabled"}


def default_path() -> Path:
    """``<user cache dir>/te_fl_attention/probes.sqlite`` (platformdirs)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("te_fl_attention")) / "probes.sqlite"


def open_cache(path: str | os.PathLike[str] | None = None) -> ProbeCache | MemoryCache:
    """Open the cache at ``path`` or where the environment says.

    ``TE_FL_ATTN_CACHE``: a file path, or ``off``/``0``/``none`` for no persistence (a
    :class:`MemoryCache`). ``TE_FL_ATTN_CACHE_READONLY=1`` opens the file read-only.
    An explicit ``path`` wins over ``TE_FL_ATTN_CACHE``.

    ``TE_FL_ATTN_REMOTE_CACHE=redis://host:port/db`` puts a shared Redis tier behind the local
    store (:class:`~te_fl_attention.cache.remote.TieredCache`: same API, read through, write
    back to both; Redis trouble is a miss with one warning).
    """
    create_dir = False  # an explicit path's directory must exist; the default one is created
    if path is None:
        env = os.environ.get("TE_FL_ATTN_CACHE", "").strip()
        path = env or default_path()
        create_dir = not env
    local: ProbeCache | MemoryCache
    if str(path).strip().lower() in _OFF:
        local = MemoryCache()
    else:
        readonly = switch("TE_FL_ATTN_CACHE_READONLY")  # exactly 0/1; anything else raises
        if readonly:
            log.info("probe cache %s opened read-only (TE_FL_ATTN_CACHE_READONLY); new results "
                     "stay in memory", path)  # fmt: skip
        local = ProbeCache(path, readonly=readonly, create_dir=create_dir)
    url = os.environ.get("TE_FL_ATTN_REMOTE_CACHE", "").strip()
    if not url or url.lower() in _OFF:
        return local
    from .remote import TieredCache, remote_tier

    return TieredCache(local, remote_tier(url))  # type: ignore[return-value]


_default: ProbeCache | MemoryCache | None = None
_default_lock = threading.Lock()


def default_cache() -> ProbeCache | MemoryCache:
    """The process-wide cache (:func:`open_cache` with no path), created on first use."""
    global _default
    cache = _default
    if cache is None:
        with _default_lock:
            if _default is None:
                _default = open_cache()
            cache = _default
    return cache


def reset_default_cache() -> None:
    """Close and forget the process-wide cache (tests; after changing the environment)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = None

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
import json
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..reasons import ProbeResult
from . import _json
from ._lifecycle import BUSY_TIMEOUT_S, OPEN_STORES, SCHEMA_VERSION, SQLiteFile, write_txn
from .compact import (
    compact_crc,
    expand,
    join_config,
    pieces,
    split_config,
    split_result,
    text_id,
)
from .keys import CacheKey
from .memory import BaseCache, keep_set
from .rows import (
    FUTURE_SKEW_S,
    CacheRow,
    OnConflict,
    PutItem,
    ctx_id,
    dumps,
    loads_dict,
    row_crc,
    row_crc_bytes,
    row_params,
    to_row,
)

_COLUMNS = (
    "config_key, backend, ctx, supported, stage, elapsed_ms, created_at, package_version, crc,"
    " result, rid, e1, e2, e3"
)
_UPDATE = (
    "supported=excluded.supported, stage=excluded.stage, elapsed_ms=excluded.elapsed_ms,"
    " created_at=excluded.created_at, package_version=excluded.package_version,"
    " crc=excluded.crc, result=excluded.result, rid=excluded.rid, e1=excluded.e1,"
    " e2=excluded.e2, e3=excluded.e3"
)
_VALUES = f"INSERT INTO probes ({_COLUMNS}) VALUES ({','.join('?' * 14)})"
_INSERT = {
    "replace": f"{_VALUES} ON CONFLICT (config_key, backend, ctx) DO UPDATE SET {_UPDATE}",
    "ignore": f"{_VALUES} ON CONFLICT DO NOTHING",
    "newer": f"{_VALUES} ON CONFLICT (config_key, backend, ctx) DO UPDATE SET {_UPDATE}"
    " WHERE excluded.created_at > probes.created_at",
}
_INSERT_CTX = (
    "INSERT INTO contexts (ctx, device_fp, versions_key, device) VALUES (?,?,?,?)"
    " ON CONFLICT (ctx) DO UPDATE SET device=excluded.device"
    " WHERE contexts.device IS NULL AND excluded.device IS NOT NULL"
)
_INSERT_CFG = ("INSERT INTO configs (config_key, config, base) VALUES (?,?,?)"
               " ON CONFLICT DO NOTHING")  # fmt: skip
#: A template is written with its rows; one stored with other text (damaged: its rows read as
#: misses) is written again, as a full row's text is.
INSERT_TEMPLATE = (
    "INSERT INTO templates VALUES (?,?,?,?,?,?) ON CONFLICT (rid) DO UPDATE SET"
    " backend=excluded.backend, supported=excluded.supported, stage=excluded.stage,"
    " holes=excluded.holes, template=excluded.template WHERE (templates.backend,"
    " templates.supported, templates.stage, templates.holes, templates.template) IS NOT"
    " (excluded.backend, excluded.supported, excluded.stage, excluded.holes, excluded.template)"
)
_INSERT_BASE = "INSERT OR IGNORE INTO bases VALUES (?,?)"


def _utf8(col: str) -> str:
    """A text column as its stored UTF-8 bytes (checksummed and parsed without decoding); a
    value that is not text (a damaged row) reads as NULL, a miss."""
    return f"CASE WHEN typeof({col}) = 'text' THEN CAST({col} AS BLOB) END"


class _Queries:
    """The lookup statements of one schema (1: a schema-1 store read as it is). Each result is
    read as ``crc, result, rid, elapsed_ms, e1, e2, e3, template`` (:meth:`ProbeCache._decode`)."""

    def __init__(self, schema: int) -> None:
        if schema >= 2:
            cols = (f"p.crc, {_utf8('p.result')}, p.rid, p.elapsed_ms, p.e1, p.e2, p.e3,"
                    f" {_utf8('t.template')} FROM probes p LEFT JOIN templates t ON t.rid = p.rid")
            extra = ("p.rid, p.elapsed_ms, p.e1, p.e2, p.e3, t.template, g.base, b.config FROM"
                     " probes p LEFT JOIN templates t ON t.rid = p.rid")
            joins = " LEFT JOIN bases b ON b.base = g.base"
        else:
            cols = f"p.crc, {_utf8('p.result')}, NULL, NULL, NULL, NULL, NULL, NULL FROM probes p"
            extra, joins = "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM probes p", ""
        self.get = f"SELECT {cols} WHERE p.config_key=? AND p.backend=? AND p.ctx=?"
        self.get_config = f"SELECT p.backend, {cols} WHERE p.config_key=? AND p.ctx=?"
        self.get_slice = f"SELECT p.config_key, p.backend, {cols} WHERE p.ctx=? LIMIT ?"
        #: Rows with their bookkeeping (:meth:`ProbeCache._row_from_db`).
        self.rows = (
            "SELECT p.config_key, p.backend, p.ctx, p.created_at, p.package_version, p.crc,"
            f" p.result, c.device_fp, c.versions_key, c.device, g.config, {extra}"
            " LEFT JOIN contexts c ON c.ctx = p.ctx LEFT JOIN configs g"
            f" ON g.config_key = p.config_key{joins}"
        )


_QUERIES = {1: _Queries(1), 2: _Queries(2)}


#: A job's slice (all rows of one device and versions key) is read in one query only from a
#: file of at most SLICE_MAX_BYTES (the query scans: no index on the context) holding at most
#: SLICE_MAX_ROWS such rows; at most SLICE_BULK_DECODE rows are decoded when read, more on use.
SLICE_MAX_BYTES = 64 << 20
SLICE_MAX_ROWS = 20_000
SLICE_BULK_DECODE = 8192
_EXISTS = "SELECT 1 FROM probes WHERE config_key=? AND backend=? AND ctx=?"
#: Templates whose text was checked against their id, with their pieces (bounded).
_PARTS_MAX = 4096


_json_loads = _json.loads
_from_dict = ProbeResult.from_dict
#: A made-up stored result (reasons, variants, detail) that :meth:`ProbeCache.warm_up` decodes.
_WARM_ROW = dumps({
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


class ProbeCache(SQLiteFile, BaseCache):
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
        self._parts: dict[int, tuple[bytes, list[bytes]]] = {}  # template id -> text, pieces
        self.schema = SCHEMA_VERSION  # (the open file's, once open: 1 for a schema-1 file read)
        self._bad_rows = 0
        #: Rows that ``put_many``/a bulk writer had to keep in memory (the file was not written).
        self.in_memory_writes = 0
        self._warned: set[str] = set()
        OPEN_STORES.add(self)

    def __repr__(self) -> str:
        return f"ProbeCache({str(self.path)!r}, mode={self.mode!r})"

    @property
    def mode(self) -> str:
        """``rw``, ``ro`` (read-only: by request or after a write failure) or ``memo``."""
        if self._dead:
            return "memo"
        return "rw" if self._writable else "ro"



    # ---------------------------------------------------------------- reads
    def decode_row(self, key: CacheKey, row: Any) -> ProbeResult | None:
        """A row of :meth:`load_slice` as its result (``None``: a bad row, counted)."""
        if type(row) is tuple:
            return self._decode(key, row)
        return row

    def load_slice(self, device_fp: str, versions_key: str, *, max_rows: int | None = None,
                   max_bytes: int | None = None) -> dict[tuple[str, str], Any] | None:
        """Every stored row of one (device fingerprint, versions key), in one query:
        ``{(config_key, backend): row}``, each row a decoded :class:`ProbeResult` when the
        slice has at most :data:`SLICE_BULK_DECODE` rows (decoded in one pass now), else its
        stored columns (as :meth:`_decode` takes them) for :meth:`decode_row` on first use. A
        row whose checksum or content is bad is left out (counted). ``None`` when the store
        cannot answer so (over :data:`SLICE_MAX_BYTES` on disk or :data:`SLICE_MAX_ROWS` in the
        slice, rows held in memory after a failed write, no readable file): look rows up per
        config then."""
        if self._memo:
            return None
        ctx = ctx_id(device_fp, versions_key)
        max_rows = SLICE_MAX_ROWS if max_rows is None else max_rows
        max_bytes = SLICE_MAX_BYTES if max_bytes is None else max_bytes

        def read(conn: sqlite3.Connection) -> list[Any] | None:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            size = conn.execute("PRAGMA page_size").fetchone()[0]
            if pages * size > max_bytes:
                return None
            return conn.execute(self._q.get_slice, (ctx, max_rows + 1)).fetchall()

        rows = self.run(read, write=False, miss=None)
        if rows is None or len(rows) > max_rows:
            return None
        if len(rows) > SLICE_BULK_DECODE:  # the stored columns, each decoded on first use
            return {(r[0], r[1]): r[2:] for r in rows}
        return self._bulk_decode(rows, device_fp, versions_key)

    def _bulk_decode(self, rows: list[Any], device_fp: str, versions_key: str
                     ) -> dict[tuple[str, str], Any]:  # fmt: skip
        """A slice's rows as results, all in one pass (each row parsed on its own: a row's text
        can never be read as part of another's)."""
        decode, out = self._decode, {}
        for r in rows:
            result = decode(CacheKey(r[0], r[1], device_fp, versions_key), r[2:])
            if result is not None:
                out[(r[0], r[1])] = result
        return out

    @property
    def _q(self) -> _Queries:
        """The lookup statements of the open file's schema."""
        return _QUERIES[self.schema]

    def _decode(self, key: CacheKey, row: Any) -> ProbeResult | None:
        """The result of a lookup's columns (``crc, result, rid, elapsed_ms, e1, e2, e3,
        template``: :class:`_Queries`), or ``None`` (counted, warned once) when its checksum or
        content is bad."""
        try:
            return _from_dict(_json_loads(self._text(key, row)))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            self._bad_row()
            return None

    def _text(self, key: Any, row: Any) -> bytes:
        """A stored result's UTF-8 text with its checksum checked: a full row's own text, a
        compact row's rebuilt from its template (checked against its id); ``ValueError`` if
        damaged."""
        crc, data, rid = row[0], row[1], row[2]
        if rid is None:
            if type(data) is not bytes or row_crc_bytes(key, data) != crc:
                raise ValueError("checksum mismatch")
            return data
        template = row[7]
        parts = self._parts.get(rid)
        if parts is None or parts[0] != template:
            if type(template) is not bytes or type(rid) is not int or text_id(template) != rid:
                raise ValueError("template damaged")
            if len(self._parts) >= _PARTS_MAX:
                self._parts.clear()
            parts = self._parts[rid] = (template, pieces(template))
        elapsed, e1, e2, e3 = row[3:7]
        if compact_crc(key[0], key[1], ctx_id(key[2], key[3]), rid, elapsed, e1, e2, e3) != crc:
            raise ValueError("checksum mismatch")
        text = expand(parts[1], elapsed, e1, e2, e3)
        if text is None:
            raise ValueError("values do not fill the template")
        return text

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
        row = self.run(lambda c: c.execute(self._q.get, params).fetchone(), write=False,
                       miss=None)  # fmt: skip
        return None if row is None else self._decode(CacheKey(*key), row)

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

        def read(conn: sqlite3.Connection) -> list[tuple[CacheKey, Any]]:
            # One statement per (config, device, stack): a selection reads all its candidates
            # at once. Several statements share one read transaction.
            sql = self._q.get_config

            def collect() -> list[tuple[CacheKey, Any]]:
                found = []
                for (config_key, ctx), wanted in groups.items():
                    for r in conn.execute(sql, (config_key, ctx)):
                        k = wanted.get(r[0])
                        if k is not None:
                            found.append((k, r[1:]))
                return found

            if len(groups) == 1:  # one statement: its own read transaction
                return collect()
            conn.execute("BEGIN")
            try:
                return collect()
            finally:
                conn.execute("COMMIT")

        decode = self._decode
        for key, row in self.run(read, write=False, miss=[]):
            result = decode(key, row)
            if result is not None:
                out[key] = result
        return out

    def get_rows(self, keys: Iterable[CacheKey]) -> dict[CacheKey, CacheRow]:
        """The stored rows (with bookkeeping) among ``keys``, read in one transaction."""
        keys = [CacheKey(*k) for k in keys]
        out: dict[CacheKey, CacheRow] = {}
        def read(conn: sqlite3.Connection) -> list[Any]:
            sql = self._q.rows + " WHERE p.config_key=? AND p.backend=? AND p.ctx=?"
            conn.execute("BEGIN")
            try:
                return [conn.execute(sql, (k[0], k[1], ctx_id(k[2], k[3]))).fetchone()
                        for k in keys]  # fmt: skip
            finally:
                conn.execute("COMMIT")

        found = self.run(read, write=False, miss=[None] * len(keys)) if keys else []
        for key, r in zip(keys, found, strict=True):
            memo = self._memo.get(key)
            row = self._memo_row(memo[0]) if memo else (self._row_from_db(r) if r else None)
            if row is not None and row.key == key:
                out[key] = row
        return out

    def __len__(self) -> int:
        n = self.run(lambda c: c.execute("SELECT count(*) FROM probes").fetchone()[0],
                       write=False, miss=0)  # fmt: skip
        return int(n) + len(self._memo)

    def warm_up(self) -> None:
        """Start-up work for lookups (:meth:`Selector.prepare` runs it): open and check the file,
        compile the lookup statements, read the top of the table, and run the decoding once on a
        made-up row, so that a first lookup pays only for its own rows. Reads no real row."""
        probe = ("0" * 64, 0)

        def touch(conn: sqlite3.Connection) -> None:
            conn.execute(self._q.get_config, probe).fetchall()
            conn.execute(self._q.get, (probe[0], "unfused", probe[1])).fetchall()

        self.run(touch, write=False, miss=None)
        key = CacheKey("0" * 64, "flash", "0" * 64, "0" * 64)
        full = (row_crc_bytes(key, _WARM_ROW), _WARM_ROW, None, None, None, None, None, None)
        t, *rest = split_result(_WARM_ROW.decode(), "flash", 1, "rule", 0.25) or ()
        rid, template = t.rid, t.text.encode()
        ctx = ctx_id(key[2], key[3])
        compact = (compact_crc(key[0], key[1], ctx, rid, 0.25, *rest), b"", rid, 0.25, *rest,
                   template)  # fmt: skip
        for _ in range(8):  # a few runs: the interpreter specialises code that ran a few times
            self._decode(key, full)
            self._decode(key, compact)
        self._parts.pop(rid, None)

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
            sql = (" WHERE " + " AND ".join(clauses) if clauses else "")
            sql += " ORDER BY p.config_key, p.backend, p.ctx LIMIT ?"
            args.append(page)
            batch = self.run(lambda c, q=sql, a=args: c.execute(self._q.rows + q, a).fetchall(),
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
        sql = " WHERE p.backend = ?" if backend is not None else ""
        sql += " ORDER BY p.created_at DESC" + (" LIMIT ?" if limit > 0 else "")
        args: list[Any] = [backend] if backend is not None else []
        if limit > 0:
            args.append(limit)
        found = self.run(lambda c: c.execute(self._q.rows + sql, args).fetchall(), write=False,
                         miss=[])  # fmt: skip
        rows = [row for row in map(self._row_from_db, found) if row is not None]
        memo = [self._memo_row(row) for row, _ in self._memo.values()
                if backend in (None, row.key.backend)]  # fmt: skip
        if memo:
            keys = {row.key for row in memo}
            rows = [row for row in rows if row.key not in keys] + memo
            rows.sort(key=lambda r: r.created_at, reverse=True)
        return rows[:limit] if limit > 0 else rows

    def _row_from_db(self, r: tuple[Any, ...]) -> CacheRow | None:
        """A row from a ``rows`` query (:class:`_Queries`); ``None`` (counted, warned once) if
        damaged."""
        try:
            ck, backend, _ctx, created, pkg, crc, text, fp, vk, device, config = r[:11]
            rid, elapsed, e1, e2, e3, template, base_id, base = r[11:]
            if fp is None and vk is None:
                return None  # no context row: cannot name its key
            if not all(isinstance(x, str) for x in (ck, backend, fp, vk, text)):
                raise TypeError("damaged column types")
            key = CacheKey(ck, backend, fp, vk)
            if rid is None:
                result = loads_dict(text) if row_crc(key, text) == crc else None
            else:
                data = template.encode() if isinstance(template, str) else None
                row = (crc, None, rid, elapsed, e1, e2, e3, data)
                result = loads_dict(self._text(key, row).decode())
            if result is None:
                raise ValueError("checksum mismatch")
            cfg = loads_dict(config)
            if base_id is not None and cfg is not None:  # (its base gone: a damaged file)
                fields = loads_dict(base)
                cfg = join_config(fields, cfg) if fields is not None else None
            return CacheRow(key, result, float(created), str(pkg), cfg, loads_dict(device))
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
                d = loads_dict(device)
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

        out = self.run(read, write=False, miss=None) or self._tally(())
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
                "schema_version": self.schema, **out}  # fmt: skip

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
        rows = [to_row(item, checked) for item in items]
        if not rows:
            return 0
        params = [row_params(row) for row in rows]
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
        cfgs: dict[str, tuple[str, Any]] = {}
        for row, p in zip(rows, params, strict=True):
            ctx = p[2]
            if row.device is not None or ctx not in ctxs:
                ctxs[ctx] = (ctx, row.key.device_fp, row.key.versions_key,
                             dumps(row.device) if row.device is not None else None)  # fmt: skip
            if row.config is not None and row.key.config_key not in cfgs:
                cfgs[row.key.config_key] = (dumps(row.config), row.config)
        return self._write_params(params, ctxs, cfgs, on_conflict)

    def _write_params(
        self, params: list[tuple[Any, ...]], ctxs: dict[int, tuple[Any, ...]],
        cfgs: dict[str, tuple[str, Any]], on_conflict: OnConflict,
    ) -> int | None:  # fmt: skip
        """Write rows given as :func:`.rows.row_params`, with their ``contexts``/``configs`` rows
        (``cfgs``: key -> (JSON, fields)), in one transaction, in the compact layout where a row
        or config fits it (:mod:`.compact`); the number written, or ``None`` if the store cannot
        be written."""
        sql = _INSERT[on_conflict]
        rows, templates = compact_params(params)

        def write(conn: sqlite3.Connection) -> int:
            if self.schema < 2:  # (a schema-1 file is only ever read)
                raise sqlite3.OperationalError("attempt to write a readonly database")
            known = self._known_ctx
            new_ctx = [v for k, v in ctxs.items()
                       if k not in known or (v[3] is not None and not known[k])]  # fmt: skip
            new_cfg, bases = compact_configs(
                [(k, v) for k, v in cfgs.items() if k not in self._known_cfg])
            if len(rows) == 1 and not new_ctx and not new_cfg and not templates:
                n = conn.execute(sql, rows[0]).rowcount  # one statement, autocommit
                verify_written(conn, rows)
                return n
            with write_txn(conn):
                if new_ctx:
                    conn.executemany(_INSERT_CTX, new_ctx)
                if bases:  # (always with the rows that use them: a prune may have removed them)
                    conn.executemany(_INSERT_BASE, bases)
                if new_cfg:
                    conn.executemany(_INSERT_CFG, new_cfg)
                if templates:
                    conn.executemany(INSERT_TEMPLATE, templates)
                n = conn.executemany(sql, rows).rowcount
                verify_written(conn, rows)
            for v in new_ctx:
                known[v[0]] = known.get(v[0], False) or v[3] is not None
            self._known_cfg.update(k for k, *_ in new_cfg)
            return n

        n = self.run(write, write=True, miss=-1)
        return None if n < 0 else n

    def bulk_writer(self, on_conflict: OnConflict = "ignore") -> BulkWriter:
        """A :class:`BulkWriter` into this store (what imports use)."""
        return BulkWriter(self, on_conflict)

    def prune(self, older_than_s: float | None = None,
              not_versions_key: str | Iterable[str] | None = None) -> int:  # fmt: skip
        """Delete rows older than ``older_than_s`` and/or whose versions key is not
        ``not_versions_key`` (one key, or a collection of keys to keep)."""
        keep = keep_set(not_versions_key)
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
            with write_txn(conn):
                n = conn.execute("DELETE FROM probes WHERE " + " OR ".join(clauses),
                                 args).rowcount  # fmt: skip
                conn.execute("DELETE FROM configs WHERE config_key NOT IN "
                             "(SELECT config_key FROM probes)")  # fmt: skip
                drop_unused(conn)
            self._known_cfg.clear()
            return n

        with self._lock:
            memo = self._memo_prune(older_than_s, keep)
        return max(0, self.run(delete, write=True, miss=0)) + memo

    def clear(self) -> int:
        """Delete every row (and compact the file when nobody is using it); returns how many."""

        def delete(conn: sqlite3.Connection) -> int:
            with write_txn(conn):
                n = conn.execute("DELETE FROM probes").rowcount
                conn.execute("DELETE FROM configs")
                drop_unused(conn)
            self._known_cfg.clear()
            with contextlib.suppress(sqlite3.Error):
                conn.execute("VACUUM")
            return n

        with self._lock:
            memo = len(self._memo)
            self._memo.clear()
        return max(0, self.run(delete, write=True, miss=0)) + memo

    def check_integrity(self) -> str | None:
        """Run SQLite's ``quick_check`` over the whole file (milliseconds per 10k rows: for
        imports, merges and tools, never the lookup path). A store that fails it is quarantined
        (moved aside and started afresh, or, while other processes use it, not used by this
        process): it is never written to again. Returns the problem, or ``None``."""
        found = self.run(lambda c: [str(r[0]) for r in c.execute("PRAGMA quick_check(5)")],
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
        self.run(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall(),
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
        self._cfgs: dict[str, tuple[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.params)

    def add(self, row: CacheRow, plain: bool = False) -> None:
        p = row_params(row)
        self.params.append(p)
        ctx, device, config = p[2], row.device, row.config
        if device is not None or ctx not in self._ctxs:
            self._ctxs[ctx] = (ctx, row.key.device_fp, row.key.versions_key,
                               None if device is None else _json.dumps_loaded(device, plain))
        if config is not None and p[0] not in self._cfgs:
            self._cfgs[p[0]] = (_json.dumps_loaded(config, plain), config)

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
                     cfgs: dict[str, tuple[str, Any]]) -> CacheRow:  # fmt: skip
    """The :class:`CacheRow` a :class:`BulkWriter` row stands for (to keep it in memory)."""
    ck, backend, ctx, _, _, _, created, pkg, _, text = p
    _, fp, vk, device = ctxs[ctx]
    cfg = cfgs.get(ck)
    return CacheRow(CacheKey(ck, backend, fp, vk), json.loads(text), created, pkg,
                    loads_dict(cfg[0] if cfg else None), loads_dict(device), text)  # fmt: skip


def compact_params(params: list[tuple[Any, ...]]
                    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:  # fmt: skip
    """:func:`.rows.row_params` as ``probes`` rows of schema 2 (compact where the result fits
    its template, else in full), and the templates they use."""
    rows, templates = [], {}
    for p in params:
        ck, backend, ctx, supported, stage, elapsed, created, pkg, crc, text = p
        split = split_result(text, backend, supported, stage, elapsed)
        if split is None:
            rows.append((*p, None, None, None, None))
            continue
        t, e1, e2, e3 = split
        templates[t.rid] = t
        rows.append((ck, backend, ctx, supported, stage, elapsed, created, pkg,
                     compact_crc(ck, backend, ctx, t.rid, elapsed, e1, e2, e3), "", t.rid,
                     e1, e2, e3))  # fmt: skip
    return rows, list(templates.values())


def compact_configs(cfgs: list[tuple[str, tuple[str, Any]]]
                     ) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]]]:  # fmt: skip
    """``configs`` rows of schema 2 (the fields that differ from the base, else in full) and
    the bases they use."""
    rows, bases = [], {}
    for ck, (text, fields) in cfgs:
        split = split_config(fields, text) if isinstance(fields, Mapping) else None
        if split is None:
            rows.append((ck, text, None))
            continue
        bid, base, diff = split
        bases[bid] = base
        rows.append((ck, diff, bid))
    return rows, list(bases.items())


# ------------------------------------------------------------------------------------- helpers
def drop_unused(conn: sqlite3.Connection) -> None:
    """Delete the templates and base configs no row or config uses (in a write transaction: a
    writer stores a row's template with the row, so none is lost to a concurrent prune)."""
    conn.execute("DELETE FROM templates WHERE rid NOT IN (SELECT rid FROM probes WHERE rid IS"
                 " NOT NULL)")  # fmt: skip
    conn.execute("DELETE FROM bases WHERE base NOT IN (SELECT base FROM configs WHERE base IS"
                 " NOT NULL)")  # fmt: skip


def verify_written(conn: sqlite3.Connection, params: list[tuple[Any, ...]]) -> None:
    """Look up (a sample of) the rows just written: a damaged b-tree can lose them silently."""
    step = max(1, len(params) // 32)
    for p in params[::step]:
        if conn.execute(_EXISTS, p[:3]).fetchone() is None:
            raise sqlite3.DatabaseError("database disk image is malformed (a row just written "
                                        "cannot be found)")  # fmt: skip

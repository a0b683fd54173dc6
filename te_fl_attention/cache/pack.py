"""SQLite packs: a self-contained SQLite file of rows, to move caches between stores fast.

``te-fl-attn cache export --format sqlite`` writes one (:func:`export_pack`); ``cache import`` and
``cache merge`` recognise one by its header (:func:`is_pack`: the SQLite magic and the pack's
``application_id``) and copy its rows with SQL (:func:`import_pack`, :func:`merge_pack`).

A pack holds the rows in store schema 2's compact layout (format 2, :mod:`.compact`: each
distinct result once as a template, each row its template's id and ``elapsed_ms`` values, each
config its fields that differ from a base config); format 1 packs (every row in full) still
import. A pack is treated as hostile, as a JSON Lines export is:

* Before any row is read: the file is a regular file (no FIFO or device), attached read-only,
  its ``sqlite_master`` is exactly the pack schema (no extra table, index, view or trigger), its
  ``application_id``/``user_version`` and ``meta`` name this format and a version this package
  reads, and every ``contexts`` row's id is the one its (device, software stack) hashes to (its
  device JSON passes the validator, and is stored as the validator cleaned it); every template's
  and base config's text hashes to its id, a template has as many holes as it says, and a base
  passes the validator unchanged. The file is a single SQLite file (not in WAL mode).
  Before any row is copied: the file passes ``quick_check`` (run by the copier thread while the
  calling thread checks the rows; when it fails, its refusal is the one reported, whatever the
  row checks met). Before the commit: the row checks' scan read as many rows as ``meta`` claims.
  Any failure refuses the whole pack (clear error, nothing applied).
* Each row, in SQL (a column of the checking scan, :data:`ROW_WHERE`): the column checks of the
  schema's ``CHECK`` constraints (:data:`PROBE_CHECKS`; a hostile file need not honour them, and
  ``quick_check`` does not test them: SQLite never parses a read-only database's ``CHECK``s):
  types via ``typeof``, known backends, ranges (``created_at`` in [0, now +
  :data:`.rows.MAX_CLOCK_SKEW_S`], ``elapsed_ms`` in [0, 1e9], ``crc`` 32-bit, ``supported`` 0/1),
  sizes; its context is one of the checked ones; a compact row's values are as many as its
  template's holes, and its template's backend, ``supported`` and ``stage`` are its own. Each
  template goes through the validator once (any value the row checks allow in its holes passes
  it); rows of a template it does not accept as it is go one by one through the full validator.
  In Python (the same scan, read in key order):
  the key's hex digits, the row checksum, and the validator's verdict on the result, cached per
  distinct result text with its in-range ``elapsed_ms`` values masked (so the full validator runs
  once per distinct result, not once per row; the stored ``supported`` and ``stage`` columns must
  agree with it). A result the validator accepts only once cleaned (a control character, a lone
  surrogate) goes through it again in full and is stored cleaned. Config JSON: SQL
  ``json_valid``/``json_type``, and a Python test of its bytes (one object, lists of scalars
  only, nothing escaped); any other config goes through the validator.
* The copy is pipelined: the checks run on the calling thread over a read-only connection of
  their own, the configs first, then the rows; a copier thread on the store's connection runs
  ``quick_check``, then copies the checked configs while the rows are checked, then each checked
  range of config keys (:data:`CHUNK_ROWS` rows, ending where a config begins) with one
  ``INSERT ... SELECT``, leaving out the keys the checks named, while the next range is checked
  (SQLite runs without the GIL, but two SQLite threads of one process scale poorly with the
  Debian build measured; benchmarks/pack_import.md gives what the thread gains). A pack of at
  least :data:`SPLIT_MIN_ROWS` rows has the rows of the upper half of its keys checked by a
  helper process (:class:`Helper`) whose ranges go to the same copier; a helper that cannot run
  or dies rolls the import back, which is then checked in this process alone.
  All connections read one snapshot: the checks' and the copier's each hold their read lock from
  before the copy to the commit (the helper reads meanwhile), the header's change counter must
  not move in between, and a scan out of key order (a damaged b-tree) refuses the pack, so no
  row is copied before its check.
* SQLite's report of damage (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``, or a message quoting schema
  text that is not UTF-8) from any statement that reads the pack, before its checks too (a
  merge first counts duplicates and conflicts), refuses the pack; it is the store's problem only
  when the pack passes ``quick_check`` and the store fails its own.
* A row over :data:`.rows.MAX_ROW` bytes refuses the pack (rolled back: nothing applied). Other
  failing rows are counted and skipped, with one warning; a write is reported from the counts
  read inside the committed transaction.

Conflicts follow the JSON Lines paths: an import never overwrites a stored row; a merge keeps the
later ``created_at`` (a same-result row is a duplicate and leaves the stored one). The trust rule
is unchanged: imported rows are evidence that the rule stage still narrows at use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .. import files as _files
from ._lifecycle import BUSY_TIMEOUT_S
from .compact import HOLE, HOLES, NUMBERS, compact_crc, expand, pieces, text_id
from .keys import CacheKey, known_backends, package_version
from .memory import MemoryCache
from .reader import ImportReport
from .rows import (
    MAX_CLOCK_SKEW_S,
    MAX_ELAPSED_MS,
    MAX_ROW,
    MAX_STRING,
    CacheRow,
    crc_head,
    crc_tail,
    ctx_id,
    dumps,
    row_crc,
    row_crc_bytes,
    row_params,
    validate_flat,
    validate_row,
)
from .sqlite import INSERT_TEMPLATE, ProbeCache, compact_configs, compact_params, drop_unused

log = logging.getLogger("te_fl_attention.cache")

PACK_FORMAT = "te-fl-attention-pack"
#: Format 2: the compact layout of store schema 2 (:mod:`.compact`); format 1 packs still read.
PACK_VERSION = 2
PACK_VERSIONS_READ = (1, 2)
#: ``PRAGMA application_id`` of a pack ("TEFP"; stores are "TEFA").
PACK_APPLICATION_ID = 0x54454650
_MAGIC = b"SQLite format 3\x00"


def _hex(col: str) -> str:
    return (f"typeof({col}) = 'text' AND length({col}) = 64"
            f" AND {col} NOT GLOB '*[^0-9a-f]*'")  # fmt: skip


def _json_object(col: str, nullable: bool) -> str:
    check = (f"typeof({col}) = 'text' AND length(CAST({col} AS BLOB)) <= {MAX_ROW}"
             f" AND json_valid({col}) AND json_type({col}) = 'object'")  # fmt: skip
    return f"({col} IS NULL OR ({check}))" if nullable else check


def _backends() -> str:
    return ", ".join(f"'{b}'" for b in known_backends())


# Per-column checks, written against unqualified column names: the schema's CHECK constraints,
# and (with the table's alias put in) the import's WHERE.
PROBE_CHECKS: dict[str, str] = {
    "config_key": _hex("config_key"),
    "backend": f"typeof(backend) = 'text' AND backend IN ({_backends()})",
    "ctx": "typeof(ctx) = 'integer' AND ctx >= 0",
    "supported": "typeof(supported) = 'integer' AND supported IN (0, 1)",
    "stage": f"typeof(stage) = 'text' AND length(CAST(stage AS BLOB)) <= {MAX_STRING}",
    "elapsed_ms": f"typeof(elapsed_ms) = 'real' AND elapsed_ms BETWEEN 0 AND {MAX_ELAPSED_MS:.0f}",
    "created_at": "typeof(created_at) = 'real' AND created_at >= 0 AND created_at < 1e11",
    "package_version": "typeof(package_version) = 'text' AND length(package_version) <= 128"
    " AND package_version NOT GLOB '*[^ -~]*'",  # printable ASCII (nothing to clean)
    "crc": "typeof(crc) = 'integer' AND crc BETWEEN 0 AND 4294967295",
    "result": (
        f"{_json_object('result', False)}"
        " AND json_extract(result, '$.backend') = backend"
        " AND json_type(result, '$.supported') = CASE supported WHEN 1 THEN 'true' ELSE 'false' END"
        " AND stage = coalesce(json_extract(result, '$.stage'), 'rule')"
        " AND elapsed_ms = coalesce(json_extract(result, '$.elapsed_ms'), 0)"
    ),
}
CONTEXT_CHECKS: dict[str, str] = {
    "ctx": "typeof(ctx) = 'integer' AND ctx >= 0",
    "device_fp": _hex("device_fp"),
    "versions_key": _hex("versions_key"),
    "device": _json_object("device", True),
}
CONFIG_CHECKS: dict[str, str] = {
    "config_key": _hex("config_key"),
    "config": _json_object("config", False),
}


#: The import's per-row SQL (the checks above, less those that cost most per row and that
#: Python makes anyway: the key's length and hex digits, the package version's length and
#: characters (cached per distinct value), and the result's JSON, which the validator's verdict
#: covers, cached per distinct result text).
ROW_WHERE: dict[str, str] = {
    **PROBE_CHECKS,
    "config_key": "typeof(config_key) = 'text'",
    "package_version": "typeof(package_version) = 'text'",
    "result": f"typeof(result) = 'text' AND length(CAST(result AS BLOB)) <= {MAX_ROW}",
}
#: A package version the store keeps: printable ASCII (nothing to clean), at most 128 bytes.
_PACKAGE_VERSION = re.compile(rb"[ -~]{0,128}")
CONFIG_WHERE: dict[str, str] = {
    "config_key": "typeof(config_key) = 'text' AND length(config_key) = 64",
    "config": f"typeof(config) = 'text' AND length(CAST(config AS BLOB)) <= {MAX_STRING}"
    " AND json_valid(config) AND json_type(config) = 'object'",
}


def _ddl(name: str, columns: list[str], checks: dict[str, str], tail: str) -> str:
    cols = ", ".join(f"{c} CHECK ({checks[c.split()[0]]})" if c.split()[0] in checks else c
                     for c in columns)  # fmt: skip
    return f"CREATE TABLE {name} ({cols}{tail}"


#: The pack schema of format 1: exactly these tables (and their automatic indexes), nothing else.
PACK_SCHEMA_1: dict[str, str] = {
    "meta": "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "contexts": _ddl("contexts", ["ctx INTEGER PRIMARY KEY", "device_fp TEXT NOT NULL",
                                  "versions_key TEXT NOT NULL", "device TEXT"],
                     CONTEXT_CHECKS, ")"),  # fmt: skip
    "configs": _ddl("configs", ["config_key TEXT PRIMARY KEY", "config TEXT NOT NULL"],
                    CONFIG_CHECKS, ") WITHOUT ROWID"),  # fmt: skip
    "probes": _ddl("probes", [
        "config_key TEXT NOT NULL", "backend TEXT NOT NULL", "ctx INTEGER NOT NULL",
        "supported INTEGER NOT NULL", "stage TEXT NOT NULL", "elapsed_ms REAL NOT NULL",
        "created_at REAL NOT NULL", "package_version TEXT NOT NULL", "crc INTEGER NOT NULL",
        "result TEXT NOT NULL"], PROBE_CHECKS,
        ", PRIMARY KEY (config_key, backend, ctx)) WITHOUT ROWID"),  # fmt: skip
}

_VALUE = f"typeof({{c}}) = 'real' AND {{c}} BETWEEN 0 AND {MAX_ELAPSED_MS:.0f}"
#: Format 2's per-column checks: format 1's, a compact row's (``result`` empty, a template id,
#: its values), the templates' and the bases'.
PROBE_CHECKS_2: dict[str, str] = {
    **PROBE_CHECKS,
    "result": f"typeof(result) = 'text' AND CASE WHEN rid IS NULL THEN {PROBE_CHECKS['result']}"
    " ELSE result = '' END",
    "rid": "rid IS NULL OR typeof(rid) = 'integer'",
    **{e: f"{e} IS NULL OR ({_VALUE.format(c=e)})" for e in ("e1", "e2", "e3")},
}
TEMPLATE_CHECKS: dict[str, str] = {
    "rid": "typeof(rid) = 'integer'",
    "backend": PROBE_CHECKS["backend"],
    "supported": PROBE_CHECKS["supported"],
    "stage": PROBE_CHECKS["stage"],
    "holes": f"typeof(holes) = 'integer' AND holes BETWEEN 1 AND {HOLES}",
    "template": _json_object("template", False),
}
BASE_CHECKS: dict[str, str] = {
    "base": "typeof(base) = 'integer'",
    "config": _json_object("config", False),
}
CONFIG_CHECKS_2: dict[str, str] = {
    **CONFIG_CHECKS, "base": "base IS NULL OR typeof(base) = 'integer'"}
#: The pack schema of format 2 (store schema 2's tables, with checks).
PACK_SCHEMA: dict[str, str] = {
    "meta": PACK_SCHEMA_1["meta"],
    "contexts": PACK_SCHEMA_1["contexts"],
    "bases": _ddl("bases", ["base INTEGER PRIMARY KEY", "config TEXT NOT NULL"], BASE_CHECKS,
                  ")"),  # fmt: skip
    "templates": _ddl("templates", [
        "rid INTEGER PRIMARY KEY", "backend TEXT NOT NULL", "supported INTEGER NOT NULL",
        "stage TEXT NOT NULL", "holes INTEGER NOT NULL", "template TEXT NOT NULL"],
        TEMPLATE_CHECKS, ")"),  # fmt: skip
    "configs": _ddl("configs", ["config_key TEXT PRIMARY KEY", "config TEXT NOT NULL",
                                "base INTEGER"], CONFIG_CHECKS_2, ") WITHOUT ROWID"),  # fmt: skip
    "probes": _ddl("probes", [
        "config_key TEXT NOT NULL", "backend TEXT NOT NULL", "ctx INTEGER NOT NULL",
        "supported INTEGER NOT NULL", "stage TEXT NOT NULL", "elapsed_ms REAL NOT NULL",
        "created_at REAL NOT NULL", "package_version TEXT NOT NULL", "crc INTEGER NOT NULL",
        "result TEXT NOT NULL", "rid INTEGER", "e1 REAL", "e2 REAL", "e3 REAL"], PROBE_CHECKS_2,
        ", PRIMARY KEY (config_key, backend, ctx)) WITHOUT ROWID"),  # fmt: skip
}
_PACK_SCHEMAS = {1: PACK_SCHEMA_1, 2: PACK_SCHEMA}
#: An ``elapsed_ms`` value in range written plainly (no sign, no exponent, no leading zero: JSON
#: allows none): the text of a result with these masked is the key of the verdict cache (any such
#: value passes the validator, and a text is valid JSON exactly when its masked text is).
_ELAPSED = re.compile(rb'"elapsed_ms":(?:0|[1-9][0-9]{0,8})(?:\.[0-9]{1,20})?(?=[,}])')
_VERDICTS_MAX = 100_000


_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")
_HEX_DIGITS = "0123456789abcdef"
_HEX_BYTES = _HEX_DIGITS.encode()
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]")


def _suspect(data: bytes) -> bool:
    """True if the JSON text ``data`` may hold what a test of its bytes cannot judge: an escape
    (maybe of a control character or a surrogate, which the validator replaces), a raw DEL or C1
    character, a run of 17 digits (maybe an integer beyond 64 bits), a 3-digit exponent (maybe
    not finite), or more than :data:`.rows.MAX_STRING` bytes (maybe too long a string)."""
    if len(data) > MAX_STRING or b"\x7f" in data or b"\xc2" in data:
        return True
    if b"\\" in data and (b"\\u" in data or b"\\b" in data or b"\\f" in data
                           or b"\\r" in data):  # fmt: skip
        return True
    # (signs deleted: "e+000" and "e-000" read "e000"; a run it joins only makes more suspects)
    digits = data.translate(_DIGITS, b"+-")
    return b"00000000000000000" in digits or b"e000" in digits


def _flat_shape(data: bytes) -> bool:
    """True if the JSON object text ``data`` (valid JSON: SQL checked it) can only be an object
    of at most 256 fields whose values are scalars or lists of scalars (braces or brackets in
    strings, or colons after escaped quotes, make it False: the validator decides)."""
    if data.count(b"{") != 1 or data.count(b"}") != 1 or data.count(b'":') > 256:
        return False
    return not data.translate(None, _NOT_BRACKETS).replace(b"[]", b"")


def _qualified(checks: dict[str, str], alias: str) -> str:
    """The checks of one table as one SQL condition on ``alias``'s columns."""
    names = sorted(checks, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.'$])(" + "|".join(names) + r")(?![\w'(])")
    parts = [pattern.sub(lambda m: f"{alias}.{m.group(1)}", text) for text in checks.values()]
    return " AND ".join(f"({p})" for p in parts)


# ------------------------------------------------------------------------------------- detection
def is_pack(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a regular file with the SQLite header and the pack's application id
    (a FIFO, device...: False, unread)."""
    try:
        with _files.open_regular(path) as f:
            head = f.read(100)
    except OSError:
        return False
    return head[:16] == _MAGIC and int.from_bytes(head[68:72], "big") == PACK_APPLICATION_ID


class PackError(OSError):
    """A pack that is refused as a whole (nothing applied)."""


# ---------------------------------------------------------------------------------------- export
def export_pack(cache: ProbeCache | MemoryCache, path: str | os.PathLike[str], *,
                device_fp: str | None = None, exist_ok: bool = False) -> int:  # fmt: skip
    """Write every row (or only ``device_fp``'s) as a pack; returns the number of rows.

    Written to a temporary file in the target directory, flushed to disk and renamed (an existing
    output is refused unless ``exist_ok``); the count reported is read back from the file.
    """
    out = Path(path)
    with _files.atomic_output(out, exist_ok=exist_ok, mode=0o600) as tmp:
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=OFF")  # a temporary file: the rename commits it
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute(f"PRAGMA application_id={PACK_APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={PACK_VERSION}")
            for ddl in PACK_SCHEMA.values():
                conn.execute(ddl)
            store = cache.path if isinstance(cache, ProbeCache) and cache.mode != "memo" else None
            if store is not None and store.exists():
                conn.execute("ATTACH ? AS src", (f"file:{quote(str(store))}?mode=ro",))
            conn.execute("BEGIN")
            if store is not None and store.exists():
                _copy_store(conn, device_fp)
            else:
                _copy_rows(conn, cache, device_fp)
            n = conn.execute("SELECT count(*) FROM probes").fetchone()[0]
            conn.executemany("INSERT INTO meta (name, value) VALUES (?, ?)", [
                ("format", PACK_FORMAT), ("format_version", str(PACK_VERSION)),
                ("package_version", package_version()), ("rows", str(n)),
                ("exported_at", repr(time.time())),
            ])  # fmt: skip
            conn.execute("COMMIT")
        finally:
            conn.close()
        check = sqlite3.connect(f"file:{quote(str(tmp))}?mode=ro", uri=True)
        try:  # read back: report only what is in the file
            found = check.execute("SELECT count(*) FROM probes").fetchone()[0]
        finally:
            check.close()
        if found != n:
            raise OSError(f"{tmp} holds {found} rows after writing {n}")
    return int(n)


def _crc_fn(ck: Any, backend: Any, fp: Any, vk: Any, text: Any) -> int | None:
    """:func:`.rows.row_crc` for SQL (``None`` for values of other types)."""
    if type(text) is not str or type(ck) is not str:
        return None
    try:
        return row_crc(CacheKey(ck, backend, fp, vk), text)
    except (TypeError, ValueError, UnicodeEncodeError):
        return None


def _compact_crc_fn(ck: Any, backend: Any, ctx: Any, rid: Any, elapsed: Any, e1: Any, e2: Any,
                    e3: Any) -> int | None:  # fmt: skip
    """:func:`.compact.compact_crc` for SQL (``None`` for values of other types)."""
    try:
        return compact_crc(ck, backend, ctx, rid, elapsed, e1, e2, e3)
    except (TypeError, ValueError, UnicodeEncodeError, struct.error):
        return None


def _full_fn(result: Any, template: Any, elapsed: Any, e1: Any, e2: Any, e3: Any
             ) -> bytes | None:  # fmt: skip
    """A row's full result text for SQL: a full row's ``result``, or a compact row's template
    with its values (``None`` where neither reads)."""
    if template is None:
        return result.encode() if type(result) is str else result if type(result) is bytes else None
    try:
        return expand(pieces(template.encode() if type(template) is str else template), elapsed,
                      e1, e2, e3)  # fmt: skip
    except (TypeError, ValueError):
        return None


def _text_id_fn(text: Any) -> int | None:
    """:func:`.compact.text_id` of a text for SQL (``None`` for other types)."""
    return text_id(text.encode()) if type(text) is str else None


def _copy_store(conn: sqlite3.Connection, device_fp: str | None) -> None:
    """Copy the attached store's (``src``) readable rows (checksum right, a compact row's
    template whole) with SQL; a row that fails the pack's CHECK constraints is left out."""
    conn.create_function("te_crc", 5, _crc_fn, deterministic=True)
    conn.create_function("te_compact_crc", 8, _compact_crc_fn, deterministic=True)
    conn.create_function("te_text_id", 1, _text_id_fn, deterministic=True)
    schema = conn.execute("PRAGMA src.user_version").fetchone()[0]
    args: list[Any] = []
    device = ""
    if device_fp is not None:
        device = " AND c.device_fp = ?"
        args.append(device_fp)
    conn.execute("INSERT OR IGNORE INTO contexts SELECT c.* FROM src.contexts c WHERE 1"
                 + device, args)  # fmt: skip
    if schema < 2:  # a schema-1 store: every row in full
        conn.execute(f"INSERT OR IGNORE INTO probes ({_COLUMNS}) SELECT {_P_COLUMNS_1}, NULL, NULL,"
                     " NULL, NULL FROM src.probes p JOIN contexts c ON c.ctx = p.ctx WHERE p.crc ="
                     f" te_crc(p.config_key, p.backend, c.device_fp, c.versions_key, p.result)"
                     + device, args)  # fmt: skip
        conn.execute("INSERT OR IGNORE INTO configs (config_key, config) SELECT g.config_key,"
                     " g.config FROM src.configs g WHERE g.config_key IN (SELECT config_key FROM"
                     " probes)")  # fmt: skip
    else:
        conn.execute("INSERT OR IGNORE INTO templates SELECT * FROM src.templates t"
                     " WHERE t.rid = te_text_id(t.template)")  # fmt: skip
        conn.execute(
            f"INSERT OR IGNORE INTO probes ({_COLUMNS}) SELECT {_P_COLUMNS} FROM src.probes p"
            " JOIN contexts c ON c.ctx = p.ctx WHERE CASE WHEN p.rid IS NULL THEN p.crc = te_crc("
            "p.config_key, p.backend, c.device_fp, c.versions_key, p.result) ELSE p.crc ="
            " te_compact_crc(p.config_key, p.backend, p.ctx, p.rid, p.elapsed_ms, p.e1, p.e2, p.e3)"
            " AND p.rid IN (SELECT rid FROM templates) END" + device, args)  # fmt: skip
        conn.execute("INSERT OR IGNORE INTO bases SELECT * FROM src.bases b WHERE b.base ="
                     " te_text_id(b.config)")  # fmt: skip
        conn.execute("INSERT OR IGNORE INTO configs (config_key, config, base) SELECT"
                     " g.config_key, g.config, g.base FROM src.configs g WHERE g.config_key IN"
                     " (SELECT config_key FROM probes) AND (g.base IS NULL OR g.base IN (SELECT"
                     " base FROM bases))")  # fmt: skip
        drop_unused(conn)  # (the templates and bases of rows and configs left out)
    conn.execute("DELETE FROM contexts WHERE ctx NOT IN (SELECT ctx FROM probes)")


def _copy_rows(conn: sqlite3.Connection, cache: Any, device_fp: str | None) -> None:
    """Copy rows read through the cache's API (a memory cache, a store kept in memory), in the
    compact layout where they fit it."""
    for row in cache.iter_rows(device_fp=device_fp):
        (p,), templates = compact_params([row_params(row)])
        conn.executemany("INSERT OR IGNORE INTO templates VALUES (?,?,?,?,?,?)", templates)
        conn.execute(f"INSERT OR IGNORE INTO probes VALUES ({','.join('?' * 14)})", p)
        device = dumps(row.device) if row.device is not None else None
        conn.execute("INSERT INTO contexts VALUES (?,?,?,?) ON CONFLICT (ctx) DO UPDATE SET"
                     " device = coalesce(contexts.device, excluded.device)",
                     (p[2], row.key.device_fp, row.key.versions_key, device))  # fmt: skip
        if row.config is not None:
            configs, bases = compact_configs([(row.key.config_key,
                                               (dumps(row.config), row.config))])  # fmt: skip
            conn.executemany("INSERT OR IGNORE INTO bases VALUES (?, ?)", bases)
            conn.executemany("INSERT OR IGNORE INTO configs VALUES (?, ?, ?)", configs)


# ---------------------------------------------------------------------------------------- checks
def _check_schema(conn: sqlite3.Connection) -> tuple[int, int]:
    """The attached ``pk``'s format and the row count its meta claims (matched by the row checks'
    scan), or :class:`PackError`: why it is not a pack this package reads."""
    app = conn.execute("PRAGMA pk.application_id").fetchone()[0]
    version = conn.execute("PRAGMA pk.user_version").fetchone()[0]
    if app != PACK_APPLICATION_ID:
        raise PackError("not a te_fl_attention pack (application id)")
    meta = dict(conn.execute("SELECT CAST(name AS TEXT), CAST(value AS TEXT) FROM pk.meta"
                             " LIMIT 16").fetchall()) if version in _PACK_SCHEMAS else {}
    text = str(meta.get("format_version", ""))
    if version not in _PACK_SCHEMAS or (text.isdigit() and int(text) != version):
        found = version if version not in _PACK_SCHEMAS or not text.isdigit() else int(text)
        raise PackError(f"format_version {found} is not supported (this package reads"
                        f" {', '.join(map(str, PACK_VERSIONS_READ))})")  # fmt: skip
    objects = {(str(t), str(n), str(tbl)): q for t, n, tbl, q in conn.execute(
        "SELECT type, name, tbl_name, sql FROM pk.sqlite_master")}  # fmt: skip
    expected = {("table", n, n): ddl for n, ddl in _PACK_SCHEMAS[version].items()}
    extra = sorted(f"{t} {n}" for t, n, _ in objects.keys() - expected.keys())
    if extra:  # (WITHOUT ROWID and INTEGER PRIMARY KEY tables have no automatic index)
        raise PackError(f"unexpected schema objects: {', '.join(extra)[:300]}")
    missing = sorted(n for _, n, _ in expected.keys() - objects.keys())
    if missing:
        raise PackError(f"missing schema objects: {', '.join(missing)}")
    for k, ddl in expected.items():
        if objects[k] != ddl:
            raise PackError(f"table {k[1]} is not the pack's table")
    if meta.get("format") != PACK_FORMAT:
        raise PackError(f"not a {PACK_FORMAT} file (format={str(meta.get('format'))[:60]!r})")
    if not text.isdigit():
        raise PackError("meta format_version must be an integer")
    rows = str(meta.get("rows", ""))
    if not rows.isdigit():
        raise PackError("meta rows must be an integer")
    return version, int(rows)


@dataclass
class _Pass:
    """The Python half of the row checks: counts, the first problems, and the keys the bulk copy
    leaves out (rejected, or for the full validator)."""

    passed: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)
    slow: list[tuple[Any, Any, Any]] = field(default_factory=list)
    verdicts: dict[Any, Any] = field(default_factory=dict)  # masked text -> the verdict
    slow_configs: list[Any] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)  # configs (listed after rows)
    seen: int = 0

    def reject(self, reason: str) -> None:
        self.seen += 1
        self.rejected.append((self.seen, reason))

    def rows(self, cursor: Any, contexts: dict[int, tuple[str, str]],
             templates: dict[int, _Template], emit: Any, lo: str = "",
             end: str | None = None) -> None:  # fmt: skip
        """Check every row of ``cursor`` (:func:`_scan`, in key order, from ``lo`` to ``end``)
        and hand the copier each checked range of config keys with the keys it must leave out
        (``emit(lo, hi, skip)``; ``hi`` ``None`` for the last range of the pack). ``templates``:
        :func:`_templates`."""
        last_ck: Any = None  # the last config key (bytes) and whether it is 64 hex digits
        last_ok = False
        skip, n, base, slow = [], 0, self.seen, 0
        verdicts, elapsed, crc32, pack_numbers = self.verdicts, _ELAPSED.sub, zlib.crc32, NUMBERS
        tails: dict[Any, bytes] = {}  # (context, backend) -> the checksum's bytes after the key
        ck_crc = 0
        rejected = self.rejected
        versions: dict[Any, bool] = {}  # package version -> good

        for (ck, backend, ctx, crc, supported, stage, data, rid, el, e1, e2, e3, pv,
             sql_ok) in cursor:  # fmt: skip
            if data is not None and len(data) > MAX_ROW:
                raise PackError(f"a row of {len(data)} bytes (limit {MAX_ROW})")
            if ck != last_ck:
                last_ok = type(ck) is bytes and len(ck) == 64 and not ck.strip(_HEX_BYTES)
                if last_ok:
                    if type(last_ck) is bytes and ck <= last_ck:  # the scan must be in key order
                        raise PackError("the pack's rows are not in key order (a damaged file)")
                    if n >= CHUNK_ROWS:  # a range ends where a config begins
                        hi = ck.decode()
                        emit(lo, hi, skip)
                        lo, skip, base, n = hi, [], base + n, 0
                    last_ck = ck
                    ck_crc = crc32(crc_head(ck.decode()))
            n += 1
            pv_ok = versions.get(pv)
            if pv_ok is None:
                pv_ok = versions[pv] = type(pv) is bytes and bool(_PACKAGE_VERSION.fullmatch(pv))
            if not (sql_ok and last_ok and pv_ok):
                skip.append((ck, backend, ctx))
                rejected.append((base + n, _FAILS_SQL))
                continue
            if rid is not None:  # compact: (.compact.compact_crc, its key part once per key)
                template = templates.get(rid)  # (its backend, support, stage and holes the row's)
                if template is None or template[1] != (backend, supported, stage, e1 is None,
                                                       e2 is None, e3 is None):  # fmt: skip
                    skip.append((ck, backend, ctx))
                    rejected.append((base + n, _FAILS_SQL))
                    continue
                tail = tails.get(backend)
                if tail is None:
                    tail = tails[backend] = backend + b"\0"
                if crc32(pack_numbers(ctx, rid, el, -1.0 if e1 is None else e1,
                                      -1.0 if e2 is None else e2, -1.0 if e3 is None else e3),
                         crc32(tail, ck_crc)) != crc:  # fmt: skip
                    skip.append((ck, backend, ctx))
                    rejected.append((base + n, "checksum mismatch"))
                elif not template[0]:  # its template needs the validator row by row
                    skip.append((ck, backend, ctx))
                    self.slow.append((ck.decode(), backend.decode(), ctx))
                    slow += 1
                continue
            tail = tails.get((ctx, backend))
            if tail is None:
                tail = tails[ctx, backend] = crc_tail(backend.decode(), *contexts[ctx])
            if crc32(data, crc32(tail, ck_crc)) != crc:
                skip.append((ck, backend, ctx))
                rejected.append((base + n, "checksum mismatch"))
                continue
            # The verdict of the full validator, per distinct text (elapsed_ms values that any
            # result may hold masked): another text never shares a verdict.
            masked = (backend, elapsed(b'"elapsed_ms":0', data))
            verdict = verdicts.get(masked)
            if verdict is None:
                if len(verdicts) >= _VERDICTS_MAX:
                    verdicts.clear()
                key = CacheKey(ck.decode(), backend.decode(), *contexts[ctx])
                verdict = verdicts[masked] = _verdict(key, data)
            if verdict is False or verdict != (supported, stage):
                skip.append((ck, backend, ctx))
                self.slow.append((ck.decode(), backend.decode(), ctx))
                slow += 1
        emit(lo, end, skip)
        self.seen = base + n
        self.passed += self.seen - len(self.rejected) - slow

    def configs(self, cursor: Any) -> list[Any]:
        """Check every config row of ``cursor`` (:data:`_VERIFY_CONFIGS`); the keys the bulk copy
        leaves out: a bad one is dropped (its rows stay), one that is not plainly flat (valid
        JSON: SQL checked it) or holds anything suspect goes to the validator."""
        skip = []
        for ck, sql_ok, data in cursor:
            if not sql_ok or type(ck) is not bytes or ck.strip(_HEX_BYTES):
                self.dropped.append((0, "a config row fails the pack's checks (dropped)"))
            elif type(data) is not bytes or _suspect(data) or not _flat_shape(data):
                self.slow_configs.append(ck.decode())
            else:
                continue
            skip.append((ck,))
        return skip


def _verdict(key: CacheKey, data: bytes) -> tuple[int, bytes] | bool:
    """``(supported as 0/1, stage as UTF-8)`` if the validator accepts this result unchanged for
    a row of key ``key`` (the columns must agree), else ``False``."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return False
    row = validate_row({"config_key": key[0], "backend": key[1], "device_fp": key[2],
                        "versions_key": key[3], "result": obj})  # fmt: skip
    if not isinstance(row, CacheRow) or row.result != obj:
        return False
    return (1 if obj["supported"] else 0), str(obj.get("stage", "rule")).encode()


def _contexts(conn: sqlite3.Connection
              ) -> tuple[dict[int, tuple[str, str]], dict[int, str | None]]:  # fmt: skip
    """The pack's contexts (id -> device fingerprint, versions key) and their device JSON as the
    validator cleaned it (what the store keeps), or :class:`PackError`: why the pack is refused
    (an id that is not the hash of its device and software stack, a device JSON the validator
    refuses)."""
    good: dict[int, tuple[str, str]] = {}
    devices: dict[int, str | None] = {}
    where = _qualified(CONTEXT_CHECKS, "c")
    for ctx, fp, vk, device, ok in conn.execute(
            f"SELECT c.ctx, c.device_fp, c.versions_key, c.device, CASE WHEN {where} THEN 1"
            " ELSE 0 END FROM pk.contexts c"):  # fmt: skip
        if not ok or ctx != ctx_id(fp, vk):
            raise PackError(f"context {str(ctx)[:24]} is not the id of its device and software"
                            " stack")  # fmt: skip
        try:
            checked = None if device is None else validate_flat(json.loads(device), "device")
        except (ValueError, RecursionError):
            checked = "device is not a JSON object the checks can read"
        if isinstance(checked, str):
            raise PackError(f"context {ctx}: {checked}")
        good[int(ctx)] = (fp, vk)
        devices[int(ctx)] = None if checked is None else dumps(checked)
    return good, devices


def _shape(backend: bytes, supported: int, stage: bytes, holes: int) -> tuple[Any, ...]:
    """What every row of a template must hold, as the row checks compare it: backend and stage
    as UTF-8, ``supported``, and whether each of ``e1``..``e3`` is past the template's holes."""
    return (backend, supported, stage, *(holes <= i for i in range(1, HOLES)))


#: A checked template: whether the validator accepts it as it is, its :func:`_shape`, its holes.
_Template = tuple[bool, tuple[Any, ...], int]


def _templates(conn: sqlite3.Connection) -> dict[int, _Template]:
    """The pack's templates: id -> whether the validator accepts it as it is (for every value of
    its holes: any value the row checks allow passes it), its :func:`_shape` and holes; or
    :class:`PackError` for a template whose text is not the one its id names, or whose holes are
    not as many as it says."""
    out: dict[int, _Template] = {}
    where = _qualified(TEMPLATE_CHECKS, "t")
    for rid, backend, supported, stage, holes, text, ok in conn.execute(
            "SELECT t.rid, CAST(t.backend AS BLOB), t.supported, CAST(t.stage AS BLOB), t.holes,"
            f" CAST(t.template AS BLOB), CASE WHEN {where} THEN 1 ELSE 0 END FROM pk.templates t"):
        if not ok or text_id(text) != rid or len(HOLE.findall(text)) != holes:
            raise PackError(f"template {str(rid)[:24]} is not the template its id names")
        key = CacheKey("0" * 64, backend.decode(), "0" * 64, "0" * 64)
        out[rid] = (_verdict(key, text) == (supported, stage),
                    _shape(backend, supported, stage, holes), holes)
    return out


def _bases(conn: sqlite3.Connection) -> set[int]:
    """The pack's base configs' ids, or :class:`PackError` for a base whose text is not the one
    its id names or that the validator does not accept as it is."""
    out: set[int] = set()
    where = _qualified(BASE_CHECKS, "b")
    for bid, text, ok in conn.execute(
            f"SELECT b.base, CAST(b.config AS BLOB), CASE WHEN {where} THEN 1 ELSE 0 END"
            " FROM pk.bases b"):  # fmt: skip
        if not ok or text_id(text) != bid:
            raise PackError(f"base config {str(bid)[:24]} is not the config its id names")
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError):  # (too deeply nested for Python's parser)
            fields = None
        if fields is None or validate_flat(fields, "config") != fields:
            raise PackError(f"base config {bid} fails the checks of a config")
        out.add(bid)
    return out


# ---------------------------------------------------------------------------------------- import
@dataclass
class PackResult:
    """What copying a pack did (:func:`import_pack` / :func:`merge_pack`): rows written, rows
    skipped (already stored), same-key conflicts and duplicates (merge), rejected rows."""

    written: int = 0
    skipped: int = 0
    conflicts: int = 0
    duplicates: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)


_COLUMNS_1 = ("config_key, backend, ctx, supported, stage, elapsed_ms, created_at,"
              " package_version, crc, result")  # fmt: skip
_COLUMNS = f"{_COLUMNS_1}, rid, e1, e2, e3"
_P_COLUMNS_1 = ", ".join(f"p.{c.strip()}" for c in _COLUMNS_1.split(","))
_P_COLUMNS = ", ".join(f"p.{c.strip()}" for c in _COLUMNS.split(","))
#: A row's stored form (a merge counts a same-key row of the same form as a duplicate).
_FORM = ("result", "rid", "elapsed_ms", "e1", "e2", "e3")
_UPDATE = ", ".join(f"{c}=excluded.{c}" for c in (
    "supported", "stage", "elapsed_ms", "created_at", "package_version", "crc", "result", "rid",
    "e1", "e2", "e3"))  # fmt: skip
_CONFLICT = {
    "ignore": " ON CONFLICT DO NOTHING",
    "newer": f" ON CONFLICT (config_key, backend, ctx) DO UPDATE SET {_UPDATE}"
    " WHERE excluded.created_at > probes.created_at AND"
    f" ({', '.join('excluded.' + c for c in _FORM)}) IS NOT"
    f" ({', '.join('probes.' + c for c in _FORM)})",
}


def _connect_store(store: ProbeCache) -> sqlite3.Connection:
    """A connection of its own to the store's file (a pack's trouble never degrades the store);
    the copier thread uses it while the calling thread waits."""
    conn = sqlite3.connect(f"file:{quote(str(store.path))}", uri=True, isolation_level=None,
                           timeout=getattr(store, "busy_timeout_s", BUSY_TIMEOUT_S),
                           check_same_thread=False)  # fmt: skip
    # A small page cache (2 MiB): the copy inserts in key order, so its pages spill to the WAL
    # while the rows are still being checked, and the commit writes little (a cache that holds
    # the whole copy writes all of it at the commit: 10-15% slower at 200k rows).
    conn.execute("PRAGMA cache_size=-2048")
    conn.execute("PRAGMA trusted_schema=OFF")  # schema objects may use innocuous functions only
    return conn


def _connect_pack(pack: Path) -> sqlite3.Connection:
    """The checking thread's read-only connection to the pack."""
    conn = sqlite3.connect(f"file:{quote(str(pack))}?mode=ro", uri=True, isolation_level=None)
    conn.execute("PRAGMA trusted_schema=OFF")
    conn.execute("PRAGMA cell_size_check=ON")
    return conn


def _change_counter(pack: Path) -> bytes:
    """The file change counter of the pack's header (a committed write changes it), or
    :class:`PackError` for a pack in WAL mode (whose commits leave the counter as it is, and
    whose readers may each see another snapshot: an exported pack is never one)."""
    with _files.open_regular(pack) as f:
        head = f.read(28)
    if head[18:20] != b"\x01\x01":
        raise PackError("the pack is not a single-file SQLite database (it is in WAL mode)")
    return head[24:28]


def _quick_check(conn: sqlite3.Connection) -> None:
    """SQLite's ``quick_check`` of the attached ``pk`` (:class:`PackError` if it fails)."""
    found = [str(r[0]) for r in conn.execute("PRAGMA pk.quick_check(5)")]
    if found != ["ok"]:
        raise PackError("integrity check failed: " + "; ".join(found)[:300])


@dataclass
class _Checked:
    """What the whole-pack checks found: the format, the contexts (id -> device fingerprint,
    versions key) with their cleaned device JSON, the templates (id -> accepted as they are), the
    base configs' ids, and the row count the meta claims."""

    version: int
    contexts: dict[int, tuple[str, str]]
    devices: dict[int, str | None]
    templates: dict[int, _Template]
    bases: set[int]
    claimed: int


def _check_pack(conn: sqlite3.Connection) -> _Checked:
    """Whole-pack checks on the attached ``pk`` (:class:`PackError` if refused)."""
    version, claimed = _check_schema(conn)  # (first: the rest is read only from a pack's schema)
    contexts, devices = _contexts(conn)
    if version < 2:
        return _Checked(version, contexts, devices, {}, set(), claimed)
    return _Checked(version, contexts, devices, _templates(conn), _bases(conn), claimed)


#: A checked template into the store (``main``: the pack attached beside it has one too).
_INSERT_TEMPLATE_MAIN = INSERT_TEMPLATE.replace("INTO templates", "INTO main.templates", 1)
_FAILS_SQL = "fails the pack's checks (types, ranges, sizes or context)"
#: What reading a pack can raise: SQLite's errors, and :class:`UnicodeDecodeError` where SQLite's
#: message quotes schema text that is not UTF-8 (Python's sqlite3 cannot decode it).
_READ_ERRORS = (sqlite3.Error, UnicodeDecodeError)


def _rows_where(contexts: Any, version: int = PACK_VERSION,
                max_created: float | None = None) -> str:  # fmt: skip
    """The per-row SQL condition of the checking scan (:data:`ROW_WHERE`, a ``created_at`` no
    later than now plus the allowed skew, a context among the checked ``contexts``' ids; in format
    2 a full row's or a compact row's: its values as many as its template's holes, and its
    template's backend, ``supported`` and ``stage`` its own)."""
    if max_created is None:
        max_created = time.time() + MAX_CLOCK_SKEW_S
    common = (f"p.created_at <= {max_created!r}"
              f" AND p.ctx IN ({','.join(map(str, contexts)) or 'NULL'})")  # fmt: skip
    if version < 2:
        return f"({_qualified(ROW_WHERE, 'p')}) AND {common}"
    # (a compact row's backend, support, stage and holes are its template's: checked in Python)
    columns = _qualified({k: v for k, v in ROW_WHERE.items() if k not in ("result", "backend")},
                         "p")  # fmt: skip
    values = " AND ".join(f"(p.{e} IS NULL OR ({_VALUE.format(c='p.' + e)}))"
                          for e in ("e1", "e2", "e3"))  # fmt: skip
    full = (f"p.rid IS NULL AND p.e1 IS NULL AND p.e2 IS NULL AND p.e3 IS NULL AND"
            f" {_qualified({k: ROW_WHERE[k] for k in ('result', 'backend')}, 'p')}")  # fmt: skip
    compact = (f"typeof(p.rid) = 'integer' AND typeof(p.backend) = 'text' AND p.result = ''"
               f" AND {values}")  # fmt: skip
    return f"({columns}) AND (({full}) OR ({compact})) AND {common}"


#: Rows per range of the pipelined copy (a range ends where a config begins).
CHUNK_ROWS = 8192
#: Packs of at least this many rows have the upper half of their rows checked by a helper
#: process (:mod:`._pack_check`) where this process may run on two CPUs or more.
SPLIT_MIN_ROWS = 50_000
#: The share of the rows (the upper part of the keys) the helper checks.
HELPER_SHARE = 0.6


def _scan(version: int, ok: str, bound: str = "") -> str:
    """The checking scan (key order: the primary key, no sort); ``bound``: a condition on
    ``p.config_key`` with one parameter (a helper's half)."""
    compact = ("p.rid, p.elapsed_ms, p.e1, p.e2, p.e3" if version >= 2
               else "NULL, 0.0, NULL, NULL, NULL")  # fmt: skip
    return ("SELECT CAST(p.config_key AS BLOB), CAST(p.backend AS BLOB), p.ctx, p.crc,"
            f" p.supported, CAST(p.stage AS BLOB), CAST(p.result AS BLOB), {compact},"
            f" CAST(p.package_version AS BLOB), CASE WHEN {ok} THEN 1 ELSE 0 END FROM probes p"
            f"{' WHERE p.config_key ' + bound if bound else ''}"
            " ORDER BY p.config_key, p.backend, p.ctx")  # fmt: skip


def _verify_configs(version: int, bases: set[int]) -> str:
    """The configs' checking scan."""
    ok = _qualified(CONFIG_WHERE, "g")
    if version >= 2:
        ok += f" AND (g.base IS NULL OR g.base IN ({','.join(map(str, bases)) or 'NULL'}))"
    return (f"SELECT CAST(g.config_key AS BLOB), CASE WHEN {ok} THEN 1 ELSE 0 END,"
            " CAST(g.config AS BLOB) FROM configs g ORDER BY g.config_key")  # fmt: skip


_SKIP_DDL = (
    "CREATE TEMP TABLE te_pack_skip (ck BLOB, backend BLOB, ctx,"
    " PRIMARY KEY (ck, backend, ctx))",
    "CREATE TEMP TABLE te_pack_skip_cfg (ck BLOB PRIMARY KEY)",
)
#: The copier's range copy. It also takes only well-typed keys (the checks' bounds are text), and
#: leaves out the keys the checks named (``temp.te_pack_skip``, compared as bytes: any type).
_RANGE = (
    f"INSERT INTO main.probes ({_COLUMNS}) SELECT {{columns}} FROM pk.probes p"
    " WHERE p.config_key >= ?{hi} AND typeof(p.config_key) = 'text'"
    " AND typeof(p.backend) = 'text' AND typeof(p.ctx) = 'integer' AND NOT EXISTS (SELECT 1 FROM"
    " temp.te_pack_skip s WHERE s.ck = CAST(p.config_key AS BLOB)"
    " AND s.backend = CAST(p.backend AS BLOB) AND s.ctx = p.ctx)"
)
_CONFIGS = (
    "INSERT INTO main.configs (config_key, config, base) SELECT g.config_key, g.config, {base}"
    " FROM pk.configs g WHERE typeof(g.config_key) = 'text' AND typeof(g.config) = 'text' AND NOT"
    " EXISTS (SELECT 1 FROM temp.te_pack_skip_cfg s WHERE s.ck = CAST(g.config_key AS BLOB))"
    " ON CONFLICT DO NOTHING"
)


class _Copier(threading.Thread):
    """Runs the pack's ``quick_check``, then copies the checked configs and ranges of rows with
    SQL on the store's connection, while the calling thread checks the next (SQLite runs without
    the GIL; see the module docstring for what the thread gains)."""

    def __init__(self, conn: sqlite3.Connection, rule: str, version: int = PACK_VERSION) -> None:
        super().__init__(name="te-fl-attn-pack-copy", daemon=True)
        self.conn, self.jobs = conn, queue.SimpleQueue()
        self.error: BaseException | None = None
        self.refused: PackError | None = None  # the quick_check's refusal
        self.checked = threading.Event()
        tail = _CONFLICT[rule]
        columns = _P_COLUMNS if version >= 2 else f"{_P_COLUMNS_1}, NULL, NULL, NULL, NULL"
        copy = _RANGE.replace("{columns}", columns)
        self.sql = (copy.format(hi=" AND p.config_key < ?") + tail, copy.format(hi="") + tail)
        self.configs_sql = _CONFIGS.format(base="g.base" if version >= 2 else "NULL")

    def run(self) -> None:
        conn = self.conn
        try:  # first, before any copy
            _quick_check(conn)
        except sqlite3.Error as exc:
            self.error = self.refused = PackError(f"cannot read the pack: {exc}")
        except PackError as exc:
            self.error = self.refused = exc
        except BaseException as exc:  # (re-raised by the calling thread)
            self.error = exc
        self.checked.set()  # (always: the calling thread may be waiting for it)
        while (job := self.jobs.get()) is not None:
            if self.error is not None:
                continue  # drain: the calling thread rolls back
            try:
                kind, lo, hi, skip = job
                if kind == "configs":
                    conn.executemany("INSERT OR IGNORE INTO temp.te_pack_skip_cfg VALUES (?)", skip)
                    conn.execute(self.configs_sql)
                    continue
                conn.executemany("INSERT OR IGNORE INTO temp.te_pack_skip VALUES (?, ?, ?)", skip)
                if hi is None:
                    conn.execute(self.sql[1], (lo,))
                else:
                    conn.execute(self.sql[0], (lo, hi))
            except BaseException as exc:  # (re-raised by the calling thread)
                self.error = exc

    def refusal(self) -> PackError | None:
        """Wait for the ``quick_check``; its refusal, if it failed."""
        self.checked.wait()
        return self.refused

    def emit(self, lo: str, hi: str | None, skip: list[tuple[Any, ...]]) -> None:
        if self.error is not None:
            raise self.error
        self.jobs.put(("rows", lo, hi, skip))

    def configs(self, skip: list[tuple[Any, ...]]) -> None:
        """Copy the pack's configs, less the keys in ``skip``."""
        self.jobs.put(("configs", None, None, skip))

    def finish(self) -> None:
        """Wait for every queued copy; re-raise the copier's error."""
        self.jobs.put(None)
        self.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop at once (the statement running is interrupted) and wait."""
        self.error = self.error or PackError("stopped")
        with contextlib.suppress(sqlite3.Error):
            self.conn.interrupt()
        self.jobs.put(None)
        self.join()


def _copy_pack(conn: sqlite3.Connection, pack: Path, rule: str, split: bool = True) -> PackResult:
    """Check and copy the attached pack's rows in one transaction (committed on return).

    The checks (SQL per row in the scan, then Python: key digits, checksum, the validator's
    verdict) run on this thread over a connection of their own, configs first, then the rows in
    key order (the upper half of the rows in a helper process, :mod:`._pack_check`, for a large
    pack); the :class:`_Copier` thread runs the pack's ``quick_check``, then copies the checked
    configs and each checked range of keys (less the keys the checks left out) with one
    ``INSERT ... SELECT`` each. All read the same snapshot (each holds its read lock from before
    the copy to the commit, and the header's change counter must not move).
    """
    result = PackResult()
    check = _Pass()
    counter = _change_counter(pack)
    try:
        conn.execute("ATTACH ? AS pk", (f"file:{quote(str(pack))}?mode=ro",))
        found = _check_pack(conn)
    except _READ_ERRORS as exc:  # the pack, not the store: unreadable, not SQLite...
        with contextlib.suppress(sqlite3.Error):
            conn.execute("DETACH pk")
        raise PackError(f"cannot read the pack: {_sqlite_problem(exc)}") from None
    reader = _connect_pack(pack)
    copier: _Copier | None = None
    helper: Helper | None = None
    ctxs, version = found.contexts, found.version
    try:
        max_created = time.time() + MAX_CLOCK_SKEW_S
        sql_ok = _rows_where(ctxs, version, max_created)
        for ddl in _SKIP_DDL:  # (the connection is this import's own: new tables)
            conn.execute(ddl)
        conn.execute("BEGIN IMMEDIATE")
        before = conn.execute("SELECT count(*) FROM main.probes").fetchone()[0]
        conn.executemany(  # the checked contexts, with their device JSON cleaned
            "INSERT INTO contexts (ctx, device_fp, versions_key, device) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (ctx) DO UPDATE SET device=excluded.device WHERE contexts.device IS NULL"
            " AND excluded.device IS NOT NULL",
            [(ctx, fp, vk, found.devices[ctx]) for ctx, (fp, vk) in ctxs.items()])  # fmt: skip
        if rule == "newer":  # same form, or (one full, one compact) the same text
            conn.create_function("te_full", 6, _full_fn, deterministic=True)
            p_rid, p_tpl, p_join = ("p.rid", "pt.template", " LEFT JOIN pk.templates pt ON"
                                    " pt.rid = p.rid") if version >= 2 else ("NULL", "NULL", "")
            p_values = "p.e1, p.e2, p.e3" if version >= 2 else "NULL, NULL, NULL"
            form = ("(p.result, NULL, p.elapsed_ms, NULL, NULL, NULL)" if version < 2 else
                    f"({', '.join('p.' + c for c in _FORM)})")  # fmt: skip
            counts = conn.execute(
                f"SELECT sum(CASE WHEN ({', '.join('m.' + c for c in _FORM)}) IS {form} THEN 1"
                f" WHEN (m.rid IS NULL) = ({p_rid} IS NULL) THEN 0 ELSE"
                " te_full(m.result, mt.template, m.elapsed_ms, m.e1, m.e2, m.e3) IS"
                f" te_full(p.result, {p_tpl}, p.elapsed_ms, {p_values}) END), count(*) FROM"
                " pk.probes p JOIN main.probes m"
                " ON m.config_key = p.config_key AND m.backend = p.backend AND m.ctx = p.ctx"
                f" LEFT JOIN main.templates mt ON mt.rid = m.rid{p_join}"
            ).fetchone()  # fmt: skip
            result.duplicates = int(counts[0] or 0)
            result.conflicts = int(counts[1] or 0) - result.duplicates
        reader.execute("BEGIN")
        copier = _Copier(conn, rule, version)
        copier.start()  # the quick_check first, then the copies, while this thread checks
        mid = _middle(reader, found.claimed) if split else None
        try:  # the configs first: the copier copies them while the rows are checked
            if mid is not None:
                helper = Helper.start({
                    "pack": str(pack), "lo": mid, "version": version, "ok": sql_ok,
                    "contexts": [[c, fp, vk] for c, (fp, vk) in ctxs.items()],
                    "templates": [[rid, ok, b.hex(), sup, stage.hex(), holes]
                                  for rid, (ok, (b, sup, stage, *_), holes) in
                                  found.templates.items()],
                }, copier.emit)  # fmt: skip
            copier.configs(check.configs(reader.execute(_verify_configs(version, found.bases))))
            if mid is None:
                check.rows(reader.execute(_scan(version, sql_ok)), ctxs, found.templates,
                           copier.emit)  # fmt: skip
            else:
                check.rows(reader.execute(_scan(version, sql_ok, "< ?"), (mid,)), ctxs,
                           found.templates, copier.emit, "", mid)  # fmt: skip
            if helper is not None:
                helper.join(check)
                helper = None
            if check.seen != found.claimed:  # the scans read every row
                raise PackError(f"the pack holds {check.seen} rows, its meta says"
                                f" {found.claimed}")  # fmt: skip
        except (sqlite3.DatabaseError, UnicodeDecodeError, PackError) as exc:  # checks' reads
            refused = copier.refusal()  # a damaged file: the integrity check says so first
            if refused is not None:
                raise refused from None
            if isinstance(exc, PackError):
                raise
            raise PackError(f"cannot read the pack: {_sqlite_problem(exc)}") from None
        copier.finish()
        copier = None
        passed = check.passed + _slow_rows(conn, rule, check, version)
        if version >= 2:  # the templates the validator accepts as they are, and the bases
            conn.executemany(_INSERT_TEMPLATE_MAIN, (
                t for t in conn.execute("SELECT * FROM pk.templates")
                if found.templates[t[0]][0]))  # fmt: skip
            conn.execute("INSERT OR IGNORE INTO main.bases SELECT * FROM pk.bases")
        _copy_configs(conn, check, version)
        after = conn.execute("SELECT count(*) FROM main.probes").fetchone()[0]
        if _change_counter(pack) != counter:
            raise PackError("the pack changed while it was read")
        conn.execute("COMMIT")
    except BaseException as exc:
        if helper is not None:
            helper.kill()
        if copier is not None:
            copier.abort()
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        if isinstance(exc, _READ_ERRORS) and not isinstance(exc, sqlite3.OperationalError):
            _whose_damage(conn, pack, exc)  # (a full disk, a lock, a read-only store: the store's)
        raise
    finally:
        with contextlib.suppress(sqlite3.Error):
            reader.close()
        with contextlib.suppress(sqlite3.Error):
            conn.execute("DETACH pk")
    result.written = int(after - before)  # new keys (a merge's replaced rows are not counted)
    result.skipped = max(0, passed - result.written)
    result.rejected = check.rejected + check.dropped
    return result


def _middle(reader: sqlite3.Connection, claimed: int) -> str | None:
    """The config key that splits the pack's rows in two halves, for a helper process to check
    the upper one; ``None`` for one process (a small pack, one CPU)."""
    if claimed < SPLIT_MIN_ROWS or _cpus() < 2:
        return None
    found = reader.execute("SELECT config_key FROM probes ORDER BY config_key, backend, ctx"
                           " LIMIT 1 OFFSET ?", (int(claimed * (1 - HELPER_SHARE)),)
                           ).fetchone()  # fmt: skip
    return found[0] if found and type(found[0]) is str and len(found[0]) == 64 else None


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _slow_rows(conn: sqlite3.Connection, rule: str, check: _Pass, version: int) -> int:
    """Rows the quick checks did not pass, through the full Python validator (which also
    cleans strings); returns how many passed."""
    compact = ("p.rid, p.elapsed_ms, p.e1, p.e2, p.e3, CAST(t.template AS BLOB)" if version >= 2
               else "NULL, NULL, NULL, NULL, NULL, NULL")  # fmt: skip
    join = " LEFT JOIN pk.templates t ON t.rid = p.rid" if version >= 2 else ""
    sql = ("SELECT p.config_key, p.backend, c.device_fp, c.versions_key, p.created_at,"
           f" p.package_version, p.crc, CAST(p.result AS BLOB), {compact} FROM pk.probes p"
           f" JOIN pk.contexts c ON c.ctx = p.ctx{join}"
           " WHERE p.config_key = ? AND p.backend = ? AND p.ctx = ?")  # fmt: skip
    rows: list[tuple[Any, ...]] = []
    for key in check.slow:
        found = conn.execute(sql, key).fetchone()
        if found is None:
            continue
        ck, backend, fp, vk, created, pkg, crc, data, rid, el, e1, e2, e3, template = found
        k = CacheKey(ck, backend, fp, vk)
        if rid is not None:
            if (type(template) is not bytes or text_id(template) != rid
                    or compact_crc(ck, backend, key[2], rid, el, e1, e2, e3) != crc):
                check.reject("checksum mismatch")
                continue
            data = expand(pieces(template), el, e1, e2, e3)
        elif row_crc_bytes(k, data) != crc:
            check.reject("checksum mismatch")
            continue
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError, TypeError):  # (UnicodeDecodeError is a ValueError)
            check.reject("result is not valid JSON")
            continue
        row = validate_row({"config_key": ck, "backend": backend, "device_fp": fp,
                            "versions_key": vk, "result": obj, "created_at": created,
                            "package_version": pkg})  # fmt: skip
        if isinstance(row, str):
            check.reject(row)
            continue
        check.seen += 1
        rows.append(row_params(row))
    if rows:
        params, templates = compact_params(rows)
        conn.executemany(_INSERT_TEMPLATE_MAIN,
                         templates)  # (made from the checked text: right whatever the pack said)
        conn.executemany(f"INSERT INTO main.probes ({_COLUMNS}) VALUES ({','.join('?' * 14)})"
                         + _CONFLICT[rule], params)  # fmt: skip
    return len(rows)


def _copy_configs(conn: sqlite3.Connection, check: _Pass, version: int) -> None:
    """The configs the quick test did not pass (the copier took the others), through the Python
    validator; a bad one is dropped (its rows stay) and counted."""
    sql = f"SELECT config, {'base' if version >= 2 else 'NULL'} FROM pk.configs WHERE config_key=?"
    for ck in check.slow_configs:
        text, base = conn.execute(sql, (ck,)).fetchone()
        try:
            checked: Any = validate_flat(json.loads(text), "config")
        except (ValueError, RecursionError, TypeError):
            checked = "not a JSON object"
        if not isinstance(checked, dict):
            check.dropped.append((0, f"config {str(ck)[:16]}: {checked} (dropped)"))
            continue
        conn.execute("INSERT INTO configs (config_key, config, base) VALUES (?, ?, ?) ON CONFLICT"
                     " DO NOTHING", (ck, dumps(checked), base))  # fmt: skip


def _run(store: ProbeCache, pack: str | os.PathLike[str], rule: str) -> PackResult:
    _files.open_regular(pack).close()  # missing, a FIFO, a device: an OSError now
    if not is_pack(pack):
        raise PackError(f"{os.fspath(pack)} is not a te_fl_attention pack")
    for split in (True, False):
        conn = _connect_store(store)
        try:
            return _copy_pack(conn, Path(pack), rule, split)
        except HelperFailed as exc:  # (rolled back: checked again in this process alone)
            log.info("import of %s: the checking helper failed (%s); checking in one process",
                     pack, exc)  # fmt: skip
        finally:
            conn.close()
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------- the checking helper
class HelperFailed(Exception):
    """The helper process could not check its half (the import is checked again without it)."""


class Helper:
    """A helper process (``python -m te_fl_attention.cache._pack_check``) checking the rows of
    the upper half of a pack's keys (:func:`helper_main`): its checked ranges reach ``emit`` from
    a thread of this process as they arrive over a pipe, its counts at :meth:`join`. It reads the
    pack on a read-only connection of its own, within the import's snapshot (the import holds its
    own read lock meanwhile, and the header's change counter is compared at the commit)."""

    def __init__(self, proc: subprocess.Popen[bytes], emit: Any, errors: Any) -> None:
        self.proc, self.emit, self.errors = proc, emit, errors
        self.done: dict[str, Any] | None = None
        self.failed: BaseException | None = None
        self.pump = threading.Thread(target=self._read, name="te-fl-attn-pack-helper",
                                     daemon=True)  # fmt: skip
        self.pump.start()

    @classmethod
    def start(cls, job: dict[str, Any], emit: Any) -> Helper:
        """Start the helper on ``job`` (the pack, its format, the lower bound of its half, the
        scan's SQL checks, the checked contexts and templates); :class:`HelperFailed` if it
        cannot start."""
        if not sys.executable:
            raise HelperFailed("no Python interpreter to start")
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p))  # fmt: skip
        errors = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "te_fl_attention.cache._pack_check"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env)
        except OSError as exc:
            errors.close()
            raise HelperFailed(f"cannot start it: {exc}") from None
        threading.Thread(target=_send, args=(proc.stdin, json.dumps(job).encode()),
                         name="te-fl-attn-pack-job", daemon=True).start()  # (over a pipe's size)
        return cls(proc, emit, errors)

    def _read(self) -> None:
        """Hand on each checked range as it arrives; read to the end whatever happens (the
        helper never blocks on a full pipe)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.failed is not None:
                continue
            try:
                msg = json.loads(line)
                if "r" in msg:
                    lo, hi, skip = msg["r"]
                    self.emit(lo, hi, [(bytes.fromhex(ck), bytes.fromhex(b), ctx)
                                       for ck, b, ctx in skip])  # fmt: skip
                elif "done" in msg:
                    self.done = msg["done"]
                elif "refused" in msg:
                    self.failed = PackError(str(msg["refused"]))
                elif "damaged" in msg:
                    self.failed = sqlite3.DatabaseError(str(msg["damaged"]))
            except BaseException as exc:  # (the copier's error, a garbled line: re-raised)
                self.failed = exc

    def join(self, check: _Pass) -> None:
        """Wait for the helper; add its counts to ``check`` (its rows numbered after this
        process's). Re-raises the pack's refusal it met; :class:`HelperFailed` otherwise."""
        self.pump.join()
        code = self.proc.wait()
        self.errors.seek(0)
        tail = self.errors.read()[-500:].decode(errors="replace").strip()
        self.errors.close()
        if self.failed is not None:  # the pack's refusal, its damage, or the copier's error
            raise self.failed
        done = self.done
        if code != 0 or not isinstance(done, dict):
            raise HelperFailed(f"exit status {code}: {tail or 'no output'}")
        base = check.seen
        check.rejected += [(base + int(n), str(reason)) for n, reason in done["rejected"]]
        check.slow += [(str(ck), str(b), int(ctx)) for ck, b, ctx in done["slow"]]
        check.seen += int(done["seen"])
        check.passed += int(done["passed"])

    def kill(self) -> None:
        """Stop the helper (the import failed) and wait for it."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.pump.join()
        self.errors.close()


def _send(pipe: Any, data: bytes) -> None:
    """Write ``data`` to the helper's stdin and close it (a helper that died: its exit status
    tells)."""
    with contextlib.suppress(OSError):
        with pipe:
            pipe.write(data)


def helper_main() -> None:
    """The helper process's work (:class:`Helper`): the job from stdin, the checks of the rows
    from its lower bound on, each checked range and then its counts as JSON lines on stdout."""
    job = json.loads(sys.stdin.buffer.read())
    out = sys.stdout

    def emit(lo: str, hi: str | None, skip: list[tuple[Any, ...]]) -> None:
        # (a key of another type than the copy takes is never copied: no need to name it)
        keys = [[ck.hex(), b.hex(), ctx] for ck, b, ctx in skip if type(ctx) is int]
        out.write(json.dumps({"r": [lo, hi, keys]}) + "\n")
        out.flush()

    check = _Pass()
    contexts = {int(c): (str(fp), str(vk)) for c, fp, vk in job["contexts"]}
    templates = {int(rid): (bool(ok), _shape(bytes.fromhex(b), int(sup), bytes.fromhex(stage),
                                             int(holes)), int(holes))
                 for rid, ok, b, sup, stage, holes in job["templates"]}  # fmt: skip
    reader = _connect_pack(Path(job["pack"]))
    try:
        reader.execute("BEGIN")
        check.rows(reader.execute(_scan(int(job["version"]), str(job["ok"]), ">= ?"),
                                  (str(job["lo"]),)), contexts, templates, emit, str(job["lo"]))
    except PackError as exc:
        out.write(json.dumps({"refused": str(exc)}) + "\n")
        return
    except _READ_ERRORS as exc:
        out.write(json.dumps({"damaged": _sqlite_problem(exc)}) + "\n")
        return
    finally:
        reader.close()
    out.write(json.dumps({"done": {"seen": check.seen, "passed": check.passed,
                                   "rejected": check.rejected, "slow": check.slow}}) + "\n")


def import_pack(cache: Any, path: str | os.PathLike[str]) -> ImportReport:
    """Import a pack into a store: never overwrites a stored row (as the JSON Lines import).

    Raises :class:`PackError` for a refused pack (nothing applied); a store that cannot be
    written (read-only, full disk) gives a report with every row ``not_written``.
    """
    store = getattr(cache, "local", cache)
    report = ImportReport()
    if not isinstance(store, ProbeCache):
        raise PackError("a pack can only be imported into an SQLite store")
    len(store)  # open (or create) the store with its checks
    if store.mode != "rw":
        report.problem = store.problem or "the store is read-only"
        report.not_written = _rows_in(path)
        return report
    try:
        done = _run(store, path, "ignore")
    except sqlite3.Error as exc:  # the store could not be written: nothing was
        report.problem = str(exc)
        report.not_written = _rows_in(path)
        return report
    report.imported, report.skipped, report.rejected = done.written, done.skipped, done.rejected
    if done.rejected:
        n, reason = done.rejected[0]
        log.warning("import of %s: %d row(s) rejected (first: row %d: %s)", path,
                    len(done.rejected), n, reason[:200])  # fmt: skip
    return report


def _whose_damage(conn: sqlite3.Connection, pack: Path, exc: Exception) -> None:
    """Damage met by a statement that reads the pack and writes the store: the pack's refusal
    (:class:`PackError`) unless the pack passes ``quick_check`` and the store fails its own, in
    which case the caller re-raises ``exc`` (the store's problem)."""
    check = sqlite3.connect(":memory:")
    try:
        check.execute("ATTACH ? AS pk", (f"file:{quote(str(pack))}?mode=ro",))
        _quick_check(check)
    except _READ_ERRORS as bad:
        raise PackError(f"cannot read the pack: {_sqlite_problem(bad)}") from None
    finally:
        check.close()
    try:
        store_ok = [str(r[0]) for r in conn.execute("PRAGMA main.quick_check(1)")] == ["ok"]
    except sqlite3.Error:
        store_ok = False
    if store_ok:
        raise PackError(f"cannot read the pack: {_sqlite_problem(exc)}") from None


def _sqlite_problem(exc: Exception) -> str:
    """What went wrong reading a pack. SQLite's message can quote the file's own schema text;
    when that text is not UTF-8, Python's sqlite3 raises :class:`UnicodeDecodeError` instead."""
    if isinstance(exc, UnicodeDecodeError):
        return "its schema is damaged (SQLite's message about it is not UTF-8 text)"
    return str(exc)


def _rows_in(path: str | os.PathLike[str]) -> int:
    """The row count a pack's meta claims (0 if unreadable): for a report of what was not
    written."""
    try:
        conn = sqlite3.connect(f"file:{quote(os.fspath(path))}?mode=ro", uri=True)
        try:
            value = conn.execute("SELECT value FROM meta WHERE name = 'rows'").fetchone()
        finally:
            conn.close()
        return int(value[0]) if value and str(value[0]).isdigit() else 0
    except _READ_ERRORS:
        return 0


def merge_pack(store: ProbeCache, path: str | os.PathLike[str]) -> PackResult:
    """Copy a pack's rows into a merge's store: the later ``created_at`` wins a conflict."""
    len(store)
    return _run(store, path, "newer")

"""What a compact row layout would give the pack import: measured, not built.

The pack import's limit on two cores is the checks' CPU (benchmarks/pack_import.md): every byte
of every result and config passes through them. This script measures the same rows in a layout
that stores each distinct result once: a ``templates`` table of result texts with their
``elapsed_ms`` values masked (as the import's verdict cache masks them), each row holding its
template id and the masked values (``e1``..``e3``: the variants' elapsed times; the top one is the
row's ``elapsed_ms`` column), and each config as its fields that differ from the defaults. A row
or config this layout cannot hold exactly keeps its full text (``fallback_rows``).

Timed in the same run, for the current pack and the compact one: SQLite copying the rows into a
fresh store of the same layout with no check (its commit and WAL fold included), and the checks
an import of it needs (current: the real import's check pass; compact: SQL column checks, the
key's digits and a checksum per row in Python, the validator once per template, the config byte
tests on the compact configs). ``bound_per_s`` is what an import could reach on two cores with
the copy and the checks overlapped perfectly: rows / max(checks, copy, their sum / 2).
``compact_vs_current`` sets the two bounds side by side. Prints one line.

    python benchmarks/bench_compact_layout.py --n 200000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache_scale import _bare_copy, _rows, timed_copy  # noqa: E402

from te_fl_attention.cache import ProbeCache  # noqa: E402
from te_fl_attention.cache import pack as P  # noqa: E402
from te_fl_attention.cache._lifecycle import PAGE_SIZE  # noqa: E402
from te_fl_attention.cache.keys import CacheKey  # noqa: E402
from te_fl_attention.config import FusedAttnConfig  # noqa: E402

_PREFIX = len(b'"elapsed_ms":')
HOLES = ("e1", "e2", "e3")
COMPACT_SCHEMA = (
    "CREATE TABLE templates (rid INTEGER PRIMARY KEY, backend TEXT NOT NULL, template TEXT NOT"
    " NULL)",
    "CREATE TABLE contexts (ctx INTEGER PRIMARY KEY, device_fp TEXT NOT NULL, versions_key TEXT"
    " NOT NULL, device TEXT)",
    "CREATE TABLE configs (config_key TEXT PRIMARY KEY, diff TEXT, full TEXT) WITHOUT ROWID",
    "CREATE TABLE probes (config_key TEXT NOT NULL, backend TEXT NOT NULL, ctx INTEGER NOT NULL,"
    " supported INTEGER NOT NULL, stage TEXT NOT NULL, elapsed_ms REAL NOT NULL, created_at REAL"
    " NOT NULL, package_version TEXT NOT NULL, crc INTEGER NOT NULL, rid INTEGER, e1 REAL,"
    " e2 REAL, e3 REAL, result TEXT, PRIMARY KEY (config_key, backend, ctx)) WITHOUT ROWID",
)


def _values(data: bytes) -> list[str]:
    """The ``elapsed_ms`` values the import's verdict cache masks in a result's text, in order."""
    return [m[0][_PREFIX:].decode() for m in P._ELAPSED.finditer(data)]


def _expand(template: bytes, values: list[str]) -> bytes:
    """A result's text from its template and its ``elapsed_ms`` values, in order."""
    rest = iter(values)
    return re.sub(rb'"elapsed_ms":0(?=[,}])', lambda m: b'"elapsed_ms":' + next(rest).encode(),
                  template)  # fmt: skip


def _compact(pack: Path, out: Path) -> tuple[int, int]:
    """Write the pack's rows in the compact layout, each checked to give back its exact text;
    (templates, rows kept in full)."""
    src = sqlite3.connect(f"file:{pack}?mode=ro", uri=True)
    dst = sqlite3.connect(out)
    dst.execute(f"PRAGMA page_size={PAGE_SIZE}")
    for ddl in COMPACT_SCHEMA:
        dst.execute(ddl)
    dst.executemany("INSERT INTO contexts VALUES (?,?,?,?)", src.execute("SELECT * FROM contexts"))
    templates: dict[tuple[str, bytes], int] = {}
    rows, full = [], 0
    for *head, result in src.execute("SELECT * FROM probes ORDER BY config_key, backend, ctx"):
        data = result.encode()
        values = _values(data)
        top_ok = values and float(values[0]) == head[5]
        if not top_ok or len(values) > 1 + len(HOLES) or any(repr(float(v)) != v for v in values):
            rows.append((*head, None, None, None, None, result))  # kept in full
            full += 1
            continue
        masked = P._ELAPSED.sub(b'"elapsed_ms":0', data)
        if _expand(masked, values) != data:  # the layout must give back every byte
            raise SystemExit(f"row {head[:2]} does not round-trip")
        rid = templates.setdefault((head[1], masked), len(templates) + 1)
        holes = [float(v) for v in values[1:]] + [None] * (len(HOLES) + 1 - len(values))
        rows.append((*head, rid, *holes, None))
    dst.executemany("INSERT INTO templates VALUES (?,?,?)",
                    [(rid, b, t.decode()) for (b, t), rid in templates.items()])  # fmt: skip
    dst.executemany(f"INSERT INTO probes VALUES ({','.join('?' * 14)})", rows)
    defaults = FusedAttnConfig().to_dict()
    configs = []
    for ck, text in src.execute("SELECT config_key, config FROM configs"):
        config = json.loads(text)
        diff = {k: v for k, v in config.items() if defaults.get(k) != v}
        if any(v is None for v in diff.values()) or list(config) != list(defaults):
            configs.append((ck, None, text))  # a null, or other fields: kept in full
            continue
        if json.dumps({**defaults, **diff}, separators=(",", ":")) != text:
            raise SystemExit(f"config {ck} does not round-trip")
        configs.append((ck, json.dumps(diff, separators=(",", ":")), None))
    dst.executemany("INSERT INTO configs VALUES (?,?,?)", configs)
    dst.commit()
    dst.close()
    src.close()
    return len(templates), full


def _compact_copy(pack: Path, path: Path) -> float:
    """Seconds SQLite takes to copy the compact pack into a fresh compact store (as
    :func:`bench_cache_scale._bare_copy`: one transaction, its commit folding the WAL)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        conn.execute("PRAGMA journal_mode=WAL")
        for ddl in COMPACT_SCHEMA:
            conn.execute(ddl)
    finally:
        conn.close()
    return timed_copy(pack, path, ("templates", "contexts", "probes", "configs"))


def _current_checks(pack: Path) -> float:
    """Seconds the import's own check pass takes over the current pack (configs, then rows)."""
    conn = sqlite3.connect(":memory:")
    conn.execute("ATTACH ? AS pk", (f"file:{pack}?mode=ro",))
    ctxs, _, _ = P._check_pack(conn)
    reader = P._connect_pack(pack)
    check = P._Pass()
    sql_ok = P._rows_where(ctxs)
    t0 = time.perf_counter()
    check.configs(reader.execute(P._VERIFY_CONFIGS.format(ok=P._qualified(P.CONFIG_WHERE, "g"))))
    check.rows(reader.execute(P._VERIFY_ROWS.format(ok=sql_ok)), ctxs, lambda *a: None)
    took = time.perf_counter() - t0
    if check.rejected or check.slow:
        raise SystemExit(f"current checks refused rows: {check.rejected[:1]}")
    return took


def _compact_checks(pack: Path) -> float:
    """Seconds the checks of a compact pack would take: SQL column checks of every row (the
    import's, less the result's, plus the holes' types and ranges and a known template), the key's
    digits once per config and a checksum per row in Python, the validator once per template, the
    config byte tests of the compact configs."""
    reader = sqlite3.connect(f"file:{pack}?mode=ro", uri=True)
    key = CacheKey("0" * 64, "", "0" * 64, "0" * 64)
    holes = " AND ".join(f"(p.{e} IS NULL OR (typeof(p.{e}) = 'real' AND p.{e} BETWEEN 0 AND"
                         f" {P.MAX_ELAPSED_MS:.0f}))" for e in HOLES)  # fmt: skip
    row_sql = {k: v for k, v in P.ROW_WHERE.items() if k != "result"}
    latest = time.time() + P.MAX_CLOCK_SKEW_S
    ok = (
        f"{P._qualified(row_sql, 'p')} AND {holes} AND p.created_at <= {latest!r}"
        " AND (p.rid IN (SELECT rid FROM templates) OR (p.rid IS NULL AND p.result IS NOT NULL))"
    )
    t0 = time.perf_counter()
    for backend, text in reader.execute("SELECT backend, CAST(template AS BLOB) FROM templates"):
        if P._verdict(key._replace(backend=backend), text) is False:
            raise SystemExit("a template fails the validator")
    bad, last, pack_row = 0, None, struct.Struct("<qddd").pack
    crc32, hexdigits = zlib.crc32, P._HEX_BYTES
    scan = ("SELECT CAST(p.config_key AS BLOB), p.rid, p.e1, p.e2, p.e3, p.crc, CASE WHEN"
            f" {ok} THEN 1 ELSE 0 END FROM probes p ORDER BY p.config_key, p.backend, p.ctx")
    for ck, rid, e1, e2, e3, crc, good in reader.execute(scan):
        if ck != last:
            last, key_ok = ck, len(ck) == 64 and not ck.strip(hexdigits)
        crc32(pack_row(rid or 0, e1 or 0.0, e2 or 0.0, e3 or 0.0), crc32(ck))  # (its cost)
        bad += not (good and key_ok and crc is not None)
    check = P._Pass()
    text = "coalesce(g.diff, g.full)"
    check.configs(reader.execute(
        f"SELECT CAST(g.config_key AS BLOB), CASE WHEN json_valid({text}) AND json_type({text})"
        f" = 'object' THEN 1 ELSE 0 END, CAST({text} AS BLOB) FROM configs g ORDER BY 1"))
    took = time.perf_counter() - t0
    if bad or check.dropped:
        raise SystemExit(f"compact checks refused {bad} rows, {len(check.dropped)} configs")
    return took


def _bound(rows: int, checks_s: float, copy_s: float) -> float:
    """Rows/s with the checks and the copy overlapped perfectly on two cores."""
    return rows / max(checks_s, copy_s, (checks_s + copy_s) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="entries (default 200,000)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-compact-", dir=args.dir)
    root = Path(tmp.name)
    store = ProbeCache(root / "store.sqlite")
    for batch in _rows(args.n, 0, []):
        store.put_many(batch, checked=True)
    store.checkpoint()
    pack, compact = root / "rows.pack", root / "rows-compact.sqlite"
    P.export_pack(store, pack)
    store.close()
    templates, full = _compact(pack, compact)
    copy_s = _bare_copy(pack, root / "floor.sqlite")
    compact_copy_s = _compact_copy(compact, root / "floor-compact.sqlite")
    checks_s = _current_checks(pack)
    compact_checks_s = _compact_checks(compact)
    n = args.n
    bound, compact_bound = _bound(n, checks_s, copy_s), _bound(n, compact_checks_s, compact_copy_s)
    print(f"compact_layout n={n} bytes_per_row={os.path.getsize(pack) / n:.0f} "
          f"compact_bytes_per_row={os.path.getsize(compact) / n:.0f} templates={templates} "
          f"fallback_rows={full} floor_per_s={n / copy_s:.0f} "
          f"compact_floor_per_s={n / compact_copy_s:.0f} checks_s={checks_s:.3f} "
          f"compact_checks_s={compact_checks_s:.3f} bound_per_s={bound:.0f} "
          f"compact_bound_per_s={compact_bound:.0f} compact_vs_current={compact_bound / bound:.2f} "
          "(an estimate for a layout not built; target of the pack import: 250000/s)")  # fmt: skip
    tmp.cleanup()


if __name__ == "__main__":
    main()

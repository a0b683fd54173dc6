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
``compact_vs_current`` sets the two bounds side by side. Then a prototype import of the compact
pack (:func:`_compact_import`: the shipped import's pipeline and copier thread with the checks a
built one would need) is timed against the shipped import of the current pack, alternated
``--rounds`` times: ``compact_import_per_s`` and ``import_pack_per_s`` (medians), and
``compact_split_import_per_s``: the prototype with the row checks shared with a helper process
(the two cores' whole use: the checks on two, the copy beside them). Also timed: the rewrite of
every row into the compact layout (``migrate_per_s``: what a migration of a store would do, each
row's round trip checked), and reading each row's result text with its checksum checked
(``read_us_per_row`` today, ``compact_read_us_per_row`` rebuilt from its template). Prints one
line.

    python benchmarks/bench_compact_layout.py --n 200000
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache_scale import _bare_copy, _rows, timed_copy  # noqa: E402

from te_fl_attention.cache import ProbeCache  # noqa: E402
from te_fl_attention.cache import pack as P  # noqa: E402
from te_fl_attention.cache._lifecycle import PAGE_SIZE  # noqa: E402
from te_fl_attention.cache.keys import CacheKey, known_backends  # noqa: E402
from te_fl_attention.cache.rows import crc_head, crc_tail, row_crc_bytes  # noqa: E402
from te_fl_attention.config import FusedAttnConfig  # noqa: E402

_PREFIX = len(b'"elapsed_ms":')
_HOLE = re.compile(rb'"elapsed_ms":0(?=[,}])')  # a masked value in a template
HOLES = ("e1", "e2", "e3")
COMPACT_SCHEMA = (
    "CREATE TABLE templates (rid INTEGER PRIMARY KEY, backend TEXT NOT NULL, supported INTEGER NOT"
    " NULL, stage TEXT NOT NULL, template TEXT NOT NULL)",
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
    return _HOLE.sub(lambda m: b'"elapsed_ms":' + next(rest).encode(), template)


def _compact(pack: Path, out: Path) -> tuple[int, int]:
    """Write the pack's rows in the compact layout, each checked to give back its exact text;
    (templates, rows kept in full)."""
    src = sqlite3.connect(f"file:{pack}?mode=ro", uri=True)
    dst = sqlite3.connect(out)
    dst.execute(f"PRAGMA page_size={PAGE_SIZE}")
    for ddl in COMPACT_SCHEMA:
        dst.execute(ddl)
    contexts = src.execute("SELECT * FROM contexts").fetchall()
    dst.executemany("INSERT INTO contexts VALUES (?,?,?,?)", contexts)
    tails = {(ctx, b): crc_tail(b, fp, vk) for ctx, fp, vk, _ in contexts for b in known_backends()}
    templates: dict[tuple[str, int, str, bytes], int] = {}
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
        rid = templates.setdefault((head[1], head[3], head[4], masked), len(templates) + 1)
        holes = [float(v) for v in values[1:]] + [None] * (len(HOLES) + 1 - len(values))
        head[8] = _crc(head[0], tails[head[2], head[1]], rid, head[5], holes)
        rows.append((*head, rid, *holes, None))
    dst.executemany("INSERT INTO templates VALUES (?,?,?,?,?)", [
        (rid, b, sup, stage, t.decode()) for (b, sup, stage, t), rid in templates.items()])
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


def _fresh_compact(path: Path) -> None:
    """An empty store of the compact layout at ``path`` (the store's page size and journal)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for ddl in COMPACT_SCHEMA:
            conn.execute(ddl)
    finally:
        conn.close()


def _compact_copy(pack: Path, path: Path) -> float:
    """Seconds SQLite takes to copy the compact pack into a fresh compact store (as
    :func:`bench_cache_scale._bare_copy`: one transaction, its commit folding the WAL)."""
    _fresh_compact(path)
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


_NUMBERS = struct.Struct("<qdddd").pack


def _crc(ck: str, tail: bytes, rid: int, elapsed: float, holes: list[float | None]) -> int:
    """A compact row's checksum: its key (as today's, :func:`.rows.crc_head` and ``crc_tail``),
    then its template id and elapsed times packed (a checksum must cover the compact columns)."""
    e1, e2, e3 = (h or 0.0 for h in holes)
    head = zlib.crc32(tail, zlib.crc32(crc_head(ck)))
    return zlib.crc32(_NUMBERS(rid, elapsed, e1, e2, e3), head)


def _compact_pass(reader: sqlite3.Connection, emit: Any) -> None:
    """The checks an import of a compact pack needs, over ``reader`` (the pack): the templates'
    and configs' (:func:`_whole_checks`), then every row's (:func:`_row_checks`)."""
    _whole_checks(reader)
    _row_checks(reader, emit)


def _whole_checks(reader: sqlite3.Connection) -> None:
    """The validator once per template (its backend, ``supported`` and ``stage`` columns must
    agree), the config byte tests of the compact configs."""
    key = CacheKey("0" * 64, "", "0" * 64, "0" * 64)
    for rid, backend, supported, stage, text in reader.execute(
            "SELECT rid, backend, supported, CAST(stage AS BLOB), CAST(template AS BLOB)"
            " FROM templates"):  # fmt: skip
        if P._verdict(key._replace(backend=backend), text) != (supported, stage):
            raise SystemExit(f"template {rid} fails the validator")
    check = P._Pass()
    text = "coalesce(g.diff, g.full)"
    check.configs(reader.execute(
        f"SELECT CAST(g.config_key AS BLOB), CASE WHEN json_valid({text}) AND json_type({text})"
        f" = 'object' THEN 1 ELSE 0 END, CAST({text} AS BLOB) FROM configs g ORDER BY 1"))
    if check.dropped:
        raise SystemExit(f"compact checks refused {len(check.dropped)} configs")


def _row_checks(reader: sqlite3.Connection, emit: Any, lo: str = "", hi: str | None = None) -> None:
    """Every row with a key in [``lo``, ``hi``), in key order: SQL column checks (the import's,
    less the result's, plus the holes' types and ranges and a template of the row's backend,
    support and stage), in Python the key's digits once per config and the checksum. Hands each
    checked range of keys to ``emit(lo, hi, skip)`` as the shipped import does, ``skip`` naming
    the keys refused (a row kept in full is refused too: a prototype)."""
    contexts = {ctx: (fp, vk) for ctx, fp, vk in reader.execute(
        "SELECT ctx, device_fp, versions_key FROM contexts")}  # fmt: skip
    holes = " AND ".join(f"(p.{e} IS NULL OR (typeof(p.{e}) = 'real' AND p.{e} BETWEEN 0 AND"
                         f" {P.MAX_ELAPSED_MS:.0f}))" for e in HOLES)  # fmt: skip
    row_sql = {k: v for k, v in P.ROW_WHERE.items() if k != "result"}
    ok = (
        f"{P._qualified(row_sql, 'p')} AND {holes}"
        f" AND p.created_at <= {time.time() + P.MAX_CLOCK_SKEW_S!r}"
        f" AND p.ctx IN ({','.join(map(str, contexts))}) AND EXISTS (SELECT 1 FROM templates t"
        " WHERE t.rid = p.rid AND t.backend = p.backend AND t.supported = p.supported"
        " AND t.stage = p.stage)"
    )
    scan = ("SELECT CAST(p.config_key AS BLOB), CAST(p.backend AS BLOB), p.ctx, p.rid,"
            " p.elapsed_ms, p.e1, p.e2, p.e3, p.crc, CASE WHEN"
            f" {ok} THEN 1 ELSE 0 END FROM probes p WHERE p.config_key >= ?"
            f"{'' if hi is None else ' AND p.config_key < ?'}"
            " ORDER BY p.config_key, p.backend, p.ctx")
    last, last_ok, ck_crc, n, skip = None, False, 0, 0, []
    tails: dict[Any, bytes] = {}
    numbers, crc32, hexdigits = _NUMBERS, zlib.crc32, P._HEX_BYTES
    bounds = (lo,) if hi is None else (lo, hi)
    for ck, backend, ctx, rid, elapsed, e1, e2, e3, crc, good in reader.execute(scan, bounds):
        if ck != last:
            last_ok = len(ck) == 64 and not ck.strip(hexdigits)
            if n >= P.CHUNK_ROWS:
                emit(lo, ck.decode(), skip)
                lo, n, skip = ck.decode(), 0, []
            last, ck_crc = ck, crc32(crc_head(ck.decode()))
        n += 1
        if good and last_ok:  # (:func:`_crc`, its head once per config, its tail once per context)
            tail = tails.get((ctx, backend))
            if tail is None:
                tail = tails[ctx, backend] = crc_tail(backend.decode(), *contexts[ctx])
            if crc32(numbers(rid, elapsed, e1 or 0.0, e2 or 0.0, e3 or 0.0),
                     crc32(tail, ck_crc)) == crc:  # fmt: skip
                continue
        skip.append((ck, backend, ctx))
    emit(lo, hi, skip)


def _compact_checks(pack: Path) -> float:
    """Seconds :func:`_compact_pass` takes over the compact pack, with nothing copied."""
    reader = sqlite3.connect(f"file:{pack}?mode=ro", uri=True)
    refused: list[Any] = []
    t0 = time.perf_counter()
    _compact_pass(reader, lambda lo, hi, skip: refused.extend(skip))
    took = time.perf_counter() - t0
    reader.close()
    if refused:
        raise SystemExit(f"compact checks refused {len(refused)} rows")
    return took


_C_COLUMNS = ("config_key, backend, ctx, supported, stage, elapsed_ms, created_at, package_version,"
              " crc, rid, e1, e2, e3, result")  # fmt: skip


def _compact_import(pack: Path, path: Path, split: bool = False) -> float:
    """Seconds an import of the compact pack into a fresh compact store takes, pipelined as the
    shipped import is: :func:`_compact_pass` on this thread, the shipped import's copier thread
    (``quick_check`` first, then one ``INSERT ... SELECT`` per checked range of keys, less the keys
    the checks named) on the store's connection, then the templates and configs, one commit that
    folds the WAL. ``split``: the row checks shared with a helper process (:func:`_split_checks`).
    A prototype: the pack's schema, meta and contexts are not checked and no row is kept in full
    (the benchmark's rows need none), so a built import would take a little longer."""
    _fresh_compact(path)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA cache_size=-65536")
    conn.execute("ATTACH ? AS pk", (f"file:{pack}?mode=ro",))
    for ddl in P._SKIP_DDL:
        conn.execute(ddl)
    reader = P._connect_pack(pack)
    p_columns = ", ".join(f"p.{c.strip()}" for c in _C_COLUMNS.split(","))
    copy = P._RANGE.replace(P._P_COLUMNS, p_columns).replace(P._COLUMNS, _C_COLUMNS)
    try:
        t0 = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO main.contexts SELECT * FROM pk.contexts")
        reader.execute("BEGIN")
        copier = P._Copier(conn, "ignore")
        copier.sql = tuple(copy.format(hi=hi) + P._CONFLICT["ignore"]
                           for hi in (" AND p.config_key < ?", ""))  # fmt: skip
        copier.start()
        try:
            if split:
                _split_checks(pack, reader, copier.emit)
            else:
                _compact_pass(reader, copier.emit)
        except BaseException:
            copier.abort()  # (its thread stops: nothing is left waiting on its queue)
            raise
        copier.finish()
        conn.execute("INSERT INTO main.templates SELECT * FROM pk.templates")
        conn.execute("INSERT INTO main.configs SELECT * FROM pk.configs")
        conn.execute("COMMIT")
        took = time.perf_counter() - t0
        copied = conn.execute("SELECT count(*) FROM main.probes").fetchone()[0]
        claimed = reader.execute("SELECT count(*) FROM probes").fetchone()[0]
    finally:
        reader.close()
        conn.close()
    if copied != claimed:
        raise SystemExit(f"the compact import copied {copied} of {claimed} rows")
    return took


def _split_checks(pack: Path, reader: sqlite3.Connection, emit: Any) -> None:
    """The row checks of the upper half of the configs' keys in a helper process (this script
    with ``--check-rows``, started first: it takes a fraction of a second to import), its ranges
    handed to ``emit`` by a thread as they arrive, while this thread checks the templates, the
    configs and the lower half. (A built import would also have to hold the helper to the same
    snapshot of the pack.)"""
    total = reader.execute("SELECT count(*) FROM configs").fetchone()[0]
    found = reader.execute("SELECT config_key FROM configs ORDER BY config_key LIMIT 1 OFFSET ?",
                           (total // 2,)).fetchone()  # fmt: skip
    if found is None:
        _compact_pass(reader, emit)
        return
    mid = str(found[0])
    helper = subprocess.Popen([sys.executable, __file__, "--check-rows", str(pack), mid],
                              stdout=subprocess.PIPE)  # fmt: skip

    failed: list[BaseException] = []

    def pump() -> None:  # (reads to the end whatever happens: the helper never blocks on a pipe)
        assert helper.stdout is not None
        for line in helper.stdout:
            if failed:
                continue
            try:
                lo, hi, skip = json.loads(line)
                emit(lo, hi, [(bytes.fromhex(ck), b.encode(), ctx) for ck, b, ctx in skip])
            except BaseException as exc:  # (the copier's error: re-raised below)
                failed.append(exc)

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    try:
        _whole_checks(reader)
        _row_checks(reader, emit, "", mid)
    finally:
        pumper.join()
        if helper.wait() != 0:
            raise SystemExit(f"the row-checking helper failed ({helper.returncode})")
    if failed:
        raise failed[0]


def _check_rows_helper(pack: str, lo: str) -> None:
    """``--check-rows``: :func:`_row_checks` from ``lo`` on, each range one JSON line on stdout."""
    reader = P._connect_pack(Path(pack))

    def emit(lo: str, hi: str | None, skip: list[tuple[bytes, bytes, int]]) -> None:
        out = [(ck.hex(), b.decode(), ctx) for ck, b, ctx in skip]
        sys.stdout.write(json.dumps((lo, hi, out)) + "\n")
        sys.stdout.flush()

    _row_checks(reader, emit, lo)



def _reads(pack: Path, compact: Path) -> tuple[float, float]:
    """Microseconds per row to read every row's result text with its checksum checked, as the
    store's decode does before it parses the text: today the stored text; compact the row's
    template (split at its holes once) filled with its elapsed times, after the compact checksum.
    The parse that follows reads the same text in both. Every rebuilt text is compared with
    today's, untimed."""
    scan = ("SELECT p.config_key, p.backend, c.device_fp, c.versions_key, p.crc, {cols} FROM"
            " probes p JOIN contexts c ON c.ctx = p.ctx ORDER BY p.config_key, p.backend, p.ctx")
    conn = sqlite3.connect(f"file:{pack}?mode=ro", uri=True)
    t0 = time.perf_counter()
    texts = []
    for ck, b, fp, vk, crc, data in conn.execute(scan.format(cols="CAST(p.result AS BLOB)")):
        if row_crc_bytes(CacheKey(ck, b, fp, vk), data) != crc:
            raise SystemExit("a stored row fails its checksum")
        texts.append(data)
    today = time.perf_counter() - t0
    conn.close()
    conn = sqlite3.connect(f"file:{compact}?mode=ro", uri=True)
    glue = b'"elapsed_ms":'
    parts = {}  # template id -> its text cut after each hole's name
    for rid, text in conn.execute("SELECT rid, CAST(template AS BLOB) FROM templates"):
        cut = _HOLE.split(text)
        parts[rid] = [piece + glue for piece in cut[:-1]] + cut[-1:]
    t0 = time.perf_counter()
    rebuilt = []
    for ck, b, fp, vk, crc, rid, *times in conn.execute(
            scan.format(cols="p.rid, p.elapsed_ms, p.e1, p.e2, p.e3")):  # fmt: skip
        if _crc(ck, crc_tail(b, fp, vk), rid, times[0], times[1:]) != crc:
            raise SystemExit("a compact row fails its checksum")
        pieces = parts[rid]
        out = [pieces[0]]
        for value, piece in zip(times, pieces[1:], strict=False):  # (times past the holes: None)
            out += (repr(value).encode(), piece)
        rebuilt.append(b"".join(out))
    compact_s = time.perf_counter() - t0
    conn.close()
    if rebuilt != texts:
        raise SystemExit("a rebuilt text differs from the stored one")
    return today * 1e6 / len(texts), compact_s * 1e6 / len(texts)


def _current_import(pack: Path, path: Path) -> float:
    """Seconds the shipped import takes to import the current pack into a fresh store."""
    store = ProbeCache(path)
    try:
        len(store)
        t0 = time.perf_counter()
        report = P.import_pack(store, pack)
        took = time.perf_counter() - t0
    finally:
        store.close()
    if report.rejected or report.problem:
        raise SystemExit(f"the import refused rows: {report.rejected[:1]} {report.problem}")
    return took


def _bound(rows: int, checks_s: float, copy_s: float) -> float:
    """Rows/s with the checks and the copy overlapped perfectly on two cores."""
    return rows / max(checks_s, copy_s, (checks_s + copy_s) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="entries (default 200,000)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="imports of each layout, alternated (medians printed; default 3)")
    ap.add_argument("--check-rows", nargs=2, help=argparse.SUPPRESS)  # (the split's helper)
    args = ap.parse_args()
    if args.check_rows:
        _check_rows_helper(*args.check_rows)
        return
    tmp = tempfile.TemporaryDirectory(prefix="bench-compact-", dir=args.dir)
    root = Path(tmp.name)
    store = ProbeCache(root / "store.sqlite")
    for batch in _rows(args.n, 0, []):
        store.put_many(batch, checked=True)
    store.checkpoint()
    pack, compact = root / "rows.pack", root / "rows-compact.sqlite"
    P.export_pack(store, pack)
    store.close()
    t0 = time.perf_counter()
    templates, full = _compact(pack, compact)
    migrate_s = time.perf_counter() - t0
    read_us, compact_read_us = _reads(pack, compact)
    copy_s = _bare_copy(pack, root / "floor.sqlite")
    compact_copy_s = _compact_copy(compact, root / "floor-compact.sqlite")
    checks_s = _current_checks(pack)
    compact_checks_s = _compact_checks(compact)
    runs: dict[str, tuple[Any, Path]] = {
        "current": (_current_import, pack), "compact": (_compact_import, compact),
        "split": (functools.partial(_compact_import, split=True), compact)}  # fmt: skip
    imports: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(max(1, args.rounds)):  # alternated: this machine's speed drifts
        for name, (run, src) in runs.items():
            dest = root / f"{name}{i}.sqlite"
            imports[name].append(run(src, dest))
            for suffix in ("", "-wal", "-shm"):
                Path(f"{dest}{suffix}").unlink(missing_ok=True)
    import_s, compact_import_s, split_s = (statistics.median(t) for t in imports.values())
    n = args.n
    bound, compact_bound = _bound(n, checks_s, copy_s), _bound(n, compact_checks_s, compact_copy_s)
    print(f"compact_layout n={n} bytes_per_row={os.path.getsize(pack) / n:.0f} "
          f"compact_bytes_per_row={os.path.getsize(compact) / n:.0f} templates={templates} "
          f"fallback_rows={full} floor_per_s={n / copy_s:.0f} "
          f"compact_floor_per_s={n / compact_copy_s:.0f} checks_s={checks_s:.3f} "
          f"compact_checks_s={compact_checks_s:.3f} bound_per_s={bound:.0f} "
          f"compact_bound_per_s={compact_bound:.0f} compact_vs_current={compact_bound / bound:.2f} "
          f"import_pack_per_s={n / import_s:.0f} compact_import_per_s={n / compact_import_s:.0f} "
          f"compact_import_vs_current={import_s / compact_import_s:.2f} "
          f"compact_split_import_per_s={n / split_s:.0f} migrate_per_s={n / migrate_s:.0f} "
          f"read_us_per_row={read_us:.2f} compact_read_us_per_row={compact_read_us:.2f} "
          "(a layout not built, its import a prototype; pack import target: 250000/s)")  # fmt: skip
    tmp.cleanup()


if __name__ == "__main__":
    main()

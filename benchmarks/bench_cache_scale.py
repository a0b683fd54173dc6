"""Probe-cache scale benchmark: lookups, import rate and size with N stored results.

Builds a store of ``--n`` realistic rows (4 backends per config, flash with its 3 flavours, one
config and device JSON per row), then measures 10k random ``get`` latencies, the import rate of
a full export into a fresh store, the import rate of an SQLite pack of the same rows
(``export --format sqlite``) into a fresh store (``import_pack_per_s``: until the import returned,
its rows committed to the WAL; ``import_pack_with_fold_per_s`` adds the store's last close, which
folds that WAL into the main file), the same rows copied by SQLite with no check at all
(``sql_copy_floor_per_s``: the floor a checked pack import sits above, its commit folding the
WAL; ``pack_vs_floor`` sets it against the import with its fold), how many times faster the pack
import is than the JSON Lines import of the same rows (``pack_vs_jsonl``), and the file size per
entry. Prints one line.

    python benchmarks/bench_cache_scale.py --n 200000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_fl_attention.cache import CacheKey, ProbeCache, export, import_  # noqa: E402
from te_fl_attention.cache.keys import versions_key  # noqa: E402
from te_fl_attention.cache.pack import export_pack  # noqa: E402
from te_fl_attention.cache.rows import CacheRow, make_row  # noqa: E402
from te_fl_attention.config import FusedAttnConfig  # noqa: E402
from te_fl_attention.device import profile  # noqa: E402
from te_fl_attention.reasons import ProbeResult, Reason  # noqa: E402

BATCH = 50_000


def _results(rng: random.Random) -> list[ProbeResult]:
    """One config's four results, shaped like real probe output."""
    ms = lambda: round(rng.uniform(0.01, 40.0), 4)  # noqa: E731
    if rng.random() < 0.7:
        fused = ProbeResult("fused", True, stage="run", evidence="cudnn 9.28.1 graph",
                            elapsed_ms=ms(), detail={"sub_backend": 1})  # fmt: skip
    else:
        fused = ProbeResult("fused", False, (Reason(
            "cudnn.no_engine", "cuDNN has no engine for this graph", "graph_build",
            observed=rng.randrange(1, 512), limit=256, hint="try head_dim <= 256"),),
            stage="graph_build", evidence="cudnn 9.28.1 graph", elapsed_ms=ms())  # fmt: skip
    fa4 = Reason("not_installed", "flash-attn-4 is not installed", "import")
    flash = ProbeResult("flash", True, detail={"variant": "fa2"}, elapsed_ms=ms(), variants=(
        ProbeResult("fa2", True, evidence="flash-attn 2.8.3", elapsed_ms=ms()),
        ProbeResult("fa3", False, (Reason("sm.unsupported", "FlashAttention 3 needs sm90",
                                          observed=80, limit=[90, 90]),)),
        ProbeResult("fa4", False, (fa4,), stage="import"),
    ))  # fmt: skip
    triton = ProbeResult("triton", rng.random() < 0.5, elapsed_ms=ms())
    unfused = ProbeResult("unfused", True, elapsed_ms=ms())
    return [fused, flash, triton, unfused]


def _rows(n: int, seed: int, out_keys: list[CacheKey]) -> Iterator[list[CacheRow]]:
    """Batches of rows, generated lazily; appends every key to ``out_keys``."""
    rng = random.Random(seed)
    device = profile("h100")
    dev = device.to_dict()
    fp, vk = device.fingerprint(), versions_key(device)
    base = FusedAttnConfig().to_dict()
    batch: list[CacheRow] = []
    now = time.time()
    for c in range(0, n, 4):
        cfg = dict(base, batch_size=rng.choice((1, 2, 4, 8, 16)), max_seqlen_q=128 * (c % 97 + 1),
                   num_heads=rng.choice((8, 16, 32, 64)), head_dim_qk=rng.choice((64, 128, 256)),
                   dropout=round(rng.random() * 0.2, 3), num_splits=c // 97 + 1)  # fmt: skip
        ck = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
        for r in _results(rng)[: n - c]:
            k = CacheKey(ck, r.backend, fp, vk)
            out_keys.append(k)
            batch.append(make_row(k, r, cfg, dev, created_at=now - rng.uniform(0, 86400 * 60)))
            if len(batch) >= BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _count(path: Path) -> int:
    """Rows in a store, read back with a connection of its own."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM probes").fetchone()[0])
    finally:
        conn.close()


def _bare_copy(pack: Path, path: Path) -> float:
    """Seconds SQLite takes to copy the pack's rows into a fresh store with no check at all (one
    ``INSERT ... SELECT``, one transaction): the floor any checked pack import sits above."""
    store = ProbeCache(path)
    len(store)  # create the empty store (its schema)
    store.close()
    return timed_copy(pack, path, ("contexts", "probes", "configs"))


def timed_copy(pack: Path, path: Path, tables: tuple[str, ...]) -> float:
    """Seconds SQLite takes to copy ``tables`` of ``pack`` into the store at ``path`` (its tables
    already made) in one transaction, its commit folding the WAL."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA cache_size=-65536")
        conn.execute("ATTACH ? AS pk", (str(pack),))
        t0 = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        for table in tables:
            conn.execute(f"INSERT INTO main.{table} SELECT * FROM pk.{table}")
        conn.execute("COMMIT")
        return time.perf_counter() - t0
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="entries (default 1,000,000)")
    ap.add_argument("--gets", type=int, default=10_000, help="random lookups to time")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--no-orjson", action="store_true",
                    help="use the standard json module only (as without orjson installed)")
    args = ap.parse_args()
    if args.no_orjson:
        from te_fl_attention.cache import _json

        _json.FAST = False
    tmp = tempfile.TemporaryDirectory(prefix="bench-cache-", dir=args.dir)
    root = Path(tmp.name)
    keys: list[CacheKey] = []

    t0 = time.perf_counter()
    store = ProbeCache(root / "store.sqlite")
    for batch in _rows(args.n, 0, keys):
        store.put_many(batch, checked=True)
    build_s = time.perf_counter() - t0
    store.checkpoint()
    store.close()
    size = os.path.getsize(root / "store.sqlite")

    store = ProbeCache(root / "store.sqlite")
    rng = random.Random(1)
    sample = [keys[rng.randrange(len(keys))] for _ in range(args.gets)]
    store.get(sample[0])  # open the file outside the timed region
    lat = []
    misses = 0
    for k in sample:
        t = time.perf_counter_ns()
        hit = store.get(k)
        lat.append((time.perf_counter_ns() - t) / 1000)
        misses += hit is None
    lat.sort()
    p50, p99 = statistics.median(lat), lat[int(len(lat) * 0.99) - 1]

    t0 = time.perf_counter()
    exported = export(store, root / "export.jsonl")
    export_s = time.perf_counter() - t0
    store.close()
    fresh = ProbeCache(root / "fresh.sqlite")
    t0 = time.perf_counter()
    report = import_(fresh, root / "export.jsonl")
    import_s = time.perf_counter() - t0
    fresh.close()
    store = ProbeCache(root / "store.sqlite")
    packed = export_pack(store, root / "export.pack")  # an SQLite pack of the same rows
    store.close()
    fresh = ProbeCache(root / "fresh-pack.sqlite")
    len(fresh)  # create the empty store outside the timed region (as for the JSONL import)
    t0 = time.perf_counter()
    pack_report = import_(fresh, root / "export.pack")
    pack_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.close()  # the last close folds the WAL the import left into the main file
    fold_s = time.perf_counter() - t0
    same = _count(root / "fresh-pack.sqlite") == args.n
    floor_s = _bare_copy(root / "export.pack", root / "fresh-floor.sqlite")
    ok = report.imported == args.n and not report.rejected and exported == args.n and not misses
    ok = ok and packed == args.n and pack_report.imported == args.n and same
    ok = ok and not pack_report.rejected
    print(f"cache_scale n={args.n} get_p50_us={p50:.1f} get_p99_us={p99:.1f} "
          f"import_per_s={args.n / import_s:.0f} import_pack_per_s={args.n / pack_s:.0f} "
          f"import_pack_with_fold_per_s={args.n / (pack_s + fold_s):.0f} "
          f"sql_copy_floor_per_s={args.n / floor_s:.0f} "
          f"pack_vs_floor={floor_s / (pack_s + fold_s):.2f} pack_vs_jsonl={import_s / pack_s:.2f} "
          f"bytes_per_entry={size / args.n:.0f} "
          f"build_per_s={args.n / build_s:.0f} export_per_s={exported / export_s:.0f} "
          f"{'ok' if ok else 'MISMATCH'}{' json-only' if args.no_orjson else ''} "
          "(targets: p99<=1000us, import>=100000/s, import_pack>=250000/s)")  # fmt: skip
    tmp.cleanup()


if __name__ == "__main__":
    main()

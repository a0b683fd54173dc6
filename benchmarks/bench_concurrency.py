"""Probe-cache concurrency benchmark: 16 processes writing one store with plain ``put()``.

Every ``put()`` is its own committed transaction (no batching). Reports total writes/s, errors
(exceptions, warnings, writes that fell back to memory) and entries lost. Prints one line.

    python benchmarks/bench_concurrency.py --procs 16 --writes 2000
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from te_fl_attention.cache import CacheKey, ProbeCache  # noqa: E402
from te_fl_attention.reasons import ProbeResult, Reason  # noqa: E402

FP = "a" * 64
VK = "b" * 64


def _key(worker: int, i: int) -> CacheKey:
    return CacheKey(f"{worker:08x}{i:056x}", "fused", FP, VK)


def _result(i: int) -> ProbeResult:
    if i % 4:
        return ProbeResult("fused", True, stage="run", evidence="cudnn graph", elapsed_ms=i / 10)
    return ProbeResult("fused", False, (Reason("head_dim.too_large", f"head_dim {i} > 256",
                                               observed=i, limit=256),))  # fmt: skip


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


def _writer(path: str, worker: int, writes: int, start: object, wfd: int) -> None:
    warnings = _Count()
    logging.getLogger("te_fl_attention.cache").addHandler(warnings)
    cache = ProbeCache(path)
    cache.get(_key(worker, 0))  # open before the clock starts
    errors = 0
    lat = []
    start.wait()  # type: ignore[attr-defined]
    for i in range(writes):
        t = time.perf_counter()
        try:
            cache.put(_key(worker, i), _result(i))
        except Exception:  # noqa: BLE001 - counted, never expected
            errors += 1
        lat.append(time.perf_counter() - t)
    done = time.time()
    errors += cache.mode != "rw"  # a write that fell back to memory is an error here
    lat.sort()
    report = {"errors": errors, "warnings": warnings.n, "done": done,
              "p99": lat[int(len(lat) * 0.99) - 1]}  # fmt: skip
    os.write(wfd, (json.dumps(report) + "\n").encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--writes", type=int, default=2000, help="puts per process")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-conc-") as tmp:
        path = str(Path(tmp) / "shared.sqlite")
        ProbeCache(path).close()
        ctx = mp.get_context("fork")
        start = ctx.Event()
        rfd, wfd = os.pipe()
        procs = [ctx.Process(target=_writer, args=(path, w, args.writes, start, wfd))
                 for w in range(args.procs)]  # fmt: skip
        for p in procs:
            p.start()
        os.close(wfd)
        time.sleep(1.0)  # let every writer open the store
        t0 = time.time()
        start.set()
        for p in procs:
            p.join()
        with os.fdopen(rfd) as f:
            reports = [json.loads(line) for line in f]
        elapsed = max(r["done"] for r in reports) - t0
        total = args.procs * args.writes
        errors = sum(r["errors"] + r["warnings"] for r in reports)
        errors += sum(p.exitcode != 0 for p in procs) + (args.procs - len(reports))
        cache = ProbeCache(path)
        found = cache.get_many(_key(w, i) for w in range(args.procs) for i in range(args.writes))
        lost = total - sum(found[k] == _result(int(k.config_key[8:], 16)) for k in found)
        p99 = max(r["p99"] for r in reports) * 1000
        print(
            f"concurrency procs={args.procs} writes={total} writes_per_s={total / elapsed:.0f} "
            f"errors={errors} lost={lost} put_p99_ms={p99:.1f} "
            f"(target >= 5000 writes/s, 0 errors, 0 lost; one committed transaction per put)"
        )


if __name__ == "__main__":
    main()

"""Many processes on one store: no errors surface, nothing acknowledged is lost."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

from cache_testutil import Records, key, result

from te_fl_attention.cache import CacheKey, ProbeCache

PROCS = 16
PUTS = 1000


def _writer(path: str, worker: int, wfd: int) -> None:
    """Puts mixed with gets; reports (errors, warnings, mismatches) as one JSON line."""
    log = Records()
    logging.getLogger("te_fl_attention.cache").addHandler(log)
    rng = random.Random(worker)
    cache = ProbeCache(path)
    errors = mismatches = 0
    for j in range(PUTS):
        k = key(worker * PUTS + j)
        try:
            cache.put(k, result(worker * PUTS + j))
            if j % 2:
                i = worker * PUTS + rng.randrange(j + 1)  # one of ours: must be there
                if cache.get(key(i)) != result(i):
                    mismatches += 1
                other = rng.randrange(PROCS * PUTS)  # anyone's: a hit must be right
                got = cache.get(key(other))
                if got is not None and got != result(other):
                    mismatches += 1
        except Exception:  # noqa: BLE001 - counting is the point
            errors += 1
    report = {"errors": errors, "warnings": len(log.records), "mismatches": mismatches}
    os.write(wfd, (json.dumps(report) + "\n").encode())


def test_sixteen_writers(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ctx = mp.get_context("fork")
    rfd, wfd = os.pipe()
    procs = [ctx.Process(target=_writer, args=(path, w, wfd)) for w in range(PROCS)]
    for p in procs:
        p.start()
    os.close(wfd)
    for p in procs:
        p.join(120)
    with os.fdopen(rfd) as f:
        reports = [json.loads(line) for line in f]
    assert [p.exitcode for p in procs] == [0] * PROCS
    assert len(reports) == PROCS
    assert sum(r["errors"] for r in reports) == 0
    assert sum(r["warnings"] for r in reports) == 0
    assert sum(r["mismatches"] for r in reports) == 0
    cache = ProbeCache(path)
    assert len(cache) == PROCS * PUTS
    hits = cache.get_many(key(i) for i in range(PROCS * PUTS))
    assert len(hits) == PROCS * PUTS
    assert all(hits[key(i)] == result(i) for i in range(PROCS * PUTS))
    assert not list(Path(tmp_path).glob("*.corrupt-*"))


# ------------------------------------------------------------------------------------------ crash
def _crash_writer(path: str, start: int, wfd: int) -> None:
    """Writes until killed; acknowledges each key only after ``put`` returned."""
    cache = ProbeCache(path)
    i = start
    while True:
        if i % 7 == 0:  # sometimes a multi-row transaction
            batch = [(key(n), result(n)) for n in range(i, i + 5)]
            cache.put_many(batch)
            os.write(wfd, "".join(f"{n}\n" for n in range(i, i + 5)).encode())
            i += 5
        else:
            cache.put(key(i), result(i))
            os.write(wfd, f"{i}\n".encode())
            i += 1


def test_sigkill_never_loses_acknowledged_puts(tmp_path, cache_log):
    path = str(tmp_path / "crash.sqlite")
    ctx = mp.get_context("fork")
    rng = random.Random(1234)
    acked: set[int] = set()
    start = 0
    t0 = time.monotonic()
    for _trial in range(100):
        rfd, wfd = os.pipe()
        p = ctx.Process(target=_crash_writer, args=(path, start, wfd))
        p.start()
        os.close(wfd)
        time.sleep(rng.uniform(0.0, 0.05))  # kill during open, puts, commits or checkpoints
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        with os.fdopen(rfd, "rb") as f:
            lines = f.read().decode().split("\n")
        trial = {int(x) for x in lines[:-1]}  # the last piece is "" or an unfinished line
        acked |= trial
        start = max(acked | {start}) + 10
        cache = ProbeCache(path)
        hits = cache.get_many([key(i) for i in trial])
        assert len(hits) == len(trial), f"lost {len(trial) - len(hits)} acknowledged puts"
        cache.close()
    assert time.monotonic() - t0 < 60
    cache = ProbeCache(path)
    hits = cache.get_many([key(i) for i in acked])
    assert len(hits) == len(acked) and all(hits[key(i)] == result(i) for i in acked)
    assert len(acked) > 100  # the trials did write something
    assert cache.mode == "rw"
    assert not list(Path(tmp_path).glob("*.corrupt-*"))
    assert cache_log.at(logging.WARNING) == []


def test_same_key_from_many_processes_is_one_row(tmp_path):
    path = str(tmp_path / "same.sqlite")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_put_one, args=(path, key(7))) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 8
    assert len(ProbeCache(path)) == 1


def _put_one(path: str, k: CacheKey) -> None:
    ProbeCache(path).put(k, result(7))

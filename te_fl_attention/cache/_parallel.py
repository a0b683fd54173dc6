"""Parallel import of a large JSON Lines export (used by :func:`.transfer.import_`).

The file is cut into byte ranges at line starts. Each range is checked and stored by its own
``python -m te_fl_attention.cache._parallel`` process into a private temporary store (the same
checks as a serial import; nothing crosses processes but file names, offsets and a JSON report).
The parent then copies the private stores into the target in file order with SQL
(``INSERT ... ON CONFLICT DO NOTHING``), so the first occurrence of a key still wins and rows
already in the target are still never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._lifecycle import classify
from .reader import ImportReport, import_serial, read_header
from .sqlite import ProbeCache, verify_written

#: Files smaller than this are imported serially (process start-up would not pay off).
MIN_BYTES = 32 * 2**20
MAX_WORKERS = 8
#: With fewer CPUs the default is a serial import (the parent mostly waits; copying costs extra).
MIN_CPUS = 4
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def maybe_parallel_import(
    target: ProbeCache, path: str | os.PathLike[str], workers: int | None
) -> ImportReport | None:
    """Import in parallel when it pays off; ``None``: the caller imports serially."""
    if workers is None:
        cpus = _available_cpus()
        workers = min(MAX_WORKERS, cpus) if cpus >= MIN_CPUS else 1
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if f.read(16) == b"SQLite format 3\x00":
                return None
    except OSError:
        return None
    if workers < 2 or size < MIN_BYTES:
        return None
    target.run(lambda conn: None, write=False, miss=None)  # open it
    if target.mode != "rw":  # only a writable store takes the SQL copy
        return None
    header_len, problem = read_header(path)
    if problem:
        return ImportReport(rejected=[(1, problem)])
    ranges = _split(path, header_len, size, workers)
    tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=target.path.parent))
    procs = [_start(path, start, end, tmp / f"part{i}") for i, (start, end) in enumerate(ranges)]
    try:
        report = ImportReport()
        line_offset = 1  # line numbers in a range count from 1; the header is line 1
        for i, ((start, end), proc) in enumerate(zip(ranges, procs, strict=True)):
            part = tmp / f"part{i}"
            if proc is None or proc.wait() != 0 or not _usable(part):
                _serial_part(path, start, end, part)  # the worker failed: redo its range here
            info = json.loads(part.with_suffix(".json").read_text())
            written = _copy_into(target, part.with_suffix(".sqlite"))
            if written is None:  # could not copy (target not writable...): finish serially
                rest = import_serial(target, path, start=start, end=size)
                report.imported += rest.imported
                report.skipped += rest.skipped
                report.rejected += [(line_offset + n, r) for n, r in rest.rejected]
                return report
            report.rejected += [(line_offset + n, r) for n, r in info["rejected"]]
            line_offset += info["lines"]
            report.imported += written
            report.skipped += info["skipped"] + info["imported"] - written
        return report
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _usable(part: Path) -> bool:
    """The worker left a report and a readable private store."""
    if not part.with_suffix(".json").exists():
        return False
    store = ProbeCache(part.with_suffix(".sqlite"), readonly=True)
    try:
        store.run(lambda conn: None, write=False, miss=None)
        return store.mode != "memo"
    finally:
        store.close()


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _split(path: str | os.PathLike[str], first: int, size: int, n: int) -> list[tuple[int, int]]:
    """``n`` byte ranges of ``[first, size)`` that start at line starts."""
    bounds = [first]
    with open(path, "rb") as f:
        for i in range(1, n):
            at = first + (size - first) * i // n
            f.seek(at - 1)
            f.readline()  # to the start of the next line
            if f.tell() > bounds[-1] and f.tell() < size:
                bounds.append(f.tell())
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _start(path: Any, start: int, end: int, part: Path) -> subprocess.Popen[bytes] | None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "te_fl_attention.cache._parallel", str(path), str(start),
           str(end), str(part)]  # fmt: skip
    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    except OSError:
        return None


def _serial_part(path: Any, start: int, end: int, part: Path) -> None:
    """Check and store one range into ``part.sqlite``; write ``part.json`` (worker and fallback)."""
    for suffix in (".sqlite", ".sqlite-wal", ".sqlite-shm", ".json"):
        Path(f"{part}{suffix}").unlink(missing_ok=True)
    store = ProbeCache(part.with_suffix(".sqlite"))
    try:
        report = import_serial(store, path, start=start, end=end)
        store.checkpoint()
    finally:
        store.close()
    lines = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        last = b"\n"
        while left > 0:
            chunk = f.read(min(left, 2**24))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            last = chunk[-1:]
            left -= len(chunk)
        lines += last != b"\n"
    info = {"lines": lines, "imported": report.imported, "skipped": report.skipped,
            "rejected": report.rejected}  # fmt: skip
    tmp = part.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(part.with_suffix(".json"))


class _CopyFailed(Exception):
    """Copying a private store failed (never blamed on the target: no quarantine from here)."""


def _copy_into(target: ProbeCache, part: Path) -> int | None:
    """Copy a private store's rows into ``target`` (never overwriting).

    Returns the rows written, or ``None`` if the target cannot take them (the caller then
    imports the rest serially, where any real trouble with the target shows up as usual).
    """

    def copy(conn: Any) -> int:
        try:
            conn.execute("ATTACH DATABASE ? AS part", (str(part),))
        except sqlite3.Error as exc:
            raise _CopyFailed(str(exc)) from None
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "INSERT INTO main.contexts SELECT * FROM part.contexts WHERE true"
                " ON CONFLICT (ctx) DO UPDATE SET device=excluded.device"
                " WHERE contexts.device IS NULL AND excluded.device IS NOT NULL"
            )
            for table in ("templates", "bases"):  # (what the rows and configs use)
                conn.execute(f"INSERT OR IGNORE INTO main.{table} SELECT * FROM part.{table}")
            conn.execute("INSERT INTO main.configs SELECT * FROM part.configs WHERE true"
                         " ON CONFLICT DO NOTHING")  # fmt: skip
            before = conn.total_changes
            conn.execute("INSERT INTO main.probes SELECT * FROM part.probes WHERE true"
                         " ON CONFLICT DO NOTHING")  # fmt: skip
            written = conn.total_changes - before
            sample = conn.execute("SELECT config_key, backend, ctx FROM part.probes"
                                  " ORDER BY random() LIMIT 32").fetchall()  # fmt: skip
            verify_written(conn, sample)
            conn.execute("COMMIT")
            return written
        except sqlite3.Error as exc:
            if classify(exc) == "busy":
                raise  # the store retries
            raise _CopyFailed(str(exc)) from None
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            with contextlib.suppress(sqlite3.Error):
                conn.execute("DETACH DATABASE part")

    try:
        written = target.run(copy, write=True, miss=-1)
    except _CopyFailed:
        return None
    return None if written < 0 else written


def _main(argv: list[str]) -> int:
    path, start, end, part = argv
    _serial_part(path, int(start), int(end), Path(part))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Moving cached results between machines: JSON Lines export/import, merge, warm start.

Every row from outside goes through the one validator in :mod:`.rows`; reading files
and stores, and the serial import, are in :mod:`.reader`; big imports run in parallel
(:mod:`._parallel`).

Imports treat the file as hostile: every row is checked (types, sizes, nesting, known backends,
hex keys, no unknown fields) and parsed as JSON only (:mod:`json`, or orjson where it gives the
same result: see :mod:`._json`), so nothing in a file is ever executed. A bad row is rejected with
its line number and the rest still import. Rows already in the cache are never overwritten. Rows
for other devices or software stacks are stored, but their key only ever matches the device and
stack they came from.

Speed: a row is parsed once, checked by a quick test that only passes rows the full checks
accept (anything else gets the full checks and their wording), and goes straight to its insert
parameters with the result's checked JSON text, which is what the store keeps and checksums.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from .. import files as _files
from ..reasons import ProbeResult
from . import pack as _pack
from .keys import CacheKey, package_version
from .memory import MemoryCache
from .reader import (
    BATCH,
    FORMAT,
    FORMAT_VERSION,
    ImportReport,
    checked_rows,
    gc_paused,
    import_serial,
    source,
)
from .rows import CacheRow
from .sqlite import ProbeCache
from .tiered import default_cache

Cache = ProbeCache | MemoryCache
log = logging.getLogger("te_fl_attention.cache")





@dataclass
class MergeReport:
    """What a merge did: rows written, same-key conflicts (newer kept), repeats, rejections."""

    written: int = 0
    conflicts: int = 0
    duplicates: int = 0
    rejected: list[tuple[str, int, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"written": self.written, "conflicts": self.conflicts,
                "duplicates": self.duplicates,
                "rejected": [{"source": s, "line": n, "reason": r}
                             for s, n, r in self.rejected]}  # fmt: skip

    def __str__(self) -> str:
        return (f"wrote {self.written} rows, {self.conflicts} conflicts (newer kept), "
                f"{self.duplicates} duplicates, {len(self.rejected)} rejected")  # fmt: skip


# ------------------------------------------------------------------------------------------ export
def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def export(cache: Cache, path_or_file: str | os.PathLike[str] | IO[str], *,
           device_fp: str | None = None, exist_ok: bool = True) -> int:  # fmt: skip
    """Write every row (or only ``device_fp``'s) as JSON Lines; returns the number of rows.

    The first line is a header. A row's ``config``/``device`` are written the first time they
    occur and ``null`` after that (the importer stores them once per config / device).
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        path = Path(path_or_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        # write aside (in the target directory), flush to disk, rename: a reader never sees
        # half a file, and a failure leaves none
        with _files.atomic_output(path, exist_ok=exist_ok) as tmp:
            with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                n = _export_to(cache, f, device_fp)
            lines = _count_lines(tmp)  # read back: report only what is in the file
            if lines != n + 1:
                raise OSError(f"{tmp} holds {lines} lines after writing {n + 1}")
        return n
    return _export_to(cache, path_or_file, device_fp)


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def _export_to(cache: Cache, f: IO[str], device_fp: str | None) -> int:
    header = {"format": FORMAT, "format_version": FORMAT_VERSION,
              "package_version": package_version(), "exported_at": time.time()}  # fmt: skip
    f.write(_dump(header) + "\n")
    seen_cfg: str | None = None
    seen_dev: set[tuple[str, str]] = set()
    n = 0
    buf: list[str] = []
    for row in cache.iter_rows(device_fp=device_fp):
        d = row.to_dict()
        if d["config_key"] == seen_cfg:
            d["config"] = None
        elif d["config"] is not None:
            seen_cfg = d["config_key"]
        ctx = (d["device_fp"], d["versions_key"])
        if ctx in seen_dev:
            d["device"] = None
        elif d["device"] is not None:
            seen_dev.add(ctx)
        buf.append(_dump(d))
        n += 1
        if len(buf) >= 1000:
            f.write("\n".join(buf) + "\n")
            buf.clear()
    if buf:
        f.write("\n".join(buf) + "\n")
    return n







def import_(cache: Cache, path: str | os.PathLike[str] | IO[Any], *,
            workers: int | None = None) -> ImportReport:  # fmt: skip
    """Import an export file (or another store's rows); never overwrites a stored row.

    Repeated keys in the file: the first wins, later ones are skipped. A large export (32 MiB+)
    going into a writable store is checked by ``workers`` processes in parallel (default: one per
    CPU, at most 8, and none below 4 CPUs; ``workers=1``: never); the result is the same as a
    serial import.
    """
    if isinstance(path, (str, os.PathLike)):
        _files.open_regular(path).close()  # missing, a FIFO, a device: an OSError now
        if _pack.is_pack(path):  # an SQLite pack: copied with SQL (see .pack)
            return _pack.import_pack(cache, path)
    store = getattr(cache, "local", cache)
    before = getattr(store, "in_memory_writes", 0)
    report = None
    if isinstance(path, (str, os.PathLike)) and isinstance(cache, ProbeCache):
        from . import _parallel

        report = _parallel.maybe_parallel_import(cache, path, workers)
    if report is None:
        report = import_serial(cache, path)
    _account(store, before, report)
    if report.rejected:
        n, reason = report.rejected[0]
        log.warning("import of %s: %d row(s) rejected (first: line %d: %s)", path,
                    len(report.rejected), n, reason[:200])  # fmt: skip
    return report


def _account(store: Any, before: int, report: ImportReport) -> None:
    """Move rows a store kept only in memory from ``imported`` to ``not_written``."""
    kept = getattr(store, "in_memory_writes", 0) - before
    if kept > 0:
        report.imported -= kept
        report.not_written += kept
        report.problem = getattr(store, "problem", None) or "the store is read-only"



def warm_from(path: str | os.PathLike[str]) -> ImportReport:
    """Import an export (or another store file) into the default cache, for job launchers."""
    return import_(default_cache(), path)


# ------------------------------------------------------------------------------------------- merge
def merge(a_path: str | os.PathLike[str], b_path: str | os.PathLike[str],
          out_path: str | os.PathLike[str]) -> MergeReport:  # fmt: skip
    """Union of two exports or stores into a new store (or a ``.jsonl`` export).

    Same-key rows with different results are conflicts: the later ``created_at`` wins. The output
    path is checked before any work (its directory exists and is writable, no file is there); the
    result is built in a temporary directory next to it, read back, and only then moved into
    place: a failed merge leaves no output and no lock file, and can simply be run again.
    """
    out = _files.check_output_path(out_path, exist_ok=False)
    for src in (a_path, b_path):
        _files.open_regular(src).close()  # missing, a FIFO, a device: an OSError now
    report = MergeReport()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name[:60]}.merge-", dir=out.parent))
    try:
        db = work / "merge.sqlite"
        store = ProbeCache(db)
        try:
            _merge_into(store, (a_path, b_path), report)
            len(store)  # opens the store if no source had a row
            if store.mode != "rw" or store.in_memory_writes:
                raise OSError(f"cannot write the merged store in {out.parent}: "
                              f"{store.problem or 'not writable'}")  # fmt: skip
            if out.suffix == ".jsonl":
                report.written = export(store, out, exist_ok=False)
                return report
            written = len(store)  # then one self-contained file, no -wal
            store.run(lambda c: c.execute("PRAGMA journal_mode=DELETE").fetchall(),
                      write=True, miss=None)  # fmt: skip
        finally:
            store.close()
        check = sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True)
        try:  # read back what will be reported
            found = check.execute("SELECT count(*) FROM probes").fetchone()[0]
        finally:
            check.close()
        if found != written:
            raise OSError(f"the merged store holds {found} rows, {written} were written")
        with _files.atomic_output(out, exist_ok=False, mode=0o600) as tmp:
            os.replace(db, tmp)
        report.written = written
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _merge_into(store: ProbeCache, sources: Iterable[str | os.PathLike[str]],
                report: MergeReport) -> None:  # fmt: skip
    for src in sources:
        rejected: list[tuple[int, str]] = []
        if _pack.is_pack(src):  # an SQLite pack: copied with SQL, newer wins (see .pack)
            try:
                done = _pack.merge_pack(store, src)
            except _pack.PackError as exc:  # (named: a merge reads two sources)
                raise _pack.PackError(f"refusing the pack {os.fspath(src)}: {exc}") from None
            except sqlite3.Error as exc:  # the merged store's (a full disk...)
                raise OSError(f"cannot write the merged store: {exc}") from None
            report.conflicts += done.conflicts
            report.duplicates += done.duplicates
            report.rejected.extend((str(src), n, r) for n, r in done.rejected)
            continue
        with source(src) as items, gc_paused():
            batch: list[CacheRow] = []
            for row in checked_rows(items, rejected):
                batch.append(row)
                if len(batch) >= BATCH:
                    _merge_batch(store, batch, report)
            _merge_batch(store, batch, report)
        report.rejected.extend((str(src), n, r) for n, r in rejected)


def _merge_batch(store: ProbeCache, batch: list[CacheRow], report: MergeReport) -> None:
    if not batch:
        return
    existing: dict[CacheKey, CacheRow] = dict(store.get_rows(r.key for r in batch))
    winners: dict[CacheKey, CacheRow] = {}
    for row in batch:
        old = winners.get(row.key) or existing.get(row.key)
        if old is not None:
            if _same(old.result, row.result):
                report.duplicates += 1
                continue
            report.conflicts += 1
            if row.created_at <= old.created_at:
                continue
        winners[row.key] = row
    store.put_many(winners.values(), on_conflict="replace", checked=True)
    batch.clear()


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return ProbeResult.from_dict(a) == ProbeResult.from_dict(b)

"""Reading export files and other stores, and the serial import (what :func:`.transfer.import_`
and the parallel import workers of :mod:`._parallel` run).

Imports treat the file as hostile: every row is checked by :mod:`.rows`' validator and parsed as
JSON only (:mod:`json`, or orjson where it gives the same result: see :mod:`._json`), so nothing
in a file is ever executed. A bad row is rejected with its line number and the rest still
import. Rows already in the cache are never overwritten.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .. import files as _files
from . import _json
from .memory import MemoryCache
from .rows import MAX_DEPTH, MAX_ROW, CacheRow, is_number, validate_parsed
from .sqlite import ProbeCache

Cache = ProbeCache | MemoryCache
log = logging.getLogger("te_fl_attention.cache")

FORMAT = "te-fl-attention-cache"
FORMAT_VERSION = 1
BATCH = 5_000
_HEADER_FIELDS = {"format", "format_version", "package_version", "exported_at"}


#: A JSON line holding one of these may hold such a character (an escape, or raw DEL / C1):
#: it gets the full checks, which clean strings (substring tests: far faster than a regex).
_SUSPECT_BYTES = (b"\\u", b"\\b", b"\\f", b"\\r", b"\x7f", b"\xc2")
#: Parsed by :mod:`json` rather than orjson, a line holding one of these (digits read as ``0``)
#: may hold a non-finite or over-long number.
_SUSPECT_NUMBERS = (b"NaN", b"Infinity", b"0" * 17, b"e000", b"E000", b"e+000", b"E+000",
                    b"e-000", b"E-000")  # fmt: skip
_DIGITS = bytes.maketrans(b"123456789", b"000000000")


@dataclass
class ImportReport:
    """What an import did: rows durably added, rows skipped (already present / repeated),
    rejections, and rows that could not be written to the file (``not_written``, kept in this
    process's memory only; ``problem`` says why)."""

    imported: int = 0
    skipped: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)
    not_written: int = 0
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"imported": self.imported, "skipped": self.skipped,
                "rejected": [{"line": n, "reason": r} for n, r in self.rejected],
                "not_written": self.not_written, "problem": self.problem}  # fmt: skip

    def __str__(self) -> str:
        text = (f"imported {self.imported}, skipped {self.skipped} (already present), "
                f"rejected {len(self.rejected)}")  # fmt: skip
        if self.not_written:
            text += f", NOT written {self.not_written} ({self.problem or 'store not writable'})"
        return text



def _header_problem(obj: Any) -> str | None:
    """Why ``obj``, the parsed first line (or :class:`_Bad`), is not an export's header."""
    if isinstance(obj, _Bad):  # (a binary file, or a pack whose SQLite header is damaged)
        return (f"the file is not a JSON Lines export, an SQLite pack or a store (its first line"
                f" is {obj})")  # fmt: skip
    if not isinstance(obj, dict):
        return "the first line is not a header object"
    if obj.get("format") != FORMAT:
        return f"not a {FORMAT} file (format={str(obj.get('format'))[:60]!r})"
    unknown = obj.keys() - _HEADER_FIELDS
    if unknown:
        return f"header has unknown field(s): {', '.join(sorted(map(str, unknown)))}"
    version = obj.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        return "header format_version must be an integer"
    if version != FORMAT_VERSION:
        return f"format_version {version} is not supported (this package reads {FORMAT_VERSION})"
    if not isinstance(obj.get("package_version", ""), str):
        return "header package_version must be a string"
    if not is_number(obj.get("exported_at", 0)):
        return "header exported_at must be a number"
    return None



# ---------------------------------------------------------------------------------------- readers
# (line number, parsed object or _Bad, raw size, whether orjson parsed it)
Item = tuple[int, Any, "int | None", bool]


class _Bad(str):
    """A line that could not be parsed (the string is the reason)."""


def _lines(f: IO[bytes], end: int | None = None) -> Iterator[tuple[int, bytes | None]]:
    """Numbered lines (up to byte offset ``end``), ``None`` for a line over :data:`MAX_ROW` bytes
    (skipped, never read whole)."""
    n = 0
    while True:
        if end is not None and f.tell() >= end:
            return
        line = f.readline(MAX_ROW + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_ROW and not line.endswith(b"\n"):
            while True:  # discard the rest of the over-long line in bounded chunks
                rest = f.readline(MAX_ROW)
                if not rest or rest.endswith(b"\n"):
                    break
            yield n, None
            continue
        yield n, line


def _line_size(line: bytes, by_orjson: bool) -> int | None:
    """The ``raw_size`` to validate a parsed line with: its length, or ``None`` (the full checks,
    which also clean strings) when it may hold an escaped control character or surrogate, a raw
    DEL/C1 character, or (parsed by :mod:`json`) a non-finite or over-long number."""
    for part in _SUSPECT_BYTES:
        if part in line:
            return None
    if not by_orjson:
        digits = line.translate(_DIGITS)
        for part in _SUSPECT_NUMBERS:
            if part in digits:
                return None
    return len(line)


def _parse(line: bytes) -> Any:
    return _parse_flagged(line)[0]


def _parse_flagged(line: bytes) -> tuple[Any, bool]:
    """``(parsed value or _Bad, whether orjson parsed it)``; :mod:`json`'s results and errors."""
    try:
        return _json.loads_flagged(line)
    except RecursionError:
        return _Bad(f"nested deeper than {MAX_DEPTH} levels"), False
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        return _Bad(f"not valid JSON: {str(exc)[:120]}"), False


def _read_jsonl(f: IO[bytes], *, header: bool = True, end: int | None = None) -> Iterator[Item]:
    """Parsed rows of an export: the header is checked first; a bad header ends the file.

    ``header=False``/``end``: a slice of the rows (for parallel import), from ``f``'s position.
    """
    header_seen = not header
    for n, line in _lines(f, end):
        if line is None:
            yield n, _Bad(f"line longer than {MAX_ROW} bytes"), None, False
            if not header_seen:
                return
            continue
        if not line or line.isspace():
            continue
        obj, fast = _parse_flagged(line)
        if not header_seen:
            problem = _header_problem(obj)
            if problem:
                yield n, _Bad(f"bad header: {problem}"), None, False
                return
            header_seen = True
            continue
        yield n, obj, _line_size(line, fast), fast
    if not header_seen:
        yield 0, _Bad("empty file: no header"), None, False


def read_header(path: str | os.PathLike[str]) -> tuple[int, str | None]:
    """``(bytes the header line takes, problem or None)`` for a JSON Lines export."""
    with _files.open_regular(path) as f:
        first = f.readline(MAX_ROW + 1)
    if not first or len(first) > MAX_ROW:
        return len(first), "bad header: missing or too long"
    problem = _header_problem(_parse(first))
    return len(first), f"bad header: {problem}" if problem else None


def _read_store(path: Path) -> Iterator[Item]:
    """Rows of another SQLite store, as export rows (checked like any import)."""
    src = ProbeCache(path, readonly=True)
    try:
        problem = src.check_integrity()
        if src.mode == "memo" or problem:
            why = f" ({problem})" if problem else ""
            yield 0, _Bad(f"not a readable te_fl_attention cache store{why}"), None, False
            return
        for i, row in enumerate(src.iter_rows(), start=1):
            yield i, row.to_dict(), None, False
    finally:
        src.close()


def is_sqlite(path: str | os.PathLike[str]) -> bool:
    """True if the file starts with the SQLite header (a FIFO, device...: False, unread)."""
    try:
        with _files.open_regular(path) as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


@contextlib.contextmanager
def source(path_or_file: str | os.PathLike[str] | IO[Any]) -> Iterator[Iterator[Item]]:
    if not isinstance(path_or_file, (str, os.PathLike)):
        f = path_or_file
        if isinstance(f, io.TextIOBase):
            f = io.BytesIO(f.read().encode("utf-8"))
        yield _read_jsonl(f)
        return
    f = _files.open_regular(path_or_file)  # a FIFO or /dev/zero: an error, never a hang
    with f:
        if f.read(16) == b"SQLite format 3\x00":
            yield _read_store(Path(path_or_file))
            return
        f.seek(0)
        yield _read_jsonl(f)


# ------------------------------------------------------------------------------------------ import
def checked_rows(items: Iterable[Item], rejected: list[tuple[int, str]]) -> Iterator[CacheRow]:
    for n, obj, size, fast in items:
        result = obj if isinstance(obj, _Bad) else validate_parsed(obj, size, fast)
        if isinstance(result, str):
            rejected.append((n, str(result)))
        else:
            yield result


def import_serial(cache: Cache, path: str | os.PathLike[str] | IO[Any], *, start: int = 0,
                  end: int | None = None) -> ImportReport:  # fmt: skip
    """:func:`import_` in this process; ``start``/``end``: only the rows in that byte range of
    a JSON Lines export (the header is not checked then; line numbers count from ``start``)."""
    report = ImportReport()
    if start or end is not None:
        with open(path, "rb") as f, gc_paused():  # type: ignore[arg-type]
            f.seek(start)
            _import_items(cache, _read_jsonl(f, header=False, end=end), report)
        return report
    with source(path) as items, gc_paused():
        _import_items(cache, items, report)
    return report


def _import_items(cache: Cache, items: Iterable[Item], report: ImportReport) -> None:
    if isinstance(cache, ProbeCache):  # rows go straight to their insert parameters
        writer = cache.bulk_writer("ignore")
        rejected = report.rejected
        for n, obj, size, fast in items:
            row = obj if isinstance(obj, _Bad) else validate_parsed(obj, size, fast)
            if isinstance(row, str):
                rejected.append((n, str(row)))
                continue
            writer.add(row, fast)
            if len(writer) >= BATCH:
                _flush_writer(writer, report)
        _flush_writer(writer, report)
        return
    batch: list[CacheRow] = []
    for row in checked_rows(items, report.rejected):
        batch.append(row)
        if len(batch) >= BATCH:
            _flush(cache, batch, report)
    _flush(cache, batch, report)


def _flush_writer(writer: Any, report: ImportReport) -> None:
    pending = len(writer)
    if pending:
        written = writer.flush()
        report.imported += written
        report.skipped += pending - written


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: parsed rows hold no cycles, and GC passes dominate big imports."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _flush(cache: Cache, batch: list[CacheRow], report: ImportReport) -> None:
    if batch:
        written = cache.put_many(batch, on_conflict="ignore", checked=True)
        report.imported += written
        report.skipped += len(batch) - written
        batch.clear()


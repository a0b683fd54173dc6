"""Moving cached results between machines: JSON Lines export/import, merge, warm start.

This module holds the one validator for every row that comes from outside this process: an
import, a merge, the Redis tier (:mod:`.remote`) and another store's rows (possibly written by
another package version) all go through :func:`validate_row` / :func:`validate_result` /
:func:`validate_context`. It checks types (booleans are booleans), finite and bounded numbers,
bounded strings (lone surrogates and control characters are replaced by U+FFFD), bounded nesting
and size, and a ``created_at`` no later than now plus :data:`MAX_CLOCK_SKEW_S`.

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

import contextlib
import dataclasses
import gc
import io
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from ..reasons import ProbeResult
from . import _files, _json
from .keys import KNOWN_BACKENDS, CacheKey, is_hex64, package_version
from .store import FUTURE_SKEW_S, CacheRow, MemoryCache, ProbeCache, _checked_row, default_cache

FORMAT = "te-fl-attention-cache"
FORMAT_VERSION = 1
MAX_STRING = 64 * 1024  # UTF-8 bytes in any one string
MAX_ROW = 1024 * 1024  # bytes in one line
MAX_DEPTH = 32  # nesting of objects/arrays in one row
MAX_NODES = 100_000  # values (strings, numbers, containers) in one row
MAX_ELAPSED_MS = 1e9  # a probe's elapsed_ms is in [0, MAX_ELAPSED_MS]
MAX_INT = 2**63  # integers anywhere in a row: |x| < MAX_INT
#: ``created_at`` may be at most this far in the future (clocks of machines differ a little):
#: a far-future stamp could win every merge and never be pruned.
MAX_CLOCK_SKEW_S = FUTURE_SKEW_S
_BATCH = 5_000

_HEADER_FIELDS = {"format", "format_version", "package_version", "exported_at"}
_ROW_FIELDS = frozenset({
    "config_key", "backend", "device_fp", "versions_key", "result", "config", "device",
    "created_at", "package_version",
})  # fmt: skip
_ROW_REQUIRED = frozenset({"config_key", "backend", "device_fp", "versions_key", "result"})
_RESULT_FIELDS = frozenset({
    "backend", "supported", "reasons", "stage", "evidence", "elapsed_ms", "detail", "variants",
})  # fmt: skip
_REASON_FIELDS = frozenset({"code", "message", "stage", "observed", "limit", "hint"})
_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)
_KNOWN = frozenset(KNOWN_BACKENDS)
_HEX = "0123456789abcdef"

Cache = ProbeCache | MemoryCache
log = logging.getLogger("te_fl_attention.cache")

#: Characters a stored string may not hold: C0 controls but tab and newline, DEL, C1 controls
#: and lone surrogates. They are replaced by U+FFFD.
_BAD_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
#: A JSON line holding one of these may hold such a character (an escape, or raw DEL / C1):
#: it gets the full checks, which clean strings (substring tests: far faster than a regex).
_SUSPECT_BYTES = (b"\\u", b"\\b", b"\\f", b"\\r", b"\x7f", b"\xc2")
#: Parsed by :mod:`json` rather than orjson, a line holding one of these (digits read as ``0``)
#: may hold a non-finite or over-long number.
_SUSPECT_NUMBERS = (b"NaN", b"Infinity", b"0" * 17, b"e000", b"E000", b"e+000", b"E+000",
                    b"e-000", b"E-000")  # fmt: skip
_DIGITS = bytes.maketrans(b"123456789", b"000000000")


def clean_text(text: str) -> str:
    """``text`` with lone surrogates and control characters (but tab/newline) as U+FFFD."""
    return _BAD_CHARS.sub("\ufffd", text) if _BAD_CHARS.search(text) else text


def _clean(value: Any) -> Any:
    """``value`` with every string (and field name) :func:`clean_text`-ed; the same object when
    nothing changes. Only for values :func:`_walk_problem` accepted (bounded depth)."""
    if type(value) is str:
        return clean_text(value)
    if type(value) is dict:
        out = {clean_text(k) if type(k) is str else k: _clean(v) for k, v in value.items()}
        same = len(out) == len(value) and all(
            a is b and c is d for (a, c), (b, d) in zip(value.items(), out.items(), strict=True)
        )
        return value if same else out
    if type(value) is list:
        items = [_clean(v) for v in value]
        return value if all(a is b for a, b in zip(value, items, strict=True)) else items
    return value


def _max_created() -> float:
    return time.time() + MAX_CLOCK_SKEW_S


def _scalar_problem(value: Any) -> str | None:
    """Numbers must be finite and bounded (``int`` beyond 64 bits, ``NaN``, ``Infinity``: no)."""
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            return f"a non-finite number ({value!r})"
    elif kind is int and not -MAX_INT < value < MAX_INT:
        return f"an integer of {len(str(abs(value)))} digits (limit: 64 bits)"
    return None


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


# ------------------------------------------------------------------------------------ validation
def _walk_problem(obj: Any, depth: int = 1) -> str | None:
    """Depth and string-size limits over a parsed value."""
    stack: list[tuple[Any, int]] = [(obj, depth)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"more than {MAX_NODES} values"
        if type(value) in (int, float):
            problem = _scalar_problem(value)
            if problem:
                return problem
        elif isinstance(value, str):
            if _utf8_len(value) > MAX_STRING:
                return f"a string of {_utf8_len(value)} bytes (limit {MAX_STRING})"
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            if isinstance(value, dict):
                for k, v in value.items():
                    if _utf8_len(k) > MAX_STRING:
                        return f"a field name of {_utf8_len(k)} bytes (limit {MAX_STRING})"
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in value)
    return None


def _utf8_len(text: str) -> int:
    if len(text) * 4 <= MAX_STRING:  # cannot be over the limit: skip the encoding
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _number(value: Any) -> bool:
    return type(value) is float or type(value) is int


def _reason_problem(r: Any, where: str, depth: int) -> str | None:
    if type(r) is not dict:
        return f"{where} is not an object"
    if not r.keys() <= _REASON_FIELDS:
        unknown = sorted(map(str, r.keys() - _REASON_FIELDS))
        return f"{where} has unknown field(s): {', '.join(unknown)}"
    if type(r.get("code")) is not str or type(r.get("message")) is not str:
        return f"{where}.code and .message must be strings"
    if type(r.get("stage", "")) is not str:
        return f"{where}.stage must be a string"
    hint = r.get("hint")
    if hint is not None and type(hint) is not str:
        return f"{where}.hint must be a string or null"
    for name in ("observed", "limit"):  # free-form JSON: only bounded
        value = r.get(name)
        if type(value) in (list, dict):
            problem = _walk_problem(value, depth + 1)
        else:
            problem = _scalar_problem(value)
        if problem:
            return f"{where}.{name}: {problem}"
    return None


def _result_problem(res: Any, where: str = "result", depth: int = 2) -> str | None:
    """Strict type check of a :meth:`ProbeResult.to_dict` value (``depth``: its nesting)."""
    if type(res) is not dict:
        return f"{where} is not an object"
    if not res.keys() <= _RESULT_FIELDS:
        unknown = sorted(map(str, res.keys() - _RESULT_FIELDS))
        return f"{where} has unknown field(s): {', '.join(unknown)}"
    backend = res.get("backend")
    if backend not in KNOWN_BACKENDS:
        return f"{where}.backend {str(backend)[:40]!r} is not one of {', '.join(KNOWN_BACKENDS)}"
    if type(res.get("supported")) is not bool:
        return f"{where}.supported must be true or false"
    if type(res.get("stage", "")) is not str or type(res.get("evidence", "")) is not str:
        return f"{where}.stage and .evidence must be strings"
    elapsed = res.get("elapsed_ms", 0.0)
    if not _number(elapsed) or not 0 <= elapsed <= MAX_ELAPSED_MS:
        shown = str(elapsed)[:40] + ("..." if len(str(elapsed)) > 40 else "")
        return f"{where}.elapsed_ms {shown} must be a number in [0, {MAX_ELAPSED_MS:g}]"
    detail = res.get("detail", {})
    if type(detail) is not dict:
        return f"{where}.detail must be an object"
    if detail:
        problem = _walk_problem(detail, depth + 1)
        if problem:
            return f"{where}.detail: {problem}"
    reasons = res.get("reasons", [])
    if type(reasons) is not list:
        return f"{where}.reasons must be a list"
    for i, r in enumerate(reasons):
        problem = _reason_problem(r, f"{where}.reasons[{i}]", depth + 2)
        if problem:
            return problem
    variants = res.get("variants", [])
    if type(variants) is not list:
        return f"{where}.variants must be a list"
    if variants and depth > 2:
        return f"{where}.variants: variants cannot have variants"
    for i, v in enumerate(variants):
        problem = _result_problem(v, f"{where}.variants[{i}]", depth + 2)
        if problem:
            return problem
    return None


def _flat_object_problem(obj: Any, name: str) -> str | None:
    """``config``/``device``: null or an object of scalars / lists of scalars."""
    if obj is None:
        return None
    if type(obj) is not dict:
        return f"{name} must be an object or null"
    if len(obj) > 256:
        return f"{name} has {len(obj)} fields (limit 256)"
    for k, v in obj.items():
        if type(v) is list:
            if not all(isinstance(x, _SCALARS) for x in v):
                return f"{name}.{k} must hold only scalars"
            problem = next(filter(None, map(_scalar_problem, v)), None)
        elif not isinstance(v, _SCALARS):
            return f"{name}.{k} must be a scalar or a list of scalars"
        else:
            problem = _scalar_problem(v)
        if problem:
            return f"{name}.{k}: {problem}"
    return None


def validate_row(obj: Any, raw_size: int | None = None) -> CacheRow | str:
    """A checked :class:`CacheRow` from one parsed export row, or the reason it is rejected.

    Every check applies (``raw_size``, the row's length in the file, is accepted for
    compatibility; readers use :func:`_line_size` to take the quick path safely).
    """
    return _row_problem(obj, None)


def _validate(obj: Any, raw_size: int | None, by_orjson: bool) -> CacheRow | str:
    """:func:`validate_row`; ``by_orjson``: ``obj`` came from :func:`_json.loads_flagged` with
    that flag set (its result's text, written with orjson, then goes with the row).

    Most rows pass :func:`_row_ok`, a quick test that only ever accepts rows the full checks
    (:func:`_row_problem`) accept; any other row goes through the full checks, which also word
    the reason."""
    if raw_size is not None and raw_size <= MAX_STRING and _row_ok(obj):
        result = obj["result"]
        return _checked_row(
            CacheKey(obj["config_key"], obj["backend"], obj["device_fp"], obj["versions_key"]),
            result, float(obj.get("created_at", 0.0)), obj.get("package_version", ""),
            obj.get("config"), obj.get("device"),
            _json.dumps_loaded(result, True) if by_orjson else None)  # fmt: skip
    row = _row_problem(obj, raw_size)
    if isinstance(row, CacheRow) and by_orjson:
        row = dataclasses.replace(row, result_json=_json.dumps_loaded(row.result, True))
    return row


_HEX_SEEN: set[str] = set()  # hex keys already checked (rows repeat them: the same device...)


def _hex64(value: Any) -> bool:
    """:func:`is_hex64` for a ``str`` (``False`` for anything else: the full check decides)."""
    if type(value) is not str:
        return False
    if value in _HEX_SEEN:
        return True
    if len(value) != 64 or value.strip(_HEX):
        return False
    if len(_HEX_SEEN) >= 4096:
        _HEX_SEEN.clear()
    _HEX_SEEN.add(value)
    return True


def _row_ok(obj: Any) -> bool:
    """True only for a row that :func:`_row_problem` accepts, in a line of at most
    :data:`MAX_STRING` bytes (so no string in it is too long). False: ask it."""
    if type(obj) is not dict:
        return False
    keys = obj.keys()
    if not (keys <= _ROW_FIELDS and keys >= _ROW_REQUIRED):
        return False
    backend, result = obj["backend"], obj["result"]
    if not (_hex64(obj["config_key"]) and _hex64(obj["device_fp"]) and _hex64(obj["versions_key"])
            and type(backend) is str and backend in _KNOWN and _result_ok(result, 2)
            and result["backend"] == backend):  # fmt: skip
        return False
    config, device = obj.get("config"), obj.get("device")
    if (config is not None and not _flat_ok(config)) or (device is not None
                                                          and not _flat_ok(device)):  # fmt: skip
        return False
    created = obj.get("created_at", 0.0)
    kind = type(created)
    if not ((kind is float or kind is int) and 0 <= created <= _max_created()):
        return False
    pkg = obj.get("package_version", "")
    return type(pkg) is str and len(pkg) <= 128


def _result_ok(res: Any, depth: int) -> bool:
    """True only for a result :func:`_result_problem` accepts at ``depth`` (strings assumed short:
    see :func:`_row_ok`). Every result it accepts also passes :meth:`ProbeResult.from_dict`."""
    if type(res) is not dict or not res.keys() <= _RESULT_FIELDS:
        return False
    backend = res.get("backend")
    if type(backend) is not str or backend not in _KNOWN:
        return False
    if type(res.get("supported")) is not bool:
        return False
    if type(res.get("stage", "")) is not str or type(res.get("evidence", "")) is not str:
        return False
    elapsed = res.get("elapsed_ms", 0.0)
    kind = type(elapsed)
    if not ((kind is float or kind is int) and 0 <= elapsed <= MAX_ELAPSED_MS):
        return False
    detail = res.get("detail", {})
    if type(detail) is not dict:
        return False
    if detail and not _SCALAR_TYPES.issuperset(map(type, detail.values())):
        if _walk_problem(detail, depth + 1):  # nested values: the depth walk
            return False
    reasons = res.get("reasons", [])
    if type(reasons) is not list:
        return False
    for r in reasons:
        if type(r) is not dict or not r.keys() <= _REASON_FIELDS:
            return False
        if type(r.get("code")) is not str or type(r.get("message")) is not str:
            return False
        hint = r.get("hint")
        if type(r.get("stage", "")) is not str or (hint is not None and type(hint) is not str):
            return False
        for name in ("observed", "limit"):
            value = r.get(name)
            if type(value) in (list, dict) and _walk_problem(value, depth + 3):
                return False
    variants = res.get("variants", [])
    if type(variants) is not list:
        return False
    if variants:
        if depth > 2:
            return False
        for v in variants:
            if not _result_ok(v, depth + 2):
                return False
    return True


def _flat_ok(obj: Any) -> bool:
    """True only for a non-null ``config``/``device`` :func:`_flat_object_problem` accepts."""
    if type(obj) is not dict or len(obj) > 256:
        return False
    values = obj.values()
    if _SCALAR_TYPES.issuperset(map(type, values)):
        return True
    for v in values:
        if type(v) is list:
            if not _SCALAR_TYPES.issuperset(map(type, v)):
                return False
        elif type(v) not in _SCALAR_TYPES:
            return False
    return True


def _row_problem(obj: Any, raw_size: int | None) -> CacheRow | str:
    """The full checks of one parsed export row (see :func:`validate_row`)."""
    if type(obj) is not dict:
        return "row is not a JSON object"
    keys = obj.keys()
    if not keys <= _ROW_FIELDS:
        return f"unknown field(s): {', '.join(sorted(map(str, keys - _ROW_FIELDS)))}"
    if not keys >= _ROW_REQUIRED:
        return f"missing field(s): {', '.join(sorted(_ROW_REQUIRED - keys))}"
    if raw_size is None or raw_size > MAX_STRING:
        problem = _walk_problem(obj)
        if problem:
            return problem
    ck, backend, fp, vk = obj["config_key"], obj["backend"], obj["device_fp"], obj["versions_key"]
    if not (is_hex64(ck) and is_hex64(fp) and is_hex64(vk)):
        return "config_key, device_fp and versions_key must be 64 lowercase hex characters"
    if backend not in KNOWN_BACKENDS:
        return f"backend {str(backend)[:40]!r} is not one of {', '.join(KNOWN_BACKENDS)}"
    result = obj["result"]
    problem = _result_problem(result)
    if problem:
        return problem
    if result["backend"] != backend:
        return f"result.backend {result['backend']!r} does not match backend {backend!r}"
    try:
        ProbeResult.from_dict(result)
    except Exception as exc:  # noqa: BLE001 - any failure is a rejection
        return f"result is not a valid ProbeResult: {type(exc).__name__}: {exc}"[:300]
    config, device = obj.get("config"), obj.get("device")
    if config is not None or device is not None:
        problem = _flat_object_problem(config, "config") or _flat_object_problem(device, "device")
        if problem:
            return problem
    created = obj.get("created_at", 0.0)
    problem = _created_problem(created)
    if problem:
        return problem
    pkg = obj.get("package_version", "")
    if type(pkg) is not str or len(pkg) > 128:
        return "package_version must be a string of at most 128 characters"
    return CacheRow(CacheKey(ck, backend, fp, vk), _clean(result), float(created), _clean(pkg),
                    _clean(config), _clean(device))  # fmt: skip


def _created_problem(created: Any) -> str | None:
    if not _number(created) or not 0 <= created < 1e11:
        shown = str(created)[:40]
        return f"created_at {shown!r} must be a unix time (a non-negative number)"
    if created > _max_created():
        return (f"created_at {created!r} is in the future (more than {MAX_CLOCK_SKEW_S:.0f} s "
                "ahead of this machine's clock)")  # fmt: skip
    return None


def validate_result(obj: Any, backend: str | None = None) -> dict[str, Any] | str:
    """A checked and cleaned :meth:`ProbeResult.to_dict` value (for ``backend`` when given),
    or the reason it is rejected (what the Redis tier serves goes through this)."""
    problem = _walk_problem(obj, 2) or _result_problem(obj)
    if problem:
        return problem
    if backend is not None and obj["backend"] != backend:
        return f"result.backend {obj['backend']!r} does not match backend {backend!r}"
    try:
        ProbeResult.from_dict(obj)
    except Exception as exc:  # noqa: BLE001 - any failure is a rejection
        return f"result is not a valid ProbeResult: {type(exc).__name__}: {exc}"[:300]
    return _clean(obj)


def validate_flat(obj: Any, name: str) -> dict[str, Any] | None | str:
    """A checked and cleaned ``config``/``device`` JSON (``None`` stays ``None``), or the reason
    it is rejected."""
    problem = _walk_problem(obj) or _flat_object_problem(obj, name)
    return problem if problem else _clean(obj)


def validate_context(obj: Any) -> dict[str, Any] | str:
    """A checked Redis context record ``{"device", "package_version", "created_at"}``, or the
    reason it is rejected."""
    if type(obj) is not dict:
        return "context is not an object"
    unknown = obj.keys() - {"device", "package_version", "created_at"}
    if unknown:
        return f"context has unknown field(s): {', '.join(sorted(map(str, unknown)))[:200]}"
    device = validate_flat(obj.get("device"), "device")
    if isinstance(device, str):
        return device
    created = obj.get("created_at", 0.0)
    problem = _created_problem(created if created is not None else 0.0)
    if problem:
        return problem
    pkg = obj.get("package_version") or ""
    if type(pkg) is not str or len(pkg) > 128:
        return "package_version must be a string of at most 128 characters"
    return {"device": device, "package_version": clean_text(pkg),
            "created_at": float(created or 0.0)}  # fmt: skip


def _header_problem(obj: Any) -> str | None:
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
    if not _number(obj.get("exported_at", 0)):
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
            problem = obj if isinstance(obj, _Bad) else _header_problem(obj)
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
    obj = _parse(first)
    problem = obj if isinstance(obj, _Bad) else _header_problem(obj)
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
def _source(path_or_file: str | os.PathLike[str] | IO[Any]) -> Iterator[Iterator[Item]]:
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
def _checked(items: Iterable[Item], rejected: list[tuple[int, str]]) -> Iterator[CacheRow]:
    for n, obj, size, fast in items:
        result = obj if isinstance(obj, _Bad) else _validate(obj, size, fast)
        if isinstance(result, str):
            rejected.append((n, str(result)))
        else:
            yield result


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


def import_serial(cache: Cache, path: str | os.PathLike[str] | IO[Any], *, start: int = 0,
                  end: int | None = None) -> ImportReport:  # fmt: skip
    """:func:`import_` in this process; ``start``/``end``: only the rows in that byte range of
    a JSON Lines export (the header is not checked then; line numbers count from ``start``)."""
    report = ImportReport()
    if start or end is not None:
        with open(path, "rb") as f, _gc_paused():  # type: ignore[arg-type]
            f.seek(start)
            _import_items(cache, _read_jsonl(f, header=False, end=end), report)
        return report
    with _source(path) as items, _gc_paused():
        _import_items(cache, items, report)
    return report


def _import_items(cache: Cache, items: Iterable[Item], report: ImportReport) -> None:
    if isinstance(cache, ProbeCache):  # rows go straight to their insert parameters
        writer = cache.bulk_writer("ignore")
        rejected = report.rejected
        for n, obj, size, fast in items:
            row = obj if isinstance(obj, _Bad) else _validate(obj, size, fast)
            if isinstance(row, str):
                rejected.append((n, str(row)))
                continue
            writer.add(row, fast)
            if len(writer) >= _BATCH:
                _flush_writer(writer, report)
        _flush_writer(writer, report)
        return
    batch: list[CacheRow] = []
    for row in _checked(items, report.rejected):
        batch.append(row)
        if len(batch) >= _BATCH:
            _flush(cache, batch, report)
    _flush(cache, batch, report)


def _flush_writer(writer: Any, report: ImportReport) -> None:
    pending = len(writer)
    if pending:
        written = writer.flush()
        report.imported += written
        report.skipped += pending - written


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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
            store._call(lambda c: c.execute("PRAGMA journal_mode=DELETE").fetchall(),
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
        with _source(src) as items, _gc_paused():
            batch: list[CacheRow] = []
            for row in _checked(items, rejected):
                batch.append(row)
                if len(batch) >= _BATCH:
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

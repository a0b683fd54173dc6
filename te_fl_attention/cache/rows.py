"""Rows: :class:`CacheRow`, :func:`make_row`, the row checksum and the stored-row codec.

Every store (:mod:`.memory`, :mod:`.sqlite`, :mod:`.remote`) holds :class:`CacheRow` values;
each row carries a CRC over its key and result (:func:`row_crc`), so a damaged row is a miss,
never a wrong hit.

This module also holds the one validator for every row that comes from outside this process: an
import, a merge, the Redis tier (:mod:`.remote`) and another store's rows (possibly written by
another package version) all go through :func:`validate_row` / :func:`validate_result` /
:func:`validate_context`. It checks types (booleans are booleans), finite and bounded numbers,
bounded strings (lone surrogates and control characters are replaced by U+FFFD), bounded nesting
and size, and a ``created_at`` no later than now plus :data:`MAX_CLOCK_SKEW_S`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..reasons import ProbeResult
from . import _json
from .keys import CacheKey, is_hex64, known_backends, package_version

if TYPE_CHECKING:
    from ..config import FusedAttnConfig
    from ..device import DeviceProfile

#: ``prune --older-than`` also deletes rows stamped more than this far in the future.
FUTURE_SKEW_S = 300.0

OnConflict = Literal["replace", "ignore", "newer"]

dumps = functools.partial(json.dumps, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def ctx_id(device_fp: str, versions_key: str) -> int:
    """The 63-bit row id of a (device, software stack) pair."""
    digest = hashlib.sha256(f"{device_fp}:{versions_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def row_crc(key: CacheKey, result_json: str) -> int:
    """CRC32 over a row's key and result text: a damaged row reads as a miss."""
    return zlib.crc32("\0".join((*key, result_json)).encode())


def row_crc_bytes(key: CacheKey, result_utf8: bytes) -> int:
    """:func:`row_crc` of a result read as its UTF-8 bytes (equal for the same text)."""
    return zlib.crc32(result_utf8, zlib.crc32(f"{key[0]}\0{key[1]}\0{key[2]}\0{key[3]}\0".encode()))


def crc_head(config_key: str) -> bytes:
    """The bytes :func:`row_crc_bytes` covers first (the config key); with :func:`crc_tail`,
    ``zlib.crc32(result, zlib.crc32(tail, zlib.crc32(head)))`` is the row's checksum (a bulk check
    computes the head once per config and the tail once per backend and context)."""
    return f"{config_key}\0".encode()


def crc_tail(backend: str, device_fp: str, versions_key: str) -> bytes:
    """The bytes :func:`row_crc_bytes` covers between the config key and the result."""
    return f"{backend}\0{device_fp}\0{versions_key}\0".encode()


def finite(value: Any) -> float:
    """A finite float for a REAL column (SQLite stores NaN as NULL)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def as_dict(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    return dict(obj)


def loads_dict(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class CacheRow:
    """One stored result with its bookkeeping (what ``iter_rows``/``export`` see).

    ``result`` is the :meth:`ProbeResult.to_dict` form; ``config``/``device`` are the optional
    JSON forms of the config and device (for display only: the key is what matters).
    ``result_json``: ``result``'s JSON text when it is already known (an import parsed and checked
    it), stored as is; ``None``: written when stored. Never compared.
    """

    key: CacheKey
    result: Mapping[str, Any]
    created_at: float
    package_version: str
    config: Mapping[str, Any] | None = None
    device: Mapping[str, Any] | None = None
    result_json: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def probe_result(self) -> ProbeResult:
        return ProbeResult.from_dict(self.result)

    def to_dict(self) -> dict[str, Any]:
        """The export form (one JSON Lines row)."""
        return {
            "config_key": self.key.config_key,
            "backend": self.key.backend,
            "device_fp": self.key.device_fp,
            "versions_key": self.key.versions_key,
            "result": dict(self.result),
            "config": dict(self.config) if self.config is not None else None,
            "device": dict(self.device) if self.device is not None else None,
            "created_at": self.created_at,
            "package_version": self.package_version,
        }


#: What ``put_many`` accepts: rows, or ``(key, result)`` / ``(key, result, config, device)``.
PutItem = Any


def make_row(
    key: CacheKey,
    result: ProbeResult | Mapping[str, Any],
    config: FusedAttnConfig | Mapping[str, Any] | None = None,
    device: DeviceProfile | Mapping[str, Any] | None = None,
    *,
    created_at: float | None = None,
) -> CacheRow:
    """A :class:`CacheRow` for a fresh result (validates the key)."""
    result_d = result.to_dict() if isinstance(result, ProbeResult) else dict(result)
    return CacheRow(
        key=CacheKey(*key).check(),
        result=result_d,
        created_at=time.time() if created_at is None else float(created_at),
        package_version=package_version(),
        config=as_dict(config),
        device=as_dict(device),
    )



def to_row(item: PutItem, checked: bool = False) -> CacheRow:
    if isinstance(item, CacheRow):
        if not checked:
            item.key.check()
        return item
    return make_row(*item)


def _checked_row(key: CacheKey, result: dict[str, Any], created_at: float, package_version: str,
                 config: dict[str, Any] | None, device: dict[str, Any] | None,
                 result_json: str | None) -> CacheRow:  # fmt: skip
    """``CacheRow(...)`` for values an import has just checked (fills the frozen instance
    directly: the dataclass ``__init__`` only sets these fields)."""
    row = object.__new__(CacheRow)
    row.__dict__.update(key=key, result=result, created_at=created_at,
                        package_version=package_version, config=config, device=device,
                        result_json=result_json)  # fmt: skip
    return row


def row_params(row: CacheRow) -> tuple[Any, ...]:
    """The ``probes`` insert parameters of a row."""
    key = row.key
    text = row.result_json
    if text is None:
        text = dumps(row.result)
    res = row.result
    return (
        key.config_key, key.backend, ctx_id(key.device_fp, key.versions_key),
        1 if res.get("supported") else 0, str(res.get("stage", "rule")),
        finite(res.get("elapsed_ms")), finite(row.created_at), str(row.package_version),
        row_crc(key, text), text,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ validation
#: The one validator for every row from outside (import, merge, the Redis tier).
MAX_STRING = 64 * 1024  # UTF-8 bytes in any one string
MAX_ROW = 1024 * 1024  # bytes in one line
MAX_DEPTH = 32  # nesting of objects/arrays in one row
MAX_NODES = 100_000  # values (strings, numbers, containers) in one row
MAX_ELAPSED_MS = 1e9  # a probe's elapsed_ms is in [0, MAX_ELAPSED_MS]
MAX_INT = 2**63  # integers anywhere in a row: |x| < MAX_INT
#: ``created_at`` may be at most this far in the future (clocks of machines differ a little):
#: a far-future stamp could win every merge and never be pruned.
MAX_CLOCK_SKEW_S = FUTURE_SKEW_S
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
_HEX = "0123456789abcdef"

#: Characters a stored string may not hold: C0 controls but tab and newline, DEL, C1 controls
#: and lone surrogates. They are replaced by U+FFFD.
_BAD_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


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


def is_number(value: Any) -> bool:
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
    if backend not in known_backends():
        return (f"{where}.backend {str(backend)[:40]!r} is not one of "
                f"{', '.join(known_backends())}")
    if type(res.get("supported")) is not bool:
        return f"{where}.supported must be true or false"
    if type(res.get("stage", "")) is not str or type(res.get("evidence", "")) is not str:
        return f"{where}.stage and .evidence must be strings"
    elapsed = res.get("elapsed_ms", 0.0)
    if not is_number(elapsed) or not 0 <= elapsed <= MAX_ELAPSED_MS:
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


def validate_parsed(obj: Any, raw_size: int | None, by_orjson: bool) -> CacheRow | str:
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
            and type(backend) is str and backend in known_backends() and _result_ok(result, 2)
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
    if type(backend) is not str or backend not in known_backends():
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
    if backend not in known_backends():
        return f"backend {str(backend)[:40]!r} is not one of {', '.join(known_backends())}"
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
    if not is_number(created) or not 0 <= created < 1e11:
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

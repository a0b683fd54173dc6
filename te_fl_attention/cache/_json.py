"""JSON for the probe cache: the standard library's results, orjson's speed when it is installed.

:func:`loads` returns exactly what ``json.loads(data.decode("utf-8"))`` returns and raises what it
raises: orjson answers only where the two agree, and anything orjson refuses is parsed again by
:mod:`json` (which then accepts it, e.g. ``NaN``, or raises its own error). What orjson parses
differently is never handed to it: integers outside 64 bits (orjson makes them floats: a run of
19 or more digits that is not a fraction, right after a ``.``, goes to :mod:`json`) and deep
nesting (orjson may accept what :mod:`json` refuses with ``RecursionError``: text with more than
:data:`MAX_BRACKETS` brackets goes to :mod:`json`). ``tests/cache/test_json.py`` checks the
agreement on generated and mutated input.

:func:`dumps_loaded` writes a value that :func:`loads` returned through orjson (plain JSON types,
finite floats, 64-bit integers), where orjson's output reads back as the same value.
"""

from __future__ import annotations

import json
from typing import Any

try:  # optional: any version; the tests check the agreement with json on the installed one
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised by forcing FAST off in the tests
    _orjson = None

#: Whether orjson is used (tests switch it off to check the fallback).
FAST = _orjson is not None

# Digits to "0" and "{" to "[": one pass, then one count of brackets and one search for digits.
_DIGITS = bytes.maketrans(b"123456789{", b"000000000[")
#: More ``[``/``{`` than this (so perhaps nested this deep): parsed by :mod:`json`, whose C parser
#: raises ``RecursionError`` near ``sys.getrecursionlimit()`` levels (1000 by default).
MAX_BRACKETS = 256
_LONG_INT = b"0" * 19  # 19+ digits in a row: maybe an integer beyond 64 bits

_std_loads = json.loads
_std_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _for_json(data: bytes) -> bool:
    """Whether ``data`` may hold an integer of 19+ digits or nesting orjson could parse and
    :mod:`json` not (digits and brackets in strings count too: a false alarm only costs the
    slower parse). Fractions of any length are fine: both parse them the same (correctly
    rounded)."""
    digits = data.translate(_DIGITS)
    if len(digits) > 2 * MAX_BRACKETS and digits.count(b"[") > MAX_BRACKETS:  # (a shorter text
        return True  # cannot nest that deep)
    i = digits.find(_LONG_INT)  # always the start of a run of digits
    while i >= 0:
        if i == 0 or digits[i - 1] != 0x2E:  # not after ".": an integer, exponent or text
            return True
        i += 19
        while i < len(digits) and digits[i] == 0x30:  # the rest of this fraction
            i += 1
        i = digits.find(_LONG_INT, i)
    return False


def loads(data: bytes) -> Any:
    """``json.loads(data.decode("utf-8"))``, faster."""
    if FAST and not _for_json(data):
        try:
            return _orjson.loads(data)  # type: ignore[union-attr]
        except ValueError:  # orjson.JSONDecodeError: json decides (and words the error)
            pass
    return _std_loads(data.decode("utf-8"))


def loads_flagged(data: bytes) -> tuple[Any, bool]:
    """``(loads(data), whether orjson parsed it)``: only orjson's values may go to
    :func:`dumps_loaded`."""
    if FAST and not _for_json(data):
        try:
            return _orjson.loads(data), True  # type: ignore[union-attr]
        except ValueError:
            pass
    return _std_loads(data.decode("utf-8")), False


def dumps_loaded(value: Any, by_orjson: bool) -> str:
    """Compact JSON text of a value :func:`loads_flagged` returned (``by_orjson``: its flag).

    Reads back (with :func:`loads` or :func:`json.loads`) as an equal value.
    """
    if by_orjson and FAST:
        return _orjson.dumps(value).decode()  # type: ignore[union-attr]
    return _std_dumps(value)

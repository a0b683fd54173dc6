"""`cache._json`: orjson's speed where it is installed, with exactly :mod:`json`'s results.

``loads(data)`` must return what ``json.loads(data.decode("utf-8"))`` returns (same types, same
order, NaN included) and fail where it fails, with the same error; ``dumps_loaded`` must write
text that reads back as the same value. Checked on generated documents and on mutated text.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import _json


def _outcome(parse, data: bytes) -> tuple:
    """What parsing gives, comparable across parsers: ``repr`` tells 1 / 1.0 / True and -0.0
    apart and shows key order."""
    try:
        return ("ok", repr(parse(data)))
    except RecursionError:
        return ("recursion",)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        return ("error", type(exc).__name__, str(exc))


def _std(data: bytes):
    return json.loads(data.decode("utf-8"))


def assert_same(data: bytes) -> None:
    assert _outcome(_json.loads, data) == _outcome(_std, data)
    flagged = _outcome(lambda d: _json.loads_flagged(d)[0], data)
    assert flagged == _outcome(_std, data)


scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
    | st.floats() | st.floats(-1e-3, 1e-3) | st.text(max_size=8)
)  # fmt: skip
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=24,
)  # fmt: skip


@settings(max_examples=400, deadline=None, database=None)
@given(value=documents, ascii_only=st.booleans())
def test_loads_matches_json_on_generated_documents(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert_same(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=400, deadline=None, database=None)
@given(value=documents,
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)), max_size=4))
def test_loads_matches_json_on_mutated_text(value, edits):
    data = bytearray(json.dumps(value).encode())
    for at, new in edits:  # replace one byte with 0..3 others: broken syntax, bad UTF-8...
        at %= len(data) + 1
        data[at : at + 1] = new
    assert_same(bytes(data))


@pytest.mark.parametrize("text", [
    "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
    "18446744073709551615", "18446744073709551616", "123456789012345678901234567890",
    '{"observed": 123456789012345678901234567890, "x": 0.1}',
    "0.00012345678901234567890123", "1234567890123456789.5", "1e400", "-1e400", "1e-400",
    "1.7976931348623157e308", "1.7976931348623159e308", "NaN", "-Infinity", "[NaN, 1]",
    '"\\ud800"', '"\\udc00\\ud800"', '{"a": 1, "b": 2, "a": 3}', "-0", "-0.0", "1E5", "01",
    "[1,]", "", " ", "\ufeff1", '"\x1f"', '"\x7f"', "tru", "1 2", '{"a":1}x',
])  # fmt: skip
def test_loads_matches_json_on_edge_cases(text):
    assert_same(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("depth", [31, 33, 255, 257, 300, 990, 5000, 100_000])
@pytest.mark.parametrize("bracket", ["[", '{"a":'])
def test_loads_matches_json_on_deep_nesting(depth, bracket):
    close = "]" if bracket == "[" else "}"
    assert_same((bracket * depth + "1" + close * depth).encode())


def test_invalid_utf8_is_json_s_error():
    assert_same(b'{"a": "\xff"}')
    assert_same(b'"\xed\xa0\x80"')  # a UTF-8-encoded surrogate


@settings(max_examples=300, deadline=None, database=None)
@given(value=documents)
def test_dumps_loaded_reads_back_the_same_value(value):
    data = json.dumps(value).encode("utf-8", "surrogatepass")
    try:
        loaded, flag = _json.loads_flagged(data)
    except ValueError:
        return
    text = _json.dumps_loaded(loaded, flag)
    assert repr(json.loads(text)) == repr(loaded)
    if not flag:  # the standard library wrote it: the store's own form
        assert text == json.dumps(loaded, separators=(",", ":"))


def test_long_integers_and_deep_nesting_go_to_json():
    assert _json.loads_flagged(b'{"n": 12345678901234567890123}') == (
        {"n": 12345678901234567890123}, False)  # fmt: skip
    assert _json.loads_flagged(b"[" * 300 + b"]" * 300)[1] is False
    if _json.FAST:
        assert _json.loads_flagged(b'{"t": 0.00012345678901234567890123}')[1] is True


def test_without_orjson_everything_is_json(monkeypatch):
    monkeypatch.setattr(_json, "FAST", False)
    assert _json.loads_flagged(b'{"a": [1, 2.5, null]}') == ({"a": [1, 2.5, None]}, False)
    assert _json.dumps_loaded({"a": float("nan")}, True) == '{"a":NaN}'  # flag ignored
    assert_same(b"[1, 2")

"""The import's quick row check is the full check, only faster.

``rows._row_ok`` / ``_result_ok`` may only accept what the full checks (``_row_problem`` /
``_result_problem``, which end with ``ProbeResult.from_dict``) accept, and the
import (``reader._parse_flagged`` + ``rows.validate_parsed``) must give exactly what
``json.loads`` + the full checks give: the same rejections with the same reasons, the same
rows. Checked on generated rows, valid and broken in every field.
"""

from __future__ import annotations

import copy
import json
import zlib

from cache_testutil import key
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import reader
from te_fl_attention.cache import rows as codec
from te_fl_attention.cache.keys import CacheKey, known_backends
from te_fl_attention.cache.rows import CacheRow, make_row
from te_fl_attention.reasons import ProbeResult, Reason

HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=6,
)  # fmt: skip
free = st.recursive(  # what observed / limit / detail values may be (JSON: finite numbers)
    st.none() | st.booleans() | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8,
)  # fmt: skip


def nested(depth: int, leaf: object = 1) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


deep = st.integers(25, 36).map(nested)  # around MAX_DEPTH (32), wherever it sits


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly ``strategy``, sometimes a value of any type."""
    return st.one_of(strategy, strategy, strategy, anything)


reason = st.fixed_dictionaries(
    {"code": maybe(st.text(max_size=8)), "message": maybe(st.text(max_size=12))},
    optional={"stage": maybe(st.text(max_size=6)), "observed": free | deep,
              "limit": free | deep, "hint": maybe(st.none() | st.text(max_size=6)),
              "bogus": anything},
)  # fmt: skip


def results(variants: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"backend": maybe(st.sampled_from(known_backends())), "supported": maybe(st.booleans())},
        optional={
            "reasons": maybe(st.lists(maybe(reason), max_size=2)),
            "stage": maybe(st.text(max_size=6)),
            "evidence": maybe(st.text(max_size=6)),
            "elapsed_ms": maybe(st.floats(allow_nan=False) | st.integers(-(2**54), 2**54)),
            "detail": maybe(st.dictionaries(st.text(max_size=4), free | deep, max_size=3)),
            "variants": variants,
            "exec": anything,
        },
    )  # fmt: skip


leaf_result = results(maybe(st.lists(anything, max_size=1)))
result = results(maybe(st.lists(maybe(leaf_result), max_size=3)))
flat = st.dictionaries(st.text(max_size=6), maybe(st.none() | st.integers() | st.text(max_size=4)
                                                   | st.lists(st.integers(), max_size=2)),
                       max_size=5)  # fmt: skip


@st.composite
def rows(draw: st.DrawFn) -> dict:
    res = draw(maybe(result))
    backend = res.get("backend") if isinstance(res, dict) else None
    row = {
        "config_key": draw(maybe(HEX)),
        "backend": draw(st.one_of(st.just(backend), maybe(st.sampled_from(known_backends())))),
        "device_fp": draw(maybe(HEX)),
        "versions_key": draw(maybe(HEX)),
        "result": res,
    }
    optional = {"config": maybe(st.none() | flat), "device": maybe(st.none() | flat),
                "created_at": maybe(st.floats(0, 2e11) | st.integers(-5, 2**60)),
                "package_version": maybe(st.text(max_size=6) | st.just("v" * 129)),
                "extra": anything}  # fmt: skip
    for name, strategy in optional.items():
        if draw(st.booleans()):
            row[name] = draw(strategy)
    for name in draw(st.lists(st.sampled_from(sorted(codec._ROW_REQUIRED)), max_size=1)):
        del row[name]  # sometimes a required field is missing
    return row


def _strict() -> st.SearchStrategy:
    """Rows that are valid in every field."""
    reason_ok = st.fixed_dictionaries({"code": st.text(max_size=8), "message": st.text()},
                                      optional={"stage": st.text(max_size=5), "observed": free,
                                                "limit": free,
                                                "hint": st.none() | st.text(max_size=5)})
    reasons_ok = st.lists(reason_ok, min_size=1, max_size=2) | st.just([])
    leaf = st.fixed_dictionaries(
        {"backend": st.sampled_from(known_backends()), "supported": st.booleans()},
        optional={"reasons": reasons_ok, "stage": st.text(max_size=5),
                  "evidence": st.text(max_size=5), "elapsed_ms": st.floats(0, 1e6),
                  "detail": st.dictionaries(st.text(max_size=4), free, max_size=3)},
    )  # fmt: skip
    top = st.tuples(leaf, st.lists(leaf, max_size=3)).map(lambda t: {**t[0], "variants": t[1]})
    return st.builds(
        lambda res, ck, fp, vk, created: {"config_key": ck, "backend": res["backend"],
                                          "device_fp": fp, "versions_key": vk, "result": res,
                                          "config": {"head_dim": 128, "window": [-1, -1]},
                                          "created_at": created},
        top, HEX, HEX, HEX, st.floats(0, 1.7e9),
    )  # fmt: skip



def _odd_values(value: object) -> list:
    """Values that break ``value``'s place: another type, an edge of its range, a size limit."""
    if isinstance(value, bool):
        common = [1, 0, "true", None]
    elif isinstance(value, (int, float)):
        common = [True, "1", None, 2**53 + 1, -(2**53) - 1, 2**60, 1e300, -1.0, 1e11]
    elif isinstance(value, str):
        common = [None, 1, "A" * 64, "0" * 63, "g" * 64, "", "fused", "v" * 129, []]
    elif isinstance(value, dict):
        common = [[], None, "x", {"bogus": 1}, {"": [[[]]]}]
    elif isinstance(value, list):
        common = [{}, None, "x", [None], [[1]]]
    else:
        common = [1, "x", [], {}, True]
    return [*common, nested(31), nested(40), "x" * (codec.MAX_STRING + 1)]


def _odd(value: object) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(_odd_values(value)), anything, deep)


def _paths(value: object, path: tuple = ()) -> list[tuple]:
    """Every place in a parsed row (dict keys and list items), outermost first."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


@st.composite
def near_valid_rows(draw: st.DrawFn) -> dict:
    """A valid row with one to three defects anywhere: a value replaced by one of another type
    or size, a field removed, an unknown field added."""
    row = draw(_strict())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(row)))
        if not path:
            continue
        *head, last = path
        parent = row
        for step in head:
            parent = parent[step]
        how = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        if how == "replace":
            parent[last] = draw(_odd(parent[last]))
        elif how == "delete" and isinstance(parent, dict):
            del parent[last]
        elif isinstance(parent, dict):
            name = draw(st.sampled_from(["bogus", "exec", "stage", "hint", "config"]))
            parent[name] = draw(_odd(parent.get(name)))
    return row


def _from_dict_ok(d: object) -> bool:
    try:
        ProbeResult.from_dict(d)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001
        return False
    return True


@settings(max_examples=500, deadline=None, database=None)
@given(res=st.one_of(result, near_valid_rows().map(lambda row: row.get("result"))))
def test_quick_result_check_only_accepts_what_the_full_check_accepts(res):
    full = codec._result_problem(res)
    short = len(json.dumps(res)) <= codec.MAX_STRING  # what it assumes (see _row_ok)
    if short and codec._result_ok(res, 2):
        assert full is None
    if full is None:  # and whatever the full check accepts, from_dict takes
        assert _from_dict_ok(res)


def _fields(row: CacheRow) -> tuple:
    return (row.key, repr(row.result), row.created_at, row.package_version, repr(row.config),
            repr(row.device))  # fmt: skip


@settings(max_examples=500, deadline=None, database=None)
@given(row=st.one_of(rows(), near_valid_rows(), near_valid_rows()))
def test_import_checks_equal_json_plus_full_checks(row):
    line = json.dumps(row).encode("utf-8", "surrogatepass") + b"\n"
    obj, fast = reader._parse_flagged(line)
    size = reader._line_size(line, fast)  # what the reader passes on
    got = obj if isinstance(obj, reader._Bad) else codec.validate_parsed(obj, size, fast)
    try:  # the reference: the standard library's parse, then the full checks
        want = codec._row_problem(json.loads(line.decode("utf-8")), size)
    except ValueError:
        want = "unparsable"
    if isinstance(want, str):
        assert isinstance(got, str) and (want == "unparsable" or got == want)
        return
    assert isinstance(got, CacheRow) and _fields(got) == _fields(want)
    assert _from_dict_ok(got.result)
    if fast:  # the text that will be stored (else the store writes it, as always)
        assert got.result_json is not None
        assert repr(json.loads(got.result_json)) == repr(got.result)
    else:
        assert got.result_json is None


@settings(max_examples=300, deadline=None, database=None)
@given(row=_strict())
def test_valid_rows_take_the_quick_path(row):
    line = json.dumps(row).encode() + b"\n"
    obj, fast = reader._parse_flagged(line)
    assert codec._row_ok(obj)
    size = reader._line_size(line, fast)
    got = codec.validate_parsed(obj, size, fast)
    assert isinstance(got, CacheRow)
    assert _fields(got) == _fields(codec._row_problem(json.loads(line), size))


def _judged_alike(row: object) -> None:
    line = json.dumps(row).encode("utf-8", "surrogatepass") + b"\n"
    obj, fast = reader._parse_flagged(line)
    size = reader._line_size(line, fast)
    got = codec.validate_parsed(obj, size, fast)
    want = codec._row_problem(json.loads(line), size)
    if isinstance(want, str):
        assert got == want
    else:
        assert isinstance(got, CacheRow) and _fields(got) == _fields(want)
    res = obj.get("result") if isinstance(obj, dict) else None
    if len(line) <= codec.MAX_STRING and codec._result_ok(res, 2):  # (it assumes short
        assert codec._result_problem(res) is None and _from_dict_ok(res)  # strings)


def _base_rows() -> list[dict]:
    reason = Reason("sm.unsupported", "needs sm90", "import", observed=[80, {"x": 1}],
                    limit=90, hint="use fa2")  # fmt: skip
    flash = ProbeResult("flash", True, (reason,), detail={"variant": "fa2", "n": [1, 2]},
                        elapsed_ms=0.5, variants=(
                            ProbeResult("fa2", True, elapsed_ms=0.25, detail={"v": "2.8"}),
                            ProbeResult("fa3", False, (reason,), stage="import"),
                        ))  # fmt: skip
    fused = ProbeResult("fused", False, (reason,), stage="graph_build", evidence="cudnn",
                        elapsed_ms=3, detail={"plans": {"fwd": ["eng0"]}, "sub_backend": 1})
    out = []
    for i, res in enumerate((flash, fused)):
        row = make_row(key(i, res.backend), res, {"head_dim": 128, "window": [-1, -1]},
                       {"name": "h100", "sm": 90}, created_at=1000.0 + i).to_dict()
        out.append(json.loads(json.dumps(row)))
    return out


def test_every_single_defect_is_judged_like_the_full_check():
    """Each place of two rich rows, broken in each way: removed, given an unknown sibling, or
    replaced by a value of another type, at the edge of its range or over a size limit."""
    for base in _base_rows():
        _judged_alike(base)
        for path in _paths(base)[1:]:
            *head, last = path
            values = _odd_values(_get(base, path))
            for how in ["delete", "add", *range(len(values))]:
                row = copy.deepcopy(base)
                parent = _get(row, head)
                if how == "delete":
                    if not isinstance(parent, dict):
                        continue
                    del parent[last]
                elif how == "add":
                    if not isinstance(parent, dict):
                        continue
                    parent["bogus"] = 1
                else:
                    parent[last] = values[how]
                _judged_alike(row)


def _get(value: object, path) -> object:
    for step in path:
        value = value[step]
    return value


@settings(max_examples=200, deadline=None)
@given(parts=st.tuples(*[st.text(max_size=70)] * 4), result=st.text(max_size=200))
def test_the_checksum_split_after_the_key_is_the_row_checksum(parts, result):
    """A bulk check's checksum (head once per config, tail once per backend and context) is
    the one every read verifies, for any text."""
    k = CacheKey(*parts)
    data = result.encode()  # (hypothesis text has no lone surrogates)
    head, tail = codec.crc_head(k[0]), codec.crc_tail(*k[1:])
    split = zlib.crc32(data, zlib.crc32(tail, zlib.crc32(head)))
    assert split == codec.row_crc_bytes(k, data) == codec.row_crc(k, result)

"""The fast paths of the cache: ``ProbeResult.from_dict`` without the dataclass ``__init__``,
lookups that checksum and parse the stored bytes, imports that store the checked text, the
bulk writer and ``warm_up``. Each must behave exactly like the plain path it replaces."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Mapping
from typing import Any

import pytest
from cache_testutil import FP, full_result, key, result
from hypothesis import given, settings
from hypothesis import strategies as st

from te_fl_attention.cache import CacheKey, MemoryCache, ProbeCache, _json, export, import_
from te_fl_attention.cache.rows import CacheRow, make_row
from te_fl_attention.reasons import ProbeResult, Reason


# ------------------------------------------------------------------------------ from_dict
def _reason_by_init(d: Mapping[str, Any]) -> Reason:
    """``Reason.from_dict`` as it was: through the dataclass ``__init__``."""
    return Reason(code=str(d["code"]), message=str(d["message"]), stage=str(d.get("stage", "rule")),
                  observed=d.get("observed"), limit=d.get("limit"), hint=d.get("hint"))  # fmt: skip


def _result_by_init(d: Mapping[str, Any]) -> ProbeResult:
    """``ProbeResult.from_dict`` as it was: through the dataclass ``__init__``."""
    return ProbeResult(
        backend=str(d["backend"]),
        supported=bool(d["supported"]),
        reasons=tuple(_reason_by_init(r) for r in d.get("reasons", ())),
        stage=str(d.get("stage", "rule")),
        evidence=str(d.get("evidence", "rules")),
        elapsed_ms=float(d.get("elapsed_ms", 0.0)),
        detail=dict(d.get("detail") or {}),
        variants=tuple(_result_by_init(v) for v in d.get("variants", ())),
    )


RICH = ProbeResult(
    "flash", True, (Reason("a", "b", "import", observed=[1, {"x": 2}], limit=3, hint="h"),),
    stage="run", evidence="flash-attn 2.8.3", elapsed_ms=1.5, detail={"variant": "fa2"},
    variants=(ProbeResult("fa2", True, elapsed_ms=0.25),
              ProbeResult("fa3", False, (Reason("sm", "needs sm90", observed=80, limit=90),))),
)  # fmt: skip


def _same_object(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a == b and repr(a) == repr(b)
    assert list(vars(a).items()) == list(vars(b).items())  # same fields, same order


def test_from_dict_builds_what_the_constructor_builds():
    for d in (RICH.to_dict(), *(v.to_dict() for v in RICH.variants), result(3).to_dict(),
              {"backend": "unfused", "supported": 1, "elapsed_ms": 2}):  # fmt: skip
        fast, slow = ProbeResult.from_dict(d), _result_by_init(d)
        _same_object(fast, slow)
        for x, y in zip(fast.reasons, slow.reasons, strict=True):
            _same_object(x, y)
        for x, y in zip(fast.variants, slow.variants, strict=True):
            _same_object(x, y)
    got = ProbeResult.from_dict(RICH.to_dict())
    assert got == RICH and got.to_dict() == RICH.to_dict()
    reason = Reason.from_dict({"code": "c", "message": "m", "observed": 1, "limit": 2})
    assert hash(reason) == hash(Reason("c", "m", observed=1, limit=2))  # frozen: hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.backend = "fused"  # type: ignore[misc]
    assert dataclasses.replace(got, supported=False).supported is False
    assert dataclasses.asdict(got)["variants"][1]["reasons"][0]["code"] == "sm"


def test_from_dict_of_a_subclass_goes_through_its_init():
    @dataclasses.dataclass(frozen=True)
    class Checked(ProbeResult):
        def __post_init__(self) -> None:
            object.__setattr__(self, "evidence", self.evidence.upper())

    got = Checked.from_dict({"backend": "fused", "supported": True, "variants": [
        {"backend": "fa2", "supported": True}]})  # fmt: skip
    assert type(got) is Checked and got.evidence == "RULES"
    assert type(got.variants[0]) is Checked


sloppy = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["backend", "supported", "reasons", "stage", "evidence", "elapsed_ms",
                         "detail", "variants", "code", "message", "hint"]), inner, max_size=6),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=500, deadline=None, database=None)
@given(d=sloppy)
def test_from_dict_fails_where_the_constructor_failed(d):
    def outcome(fn):
        try:
            return "ok", repr(fn(d))
        except Exception as exc:  # noqa: BLE001
            return "error", type(exc)

    assert outcome(ProbeResult.from_dict) == outcome(_result_by_init)


# ------------------------------------------------------------------------------ lookups
def _raw(store: ProbeCache, sql: str, args: tuple = ()) -> list:
    conn = sqlite3.connect(store.path)
    try:
        with conn:
            return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("layout", ["full", "compact"])
@pytest.mark.parametrize("damage", ["invalid-utf8", "same-length-edit", "blob"])
def test_damaged_result_bytes_read_as_a_miss(store, damage, layout, cache_log):
    """The stored text a lookup checksums and parses: a full row's ``result``, a compact row's
    template (shared by its rows; key(2) has another)."""
    make = full_result if layout == "full" else result
    store.put(key(1), make(1))
    store.put(key(2), make(2))
    store.close()
    # key(2)'s template id, then key(1)'s
    (other,), (rid,) = _raw(store, "SELECT rid FROM probes ORDER BY config_key = ?",
                            (key(1).config_key,))  # fmt: skip
    if layout == "full":
        assert rid is None and other is None
        text = _raw(store, "SELECT result FROM probes WHERE config_key=?",
                    (key(1).config_key,))[0][0]  # fmt: skip
        where, arg = "UPDATE probes SET result={} WHERE config_key=?", key(1).config_key
    else:
        assert rid is not None and other is not None and rid != other
        text = _raw(store, "SELECT template FROM templates WHERE rid=?", (rid,))[0][0]
        where, arg = "UPDATE templates SET template={} WHERE rid=?", rid
    if damage == "invalid-utf8":
        new: Any = text.encode()[:-3] + b"\xff\xfe}"
        sql = where.format("CAST(? AS TEXT)")
    elif damage == "same-length-edit":
        new, sql = text.replace("true", "fals"), where.format("?")
        assert new != text
    else:
        new, sql = text.encode(), where.format("?")  # right bytes,
        # wrong type: damaged as before (iter_rows skips it too)
    _raw(store, sql, (new, arg))
    assert store.get(key(1)) is None and store.get_many([key(1), key(2)]) == {key(2): make(2)}
    assert store._bad_rows >= 2 and any("damaged row" in m for m in cache_log.at(30))
    assert [r.key for r in store.iter_rows()] == [key(2)]


def test_get_many_takes_plain_tuples_and_several_devices(store):
    other = CacheKey(key(1).config_key, "fused", FP, "e" * 64)
    store.put_many([(key(1), result(1)), (key(1, "flash"), result(4, "flash")),
                    (other, result(7))])  # fmt: skip
    hits = store.get_many([tuple(key(1)), key(1, "flash"), tuple(other), key(9)])
    assert hits == {key(1): result(1), key(1, "flash"): result(4, "flash"), other: result(7)}
    assert all(type(k) is CacheKey for k in hits)


def test_a_row_s_known_text_is_stored_as_is(store):
    text = json.dumps(result(1).to_dict(), separators=(", ", ": "))  # not the usual spacing
    row = dataclasses.replace(make_row(key(1), result(1)), result_json=text)
    store.put_many([row], checked=True)
    assert _raw(store, "SELECT result FROM probes")[0][0] == text
    assert store.get(key(1)) == result(1) and store.get_row(key(1)).result == result(1).to_dict()


# ------------------------------------------------------------------------------ imports
def _export_rich(store: ProbeCache, tmp_path) -> Any:
    rows = [(key(i, b), dataclasses.replace(RICH, backend=b, variants=RICH.variants if
             b == "flash" else ()), {"i": i}, {"name": "h100"})
            for i in range(30) for b in ("flash", "fused")]  # fmt: skip
    store.put_many(rows)
    path = tmp_path / "rich.jsonl"
    export(store, path)
    with open(path, "a") as f:  # and some that need the standard parser or are refused
        f.write(json.dumps({**make_row(key(99), result(99)).to_dict(),
                            "config": {"big": 2**62, "t": 0.5}}) + "\n")
        f.write('{"config_key": 1}\n[1,\n')
    return path


@pytest.mark.parametrize("fast", [True, False])
def test_import_with_and_without_orjson_is_the_same(tmp_path, monkeypatch, fast):
    if fast and not _json.FAST:
        pytest.skip("orjson is not installed")
    src = ProbeCache(tmp_path / "src.sqlite")
    path = _export_rich(src, tmp_path)
    monkeypatch.setattr(_json, "FAST", fast)
    target = ProbeCache(tmp_path / f"target-{fast}.sqlite")
    report = import_(target, path)
    assert report.imported == 61 and report.rejected == [
        (63, "missing field(s): backend, device_fp, result, versions_key"),
        (64, "not valid JSON: Expecting value: line 2 column 1 (char 4)"),
    ]
    for row in src.iter_rows():
        assert target.get(row.key) == row.probe_result
        got = target.get_row(row.key)
        assert got.config == row.config and got.device == row.device
    assert target.get_row(key(99)).config == {"big": 2**62, "t": 0.5}


def test_import_into_a_read_only_store_keeps_rows_in_memory(tmp_path):
    src = ProbeCache(tmp_path / "src.sqlite")
    path = _export_rich(src, tmp_path)
    ProbeCache(tmp_path / "ro.sqlite").put(key(1000), result(1000))
    ro = ProbeCache(tmp_path / "ro.sqlite", readonly=True)
    report = import_(ro, path)  # kept in memory, and reported as not written (issue 12)
    assert report.imported == 0 and report.not_written == 61 and ro.mode == "ro"
    assert "NOT written 61" in str(report)
    for row in src.iter_rows():
        assert ro.get(row.key) == row.probe_result
        assert ro.get_row(row.key).config == row.config
    assert ro.get(key(1000)) == result(1000)  # the file is still read


def test_import_into_memory_cache_matches(tmp_path):
    src = ProbeCache(tmp_path / "src.sqlite")
    path = _export_rich(src, tmp_path)
    mem = MemoryCache()
    assert import_(mem, path).imported == 61
    assert all(mem.get(row.key) == row.probe_result for row in src.iter_rows())


# ------------------------------------------------------------------------------ warm_up
def test_warm_up_reads_no_row_and_is_safe_anywhere(tmp_path, cache_log):
    store = ProbeCache(tmp_path / "s.sqlite")
    store.warm_up()  # creates the store
    store.put(key(1), result(1))
    store.warm_up()
    assert store.get(key(1)) == result(1) and store._bad_rows == 0
    missing = ProbeCache(tmp_path / "missing.sqlite", readonly=True)
    missing.warm_up()
    assert missing.mode == "memo" and missing._bad_rows == 0
    MemoryCache().warm_up()
    assert not cache_log.at(30)


def test_cache_row_result_json_is_not_compared():
    row = make_row(key(1), result(1))
    assert dataclasses.replace(row, result_json="{}") == row
    assert "result_json" not in repr(row) and "result_json" not in row.to_dict()
    assert isinstance(row, CacheRow)

"""Issue 12, the cache side: one validator for every row from outside (import, merge), no write
reported that did not happen, and the storage edges of moving rows (a device or FIFO as the
source, full disks, damaged stores). The store's own storage edges (a FIFO at its path,
symlinks, permissions, umask, a full disk under it) are in test_lifecycle.py."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from cache_testutil import key, result, run_cli

from te_fl_attention.cache import ProbeCache, export, import_, merge
from te_fl_attention.cache.memory import MemoryCache
from te_fl_attention.cli import cache as cmd


class Out(list):
    def __call__(self, text: str) -> None:
        self.append(str(text))


def _export(tmp_path: Path, n: int = 5, name: str = "e.jsonl") -> Path:
    src = ProbeCache(tmp_path / f"src-{name}.sqlite")
    src.put_many([(key(i), result(i), {"i": i}, {"name": "h100"}) for i in range(n)])
    path = tmp_path / name
    export(src, path)
    src.close()
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ bullet 1: the validator
@pytest.mark.parametrize("where, value", [
    ("result.elapsed_ms", "9" * 400),   # a 400-digit number
    ("result.elapsed_ms", "1e400"),     # Infinity
    ("result.elapsed_ms", "-1"),
    ("result.detail", '{"x": NaN}'),
    ("result.supported", '"false"'),    # not a boolean
    ("created_at", "4102444800"),       # 2100-01-01: in the future
])  # fmt: skip
def test_import_rejects_unbounded_numbers_fake_booleans_and_future_rows(tmp_path, where, value,
                                                                        cache_log):  # fmt: skip
    path = _export(tmp_path, 3)
    header, *rows = path.read_text().splitlines()
    obj = json.loads(rows[1])
    parts = where.split(".")
    target = obj if len(parts) == 1 else obj[parts[0]]
    target[parts[-1]] = "@@@"
    rows[1] = json.dumps(obj).replace('"@@@"', value)
    path.write_text("\n".join([header, *rows]) + "\n")
    store = ProbeCache(tmp_path / "t.sqlite")
    report = import_(store, path)
    assert report.imported == 2 and len(report.rejected) == 1, report
    assert report.rejected[0][0] == 3
    assert [m for m in cache_log.at(logging.WARNING) if "rejected" in m] != []
    assert len(store) == 2


def test_imported_strings_are_cleaned_of_control_characters_and_lone_surrogates(tmp_path):
    path = _export(tmp_path, 1)
    header, row = path.read_text().splitlines()
    obj = json.loads(row)
    obj["result"]["evidence"] = "a\x1b[31mred\x07\u009b\x7f\ud800 z\ttab\nnl"
    obj["result"]["detail"] = {"k\x00": ["\udfff"]}
    path.write_text(header + "\n" + json.dumps(obj) + "\n")
    store = ProbeCache(tmp_path / "t.sqlite")
    assert import_(store, path).imported == 1
    got = store.get(key(0))
    assert got.evidence == "a\ufffd[31mred\ufffd\ufffd\ufffd\ufffd z\ttab\nnl"
    assert got.detail == {"k\ufffd": ["\ufffd"]}


def test_merge_cannot_be_won_by_a_far_future_row(tmp_path):
    a = _export(tmp_path, 3, "a.jsonl")
    rows = _lines(a)
    forged = dict(rows[1])
    forged["result"] = {**forged["result"], "supported": not forged["result"]["supported"]}
    forged["created_at"] = time.time() + 100 * 365 * 86400
    b = _write_lines(tmp_path / "b.jsonl", [rows[0], forged])
    report = merge(a, b, tmp_path / "m.jsonl")
    assert report.conflicts == 0 and len(report.rejected) == 1
    assert "in the future" in report.rejected[0][2]
    merged = {r["config_key"]: r for r in _lines(tmp_path / "m.jsonl")[1:]}
    assert merged[rows[1]["config_key"]]["result"] == rows[1]["result"]


def test_a_small_clock_skew_is_accepted(tmp_path):
    path = _export(tmp_path, 1)
    header, row = path.read_text().splitlines()
    obj = json.loads(row)
    obj["created_at"] = time.time() + 60
    path.write_text(header + "\n" + json.dumps(obj) + "\n")
    assert import_(ProbeCache(tmp_path / "t.sqlite"), path).imported == 1


# ------------------------------------------------------------------ bullet 2: no false reports
def test_cli_import_into_a_read_only_store_fails_before_the_work(tmp_path):
    path = _export(tmp_path)
    store = tmp_path / "c" / "probes.sqlite"
    store.parent.mkdir()
    ProbeCache(store).put(key(100), result(100))
    proc = run_cli(["cache", "import", str(path)],
                {"TE_FL_ATTN_CACHE": str(store), "TE_FL_ATTN_CACHE_READONLY": "1"})  # fmt: skip
    assert proc.returncode == 1, proc
    assert "read-only" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(line.startswith("imported") for line in proc.stdout.splitlines())
    assert len(ProbeCache(store, readonly=True)) == 1


def test_cli_import_into_an_unwritable_cache_fails(tmp_path):
    path = _export(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli(["cache", "import", str(path)], {"TE_FL_ATTN_CACHE": str(blocker / "p.sqlite")})
    assert proc.returncode == 1, proc
    assert "cannot be written" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(line.startswith("imported") for line in proc.stdout.splitlines())


def test_import_with_a_full_disk_reports_no_rows_it_did_not_store(tmp_path):
    path = _export(tmp_path, 2000)
    store = ProbeCache(tmp_path / "full.sqlite")
    store.put(key(99999), result(1))
    conn = store._connection()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages + 2}")  # the disk is full after 2 more pages
    out = Out()
    assert cmd.cmd_import(str(path), out, cache=store) == 1
    text = "\n".join(out)
    assert "could not be written" in text and "full" in text
    assert not any(line.startswith("imported 2000") for line in out)
    assert store.get(key(99999)) == result(1)  # what was stored is still served
    check = ProbeCache(tmp_path / "full.sqlite", readonly=True)
    stored = len(check)
    check.close()
    report_line = next(line for line in out if line.startswith("imported"))
    assert report_line.startswith(f"imported {stored - 1},")  # only what reached the file


def test_cli_import_on_a_really_full_disk_exits_nonzero(tmp_path, small_disk):
    path = _export(tmp_path, 5000)
    store = small_disk / "probes.sqlite"
    proc = run_cli(["cache", "import", str(path)], {"TE_FL_ATTN_CACHE": str(store)}, timeout=120)
    assert proc.returncode == 1, proc
    assert "could not be written" in proc.stderr and "NOT written 5000" in proc.stdout
    assert "imported 5000" not in proc.stdout and "Traceback" not in proc.stderr


def test_merge_output_under_a_file_is_refused_before_the_work(tmp_path, monkeypatch):
    a, b = _export(tmp_path, 3, "a.jsonl"), _export(tmp_path, 3, "b.jsonl")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    from te_fl_attention.cache import transfer

    monkeypatch.setattr(transfer, "_merge_into", lambda *a, **k: pytest.fail("work started"))
    out = Out()
    assert cmd.cmd_merge(str(a), str(b), str(blocker / "m.sqlite"), out) == 1
    assert "not a directory" in out[0] and not any("wrote" in line for line in out)


def test_a_failed_merge_leaves_nothing_and_the_retry_works(tmp_path, monkeypatch):
    a, b = _export(tmp_path, 3, "a.jsonl"), _export(tmp_path, 3, "b.jsonl")
    outdir = tmp_path / "out"
    outdir.mkdir()
    from te_fl_attention.cache import transfer

    real = transfer._merge_batch
    calls = []

    def failing(store, batch, report):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(store, batch, report)

    monkeypatch.setattr(transfer, "_merge_batch", failing)
    for name in ("m.sqlite", "m.jsonl"):
        calls.clear()
        assert cmd.cmd_merge(str(a), str(b), str(outdir / name), Out()) == 1
        assert list(outdir.iterdir()) == []  # no partial output, no *.lock, no temp dir
    monkeypatch.setattr(transfer, "_merge_batch", real)
    for name in ("m.sqlite", "m.jsonl"):
        out = Out()
        assert cmd.cmd_merge(str(a), str(b), str(outdir / name), out) == 0, out
    assert sorted(p.name for p in outdir.iterdir()) == ["m.jsonl", "m.sqlite"]
    assert len(ProbeCache(outdir / "m.sqlite", readonly=True)) == 3


def test_a_failed_export_leaves_no_partial_file(tmp_path, monkeypatch):
    store = ProbeCache(tmp_path / "s.sqlite")
    store.put_many([(key(i), result(i)) for i in range(3)])
    from te_fl_attention.cache import transfer

    def broken(cache, f, device_fp):
        f.write("partial\n")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transfer, "_export_to", broken)
    out = Out()
    (tmp_path / "x").mkdir()
    assert cmd.cmd_export(str(tmp_path / "x" / "e.jsonl"), out, cache=store) == 1
    assert list((tmp_path / "x").iterdir()) == []


# ------------------------------------------------------------------ bullet 3: storage edges


def test_importing_a_device_or_fifo_is_an_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for src in ("/dev/zero", str(tmp_path / "fifo")):
        proc = run_cli(["cache", "import", src],
                    {"TE_FL_ATTN_CACHE": str(tmp_path / "probes.sqlite")}, timeout=60)  # fmt: skip
        assert proc.returncode == 1, proc
        assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(OSError, match="not a regular file"):
        merge("/dev/zero", "/dev/zero", tmp_path / "m.sqlite")


def _warnings(cache_log) -> list[str]:
    return cache_log.at(logging.WARNING)


def test_memory_cache_import_is_not_reported_as_stored_by_therun_cli(tmp_path):
    out = Out()
    assert cmd.cmd_import(str(_export(tmp_path)), out, cache=MemoryCache()) == 1
    assert "TE_FL_ATTN_CACHE=off" in out[0]


def _damage_a_table_page(path: Path) -> bytes:
    """Overwrite the middle of a b-tree page past the schema page: the file still opens and
    validates, but ``quick_check`` fails."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    n = len(data) // page
    for i in range(2, n):
        start = i * page + 200
        data[start:start + 400] = os.urandom(400)
    path.write_bytes(bytes(data))
    return bytes(data)


def test_a_store_failing_its_integrity_check_is_quarantined_not_written(tmp_path, cache_log):
    path = tmp_path / "c" / "probes.sqlite"
    path.parent.mkdir()
    store = ProbeCache(path)
    store.put_many([(key(i), result(i), {"i": i}, {"name": "h100"}) for i in range(300)])
    store.checkpoint()
    store.close()
    damaged = _damage_a_table_page(path)
    src = _export(tmp_path, 5)
    store = ProbeCache(path)
    out = Out()
    assert cmd.cmd_import(str(src), out, cache=store) == 0, out
    moved = sorted(path.parent.glob("probes.sqlite.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == damaged  # never written again
    assert any("integrity check failed" in m for m in _warnings(cache_log))
    assert len(store) == 5 and store.mode == "rw"
    store.close()
    assert len(ProbeCache(path, readonly=True)) == 5


def test_a_damaged_store_as_import_source_is_rejected(tmp_path):
    path = tmp_path / "other.sqlite"
    store = ProbeCache(path)
    store.put_many([(key(i), result(i)) for i in range(300)])
    store.checkpoint()
    store.close()
    _damage_a_table_page(path)
    report = import_(ProbeCache(tmp_path / "t.sqlite"), path)
    assert report.imported == 0 and "integrity check failed" in report.rejected[0][1]


def test_prune_cannot_be_dodged_by_a_far_future_row(store):
    from te_fl_attention.cache.rows import make_row

    future = make_row(key(1), result(1), created_at=time.time() + 10 * 365 * 86400)
    store.put_many([future, make_row(key(2), result(2))])
    assert store.prune(older_than_s=86400) == 1
    assert store.get(key(1)) is None and store.get(key(2)) == result(2)


def test_prune_and_clear_on_a_read_only_store_fail_with_the_reason(tmp_path):
    path = tmp_path / "p.sqlite"
    ProbeCache(path).put(key(1), result(1))
    ro = ProbeCache(path, readonly=True)
    for run in (lambda out: cmd.cmd_prune(out, older_than=1, cache=ro),
                lambda out: cmd.cmd_clear(out, yes=True, cache=ro)):  # fmt: skip
        out = Out()
        assert run(out) == 1 and "read-only" in out[0], out
    assert len(ProbeCache(path, readonly=True)) == 1


def test_export_output_path_is_checked_before_the_work(tmp_path, monkeypatch):
    store = ProbeCache(tmp_path / "s.sqlite")
    store.put_many([(key(i), result(i)) for i in range(3)])
    from te_fl_attention.cache import transfer

    def never(*a, **k):
        raise AssertionError("the export ran although its output path cannot be written")

    monkeypatch.setattr(transfer, "_export_to", never)
    (tmp_path / "file").write_text("")
    for target, why in ((tmp_path / "file" / "e.jsonl", "is not a directory"),
                        (tmp_path / "none" / "e.jsonl", "does not exist")):  # fmt: skip
        out = Out()
        assert cmd.cmd_export(str(target), out, cache=store) == 1
        assert why in "\n".join(out)

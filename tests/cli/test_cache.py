"""The ``te-fl-attn cache`` subcommand functions (cli/cache.py) and their argparse wiring."""

from __future__ import annotations

import argparse
import json

import pytest
from cache_testutil import key, result

from te_fl_attention.cache import MemoryCache, ProbeCache, default_cache
from te_fl_attention.cli import cache as cmd
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile

pytestmark = pytest.mark.usefixtures("isolated_cache")


class Out(list):
    def __call__(self, text: str) -> None:
        self.append(text)

    @property
    def text(self) -> str:
        return "\n".join(self)


@pytest.fixture
def filled(store):
    cfg = FusedAttnConfig(num_heads=8, head_dim_qk=64)
    dev = profile("h100")
    for backend in ("fused", "flash", "unfused"):
        store.put(key(0, backend)._replace(config_key=cfg.key()), result(3, backend),
                  config=cfg, device=dev)  # fmt: skip
    for i in range(1, 6):
        store.put(key(i), result(i), device={"name": "h100"})
    return store, cfg


def test_parse_duration():
    assert cmd.parse_duration("30d") == 30 * 86400
    assert cmd.parse_duration("90m") == 5400 and cmd.parse_duration("12h") == 43200
    assert cmd.parse_duration("15") == 15 and cmd.parse_duration("2.5s") == 2.5
    for bad in ("", "d", "3w", "-1d", "1 day"):
        with pytest.raises(argparse.ArgumentTypeError):
            cmd.parse_duration(bad)


def test_path(store):
    out = Out()
    assert cmd.cmd_path(out, cache=store) == 0 and out == [str(store.path)]
    out = Out()
    assert cmd.cmd_path(out, cache=MemoryCache()) == 0 and out[0].startswith("off")


def test_stats(filled):
    store, _ = filled
    out = Out()
    assert cmd.cmd_stats(out, cache=store) == 0
    assert "entries" in out.text and "h100" in out.text
    out = Out()
    assert cmd.cmd_stats(out, as_json=True, cache=store) == 0
    data = json.loads(out.text)
    assert data["entries"] == 8 and data["by_backend"]["fused"] == 6
    out = Out()
    assert cmd.cmd_stats(out, tty=True, cache=store) == 0
    assert "probe cache" in out.text and "┃" in out.text  # a rich table


def test_list(filled):
    store, _ = filled
    out = Out()
    assert cmd.cmd_list(out, limit=3, cache=store) == 0
    assert len(out) == 4 and out[0].startswith("config\tbackend")
    out = Out()
    assert cmd.cmd_list(out, limit=0, backend="flash", as_json=True, cache=store) == 0
    rows = json.loads(out.text)
    assert [r["backend"] for r in rows] == ["flash"]
    out = Out()
    assert cmd.cmd_list(out, tty=True, cache=store) == 0 and "most recent" in out.text


def test_show(filled):
    store, cfg = filled
    out = Out()
    assert cmd.cmd_show(cfg.key()[:8], out, cache=store) == 0
    assert out[0] == f"config {cfg.key()}" and "note" not in out.text
    assert "fused: " in out.text and "head_dim.too_large" in out.text
    out = Out()
    assert cmd.cmd_show(cfg.key().upper(), out, as_json=True, cache=store) == 0
    data = json.loads(out.text)
    assert data["config_check"] == "ok" and len(data["rows"]) == 3
    assert cmd.cmd_show("abc", Out(), cache=store) == 2  # too short
    assert cmd.cmd_show("zzzzzzzzzz", Out(), cache=store) == 2  # not hex
    assert cmd.cmd_show("0" * 10, Out(), cache=store) == 1  # nothing there
    # an ambiguous prefix
    store.put(key(0)._replace(config_key=cfg.key()[:8] + "0" * 56), result(1))
    store.put(key(0)._replace(config_key=cfg.key()[:8] + "1" * 56), result(1))
    out = Out()
    assert cmd.cmd_show(cfg.key()[:8], out, cache=store) == 2 and "matches 3 configs" in out[0]


#: A device name a hostile or damaged store could hold: an OSC title, BEL, a colour, rich markup.
_HOSTILE_NAME = "\x1b]0;pwned\x07\x1b[31m[bold]x[/bold]"


def test_stats_list_and_show_print_no_stored_control_sequence(filled, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich tables wide enough that no cell is folded
    store, cfg = filled
    store.run(lambda c: c.execute("UPDATE contexts SET device = ?",  # behind the checks' back
                                  (json.dumps({"name": _HOSTILE_NAME}),)),
              write=True, miss=None)  # fmt: skip
    shown = []
    for call in (lambda o: cmd.cmd_stats(o, cache=store), lambda o: cmd.cmd_list(o, cache=store),
                 lambda o: cmd.cmd_show(cfg.key(), o, cache=store),
                 lambda o: cmd.cmd_stats(o, tty=True, cache=store),
                 lambda o: cmd.cmd_list(o, tty=True, cache=store)):  # fmt: skip
        out = Out()
        assert call(out) == 0
        shown.append(out.text)
    for text in shown[:3]:  # plain text: no control character at all
        assert "\x1b" not in text and "\x07" not in text
        assert "\\x1b]0;pwned\\x07" in text  # shown, escaped
    for text in shown[3:]:  # rich tables (their own colours): the name escaped, markup literal
        assert "\x07" not in text and "\x1b]0" not in text and "\\x1b]0;pwned" in text
        assert "[bold]x[/bold]" in text  # printed, not taken as markup


def test_refusals_and_file_names_are_printed_escaped(filled, tmp_path, capsys):
    import sqlite3

    store, _ = filled
    path = tmp_path / "rows.pack"
    assert cmd.cmd_export(str(path), Out(), fmt="sqlite") == 0
    conn = sqlite3.connect(path)
    conn.execute(f'CREATE TABLE "x{_HOSTILE_NAME}" (a)')  # a name the refusal quotes
    conn.commit()
    conn.close()
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    out = Out()
    assert cmd.cmd_import(str(path), out, cache=fresh) == 1
    assert "unexpected schema objects: table x\\x1b]0;pwned\\x07" in out.text
    assert "\x1b" not in out.text and "\x07" not in out.text
    missing = str(tmp_path / "a\x1b[31mb")
    assert cmd.cmd_import(missing, print, cache=fresh) == 1  # to stderr
    err = capsys.readouterr().err
    assert "cannot read" in err and "a\\x1b[31mb" in err and "\x1b" not in err


def test_export_import_merge(filled, tmp_path):
    store, _ = filled
    out = Out()
    assert cmd.cmd_export(str(tmp_path / "e.jsonl"), out, cache=store) == 0
    assert out == [f"exported 8 rows to {tmp_path / 'e.jsonl'}"]
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    out = Out()
    assert cmd.cmd_import(str(tmp_path / "e.jsonl"), out, cache=fresh) == 0
    assert out[0].startswith("imported 8, skipped 0")
    out = Out()
    assert cmd.cmd_import(str(tmp_path / "e.jsonl"), out, as_json=True, cache=fresh) == 0
    assert json.loads(out.text)["skipped"] == 8
    (tmp_path / "bad.jsonl").write_text("nonsense\n")
    out = Out()
    assert cmd.cmd_import(str(tmp_path / "bad.jsonl"), out, cache=fresh) == 1
    assert "rejected" in out.text
    assert cmd.cmd_import(str(tmp_path / "missing.jsonl"), Out(), cache=fresh) == 1
    out = Out()
    assert cmd.cmd_merge(str(tmp_path / "e.jsonl"), str(fresh.path),
                         str(tmp_path / "m.sqlite"), out) == 0  # fmt: skip
    assert "wrote 8 rows" in out[0]
    out = Out()
    assert cmd.cmd_merge(str(tmp_path / "e.jsonl"), str(fresh.path),
                         str(tmp_path / "m.sqlite"), out) == 1  # fmt: skip
    assert "already exists" in out[0]


def test_export_import_merge_of_sqlite_packs(filled, tmp_path):
    store, _ = filled
    out = Out()
    pk = tmp_path / "e.pack"
    assert cmd.cmd_export(str(pk), out, fmt="sqlite", cache=store) == 0
    assert out == [f"exported 8 rows to {pk}"]
    out = Out()
    assert cmd.cmd_export(str(pk), out, fmt="sqlite", cache=store) == 1  # a new file only
    assert "already exists" in out.text
    assert cmd.cmd_export(str(pk), Out(), fmt="xml", cache=store) == 2
    fresh = ProbeCache(tmp_path / "fresh.sqlite")
    out = Out()
    assert cmd.cmd_import(str(pk), out, cache=fresh) == 0
    assert out[0].startswith("imported 8, skipped 0")
    out = Out()
    assert cmd.cmd_import(str(pk), out, as_json=True, cache=fresh) == 0
    assert json.loads(out.text)["skipped"] == 8
    out = Out()
    assert cmd.cmd_merge(str(pk), str(fresh.path), str(tmp_path / "m.sqlite"), out) == 0
    assert "wrote 8 rows" in out[0] and "8 duplicates" in out[0]
    import sqlite3

    conn = sqlite3.connect(pk)
    conn.execute("CREATE TRIGGER t AFTER INSERT ON meta BEGIN DELETE FROM meta; END")
    conn.commit()
    conn.close()
    out = Out()
    assert cmd.cmd_import(str(pk), out, cache=ProbeCache(tmp_path / "f2.sqlite")) == 1
    assert "refusing the pack" in out.text and "trigger t" in out.text
    assert "nothing was imported" in out.text


def test_prune_and_clear(filled, monkeypatch):
    store, _ = filled
    assert cmd.cmd_prune(Out(), cache=store) == 2
    assert cmd.cmd_prune(Out(), not_version="nope", cache=store) == 2
    out = Out()
    assert cmd.cmd_prune(out, older_than=3600, cache=store) == 0 and out == ["pruned 0 rows"]
    from te_fl_attention.selector import default_selector

    # "current": what this installation writes now for a catalog GPU (or the local machine)
    current = default_selector().keys.versions(profile("h100"))
    store.put(key(99)._replace(versions_key=current), result(99))
    staged = default_selector().keys.versions(profile("h100"), "verify")  # a verify-stage row
    store.put(key(98)._replace(versions_key=staged), result(98))
    out = Out()
    assert cmd.cmd_prune(out, not_version="current", cache=store) == 0
    assert out == ["pruned 8 rows"] and len(store) == 2
    out = Out()
    assert cmd.cmd_clear(out, cache=store) == 2 and "without --yes" in out[0]
    out = Out()
    assert cmd.cmd_clear(out, yes=True, cache=store) == 0 and out == ["cleared 2 rows"]
    assert len(store) == 0


def test_argparse_tree():
    parser = argparse.ArgumentParser(prog="te-fl-attn")
    sub = parser.add_subparsers(dest="command")
    cmd.add_cache_parser(sub)
    default_cache().put(key(1), result(1))
    cases = [
        (["cache", "path"], 0, str(default_cache().path)),
        (["cache", "stats", "--json"], 0, '"entries": 1'),
        (["cache", "list", "--limit", "5", "--backend", "fused"], 0, "fused"),
        (["cache", "show", key(1).config_key[:12]], 0, "fused: "),
        (["cache", "export", "--format", "sqlite", str(default_cache().path) + ".pack"], 0,
         "exported 1 rows"),
        (["cache", "prune", "--older-than", "30d"], 0, "pruned 0 rows"),
        (["cache", "prune", "--not-version", "f" * 64], 0, "pruned 1 rows"),
        (["cache", "clear", "--yes"], 0, "cleared 0 rows"),
    ]
    for argv, code, expect in cases:
        args = parser.parse_args(argv)
        out = Out()
        assert args.func(args, out) == code, argv
        assert expect in out.text, (argv, out.text)
    for argv in (["cache"], ["cache", "prune", "--older-than", "soon"], ["cache", "clear", "x"],
                 ["cache", "merge", "a", "b"], ["cache", "list", "--backend", "cuda"],
                 ["cache", "export", "--format", "xml", "f"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parser.parse_args(argv)

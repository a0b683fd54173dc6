"""``te-fl-attn fleet``: argument parsing, config files, the table, JSON, exit codes."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from te_fl_attention.cli.fleet import add_fleet_parser, load_configs, main, parse_devices

pytestmark = pytest.mark.usefixtures("isolated_cache")


def test_parse_devices_keeps_overrides_with_their_device():
    assert parse_devices(["a100,h100:cudnn=9.10.2,fa2=none,b200", "local"]) == [
        "a100", "h100:cudnn=9.10.2,fa2=none", "b200", "local"]  # fmt: skip
    assert parse_devices(None) == ["a100", "h100", "h200", "b200"]
    with pytest.raises(ValueError):
        parse_devices(["cudnn=9.1"])


def test_config_files(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"preset": "llama3-8b", "name": "llama-4k",
                                   "max_seqlen_q": 4096, "max_seqlen_kv": 4096},
                                  {"head_dim_qk": 256, "num_heads": 4}]))  # fmt: skip
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"small": {"head_dim_qk": 32}}))
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"head_dim_qk": 64}\n\n{"head_dim_qk": 80}\n')
    got = load_configs(str(listed), ["deepseek-v3"], seqlen=None)
    assert [n for n, _ in got] == ["deepseek-v3", "llama-4k", "4h/4kv d256 s128 bf16 no_mask"]
    assert got[1][1].max_seqlen_q == 4096 and got[1][1].num_gqa_groups == 8
    assert [n for n, _ in load_configs(str(named), [])] == ["small"]
    assert [c.head_dim_qk for _, c in load_configs(str(lines), [], seqlen=1024)] == [64, 80]
    assert load_configs(str(lines), [], seqlen=1024)[0][1].max_seqlen_kv == 1024
    for bad, text in (("x.json", "[1]"), ("y.json", '{"head_dim_qk": "big"}'),
                      ("z.json", "not json")):  # fmt: skip
        (tmp_path / bad).write_text(text)
        with pytest.raises(ValueError):
            load_configs(str(tmp_path / bad), [])
    with pytest.raises(ValueError, match="--configs"):
        load_configs(str(tmp_path / "missing.json"), [])
    with pytest.raises(ValueError):
        load_configs(None, [])


def test_table_output(capsys):
    rc = main(["--preset", "llama3-8b", "gpt-oss-120b-swa", "--devices", "a100,t4",
               "--seqlen", "2048", "--uniform"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "FlashAttention 2 (predicted)" in out and "UnfusedDotProductAttention" in out
    assert "x fused: FusedAttention needs compute capability >= sm80 (found sm75)" in out
    assert "on t4 2 configs fall back to unfused: llama3-8b, gpt-oss-120b-swa" in out
    assert "llama3-8b uniform: UnfusedDotProductAttention" in out


def test_json_and_exit_code_when_a_device_has_no_backend(capsys, monkeypatch):
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    rc = main(["--preset", "llama3-8b", "--devices", "h100,t4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 3
    assert [(c["device"], c["chosen"], c["status"]) for c in data["cells"]] == [
        ("h100", "fused", "predicted"), ("t4", None, "predicted")]  # fmt: skip
    assert "uniform" not in data


def test_bad_input_is_exit_2(capsys):
    assert main(["--preset", "llama3-8b", "--devices", "h900"]) == 2
    assert "h900" in capsys.readouterr().err
    assert main(["--preset", "nope"]) == 2


def test_registers_as_a_subcommand():
    p = argparse.ArgumentParser(prog="te-fl-attn")
    add_fleet_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["fleet", "--preset", "llama3-8b", "--devices", "h100", "--json"])
    assert args.command == "fleet" and args.devices == ["h100"] and callable(args.func)


def test_html_path_is_checked_before_the_work(capsys, monkeypatch, tmp_path):
    import te_fl_attention.fleet as fleet

    monkeypatch.setattr(fleet, "plan", lambda *a, **k: pytest.fail("planned before the check"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in ("/proc/x/report.html", str(blocker / "r.html"), str(tmp_path)):
        assert main(["--preset", "llama3-8b", "--devices", "h100", "--html", bad]) == 2
        err = capsys.readouterr().err
        assert "--html" in err and "Traceback" not in err


def test_html_write_failure_exits_nonzero_and_leaves_nothing(capsys, monkeypatch, tmp_path):
    from te_fl_attention.fleet import report

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "render_html", lambda *a, **k: "<html>" + "x" * 100)
    monkeypatch.setattr(pathlib.Path, "write_bytes", broken)  # the disk fills up mid-write
    out = tmp_path / "r.html"
    assert main(["--preset", "llama3-8b", "--devices", "h100", "--html", str(out)]) == 1
    assert "No space left" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["default-cache"]  # the conftest's cache dir


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["--preset", "llama3-8b", "--devices", "h100,t4", "--html", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!doctype html>") and 'data-backend="fused"' in text

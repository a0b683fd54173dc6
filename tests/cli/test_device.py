"""``te-fl-attn device`` (cli/device.py), run as a real subprocess."""

from __future__ import annotations

import json

from cli_testutil import run


def test_device_command():
    p = run("device", "h200:cudnn=9.10.2", "--json")
    data = json.loads(p.stdout)
    assert data["sm"] == 90 and data["cudnn"] == "9.10.2" and data["memory_gib"] == 141.0
    p = run("device", "--list")
    assert "b200" in p.stdout and p.returncode == 0
    p = run("device", "--list", "--json")  # --json is honoured with --list too
    assert {d["name"] for d in json.loads(p.stdout)} >= {"a100", "h100", "b200"}


def test_the_printed_versions_key_is_the_one_rows_are_stored_under(tmp_path):
    """``device --json`` prints the key a default selector's rows for that device carry."""
    store = tmp_path / "probes.sqlite"
    env = {"TE_FL_ATTN_CACHE": str(store), "TE_FL_ATTN_CUDNN_PROBE": "0"}
    shown = json.loads(run("device", "h100", "--json", env=env).stdout)["versions_key"]
    assert run("explain", "--device", "h100", "--json", env=env).returncode == 0
    from te_fl_attention.cache import ProbeCache

    stored = {r.key.versions_key for r in ProbeCache(store).iter_rows()}
    assert stored == {shown}

"""``te-fl-attn matrix`` (cli/matrix.py), run as a real subprocess."""

from __future__ import annotations

from cli_testutil import bad_input, run


def test_matrix_takes_device_and_says_rule_stage():
    p = run("matrix", "--device", "h100:cudnn=9.10.2")
    assert p.returncode == 0 and "h100:cudnn=9.10.2 (sm90)" in p.stdout
    assert "a100" not in p.stdout.split("####")[1] and "rule stage" in p.stdout
    assert "rule stage" in run("matrix", "--help").stdout
    assert "h999" in bad_input(run("matrix", "--device", "h999"))

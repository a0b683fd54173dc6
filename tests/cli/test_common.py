"""The top parser (cli/__init__.py) and running a command (cli/common.py): version, help,
switches checked before any command (exit 2)."""

from __future__ import annotations

import pytest
from cli_testutil import bad_input, run


@pytest.mark.parametrize("var, raw", [
    ("TE_FL_ATTN_CUDNN_PROBE", "false"), ("TE_FL_ATTN_CACHE_READONLY", "maybe"),
    ("TE_FL_ATTN_TRITON", "2"), ("TE_FL_ATTN_VERIFY", "-1"), ("TE_FL_ATTN_MEASURE", "1 "),
    ("TE_FL_ATTN_SEED_ENV", "١"), ("NVTE_FUSED_ATTN", "abc")])
def test_bad_switch_exits_2_naming_it(var, raw):
    err = bad_input(run("explain", "--device", "h100", env={var: raw}))
    assert var in err and ascii(raw) in err


def test_version_and_full_description():
    from te_fl_attention import __version__

    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"te-fl-attn {__version__}"
    out = run("--help").stdout
    assert "manage the probe cache" in out and "Exit codes" in out

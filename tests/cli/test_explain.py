"""``te-fl-attn explain`` (cli/explain.py), run as a real subprocess (the console script's
module)."""

from __future__ import annotations

import json
import os

import pytest
from cli_testutil import bad_input, run


def test_explain_llama_h100_table():
    p = run("explain", "--preset", "llama3-8b", "--device", "h100")
    assert p.returncode == 0, p.stderr
    for name in ("FusedAttention", "FlashAttention", "TritonFlashAttention",
                 "UnfusedDotProductAttention"):  # fmt: skip
        assert name in p.stdout
    assert "chosen: FusedAttention" in p.stdout


def test_explain_json_a100_flash():
    p = run("explain", "--preset", "llama3-8b", "--device", "a100", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["chosen"] == "flash" and data["flash_variant"] == "fa2"
    assert {r["backend"] for r in data["results"]} == {"fused", "flash", "triton", "unfused"}


def test_explain_local_cpu_unfused():
    p = run("explain", "--preset", "llama3-8b", "--device", "local", "--json")
    data = json.loads(p.stdout)
    if data["device"]["sm"] is not None:  # pragma: no cover
        pytest.skip("machine has a GPU")
    assert p.returncode == 0 and data["chosen"] == "unfused"


def test_exit_codes_bad_input_and_no_backend(tmp_path):
    p = run("explain", "--num-heads", "12", "--num-gqa-groups", "5")
    assert p.returncode == 2 and "num_heads=12 is not divisible by num_gqa_groups=5" in p.stderr
    p = run("explain", "--dtype", "fp32", "--device", "t4", env={"NVTE_UNFUSED_ATTN": "0"})
    assert p.returncode == 3 and "no backend supports" in p.stdout
    p = run("explain", "--device", "h999")
    assert p.returncode == 2 and "device='h999'" in p.stderr


def test_config_file_and_flags_override(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_heads": 8, "head_dim_qk": 64, "attn_mask_type": "causal"}))
    p = run("explain", "--config", str(cfg), "--seqlen", "1024", "--window-size", "128,0",
            "--device", "h100", "--json")  # fmt: skip
    data = json.loads(p.stdout)
    assert data["config"]["num_heads"] == 8 and data["config"]["window_size"] == [128, 0]
    assert data["config"]["max_seqlen_kv"] == 1024


# ----------------------------------------------------------------- issue 12: input validation
@pytest.mark.parametrize("content, what", [
    ("null", "null"), ("42", "a number"), ("[1,2]", "an array"), ('"ab"', "a string"),
    ('[["num_heads",8]]', "an array"), ("[" * 100_000 + "]" * 100_000, "nested more than"),
    ('{"dropout": NaN}', "strict JSON"), ('{"num_heads": "8"}', "num_heads='8'")],
    ids=["null", "number", "array", "string", "pairs", "deep", "nan", "wrong-type"])
def test_config_file_must_hold_a_json_object(tmp_path, content, what):
    cfg = tmp_path / "c.json"
    cfg.write_text(content)
    assert what in bad_input(run("explain", "--config", str(cfg), "--device", "h100"))


def test_config_file_bounded_and_regular(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"num_heads": 8' + " " * (1 << 20) + "}")
    assert "larger than" in bad_input(run("explain", "--config", str(big), "--device", "h100"))
    assert "not a regular file" in bad_input(run("explain", "--config", "/dev/zero"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in bad_input(run("explain", "--config", str(fifo)))


@pytest.mark.parametrize("argv, field", [
    (["--seqlen", "99999999999999999999"], "max_seqlen_q=99999999999999999999"),
    (["--batch", "9" * 26], "batch_size=" + "9" * 26),
    (["--num-heads", "70000", "--num-gqa-groups", "1"], "num_heads=70000"),
    (["--head-dim-qk", "2048"], "head_dim_qk=2048"),
    (["--dropout", "1.0"], "dropout=1.0"), (["--softcap", "1e999"], "softcap=inf")])
def test_huge_numbers_exit_2_naming_field_value_and_range(argv, field):
    err = bad_input(run("explain", "--device", "h100", *argv))
    assert field in err and "expected" in err and "cudnn" not in err.lower()


@pytest.mark.parametrize("argv", [["--seqlen", "١٢٨"], ["--dropout", "nan"], ["--seqlen", "1e3"]])
def test_numbers_are_ascii_and_finite(argv):
    bad_input(run("explain", "--device", "h100", *argv))


@pytest.mark.parametrize("argv, text", [
    (["--seqlen", "4096", "--max-seqlen-q", "1024"], "--seqlen 4096 conflicts with --max-seqlen-q"),
    (["--batch", "2", "--batch-size", "4"], "--batch 2 conflicts with --batch-size 4")])
def test_conflicting_flags_are_an_error(argv, text):
    assert text in bad_input(run("explain", "--device", "h100", *argv))
    p = run("explain", "--device", "h100", "--seqlen", "512", "--max-seqlen-q", "512", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["config"]["max_seqlen_kv"] == 512


def test_nvte_parsed_as_te_parses_it():
    p = run("explain", "--device", "h100", "--json", env={"NVTE_FUSED_ATTN": " 0"})
    assert p.returncode == 0 and json.loads(p.stdout)["chosen"] != "fused"


def test_every_config_flag_help_lists_allowed_values():
    out = run("explain", "--help").stdout
    for text in ("--seqlen N", "[1, 2147483647]", "--dtype NAME", "fp8_e4m3", "--qkv-layout",
                 "thd_thd_thd", "--num-heads N", "65536", "[0, 1)", "--softmax-type", "learnable",
                 "llama3-8b", "h100"):  # fmt: skip
        assert text in out, text


def test_explain_honours_te_fl_attn_device():
    p = run("explain", "--json", env={"TE_FL_ATTN_DEVICE": "a100"})
    assert p.returncode == 0 and json.loads(p.stdout)["device"]["name"] == "a100"
    p = run("explain", "--device", "h100", "--json", env={"TE_FL_ATTN_DEVICE": "a100"})
    assert json.loads(p.stdout)["device"]["name"] == "h100"
    assert "TE_FL_ATTN_DEVICE" in bad_input(run("explain", env={"TE_FL_ATTN_DEVICE": "h999"}))


def test_force_unavailable_lists_its_own_reasons():
    p = run("explain", "--device", "h100", "--force", "FA3")
    assert p.returncode == 3
    assert "FlashAttention 3 (flash-attn-3) is not assumed installed" in p.stdout
    assert "force=fa3 and FlashAttention 3 cannot run this config" in p.stdout
    data = json.loads(run("explain", "--device", "h100", "--force", "fa3", "--json").stdout)
    flash = next(r for r in data["results"] if r["backend"] == "flash")
    assert flash["reasons"][0]["code"] == "fa3.not_installed"


# ------------------------------------------------------------------------- issue 12: hints
def _hints(data: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in data["results"]:
        for x in (r, *r["variants"]):
            out[x["backend"]] = [y["hint"] for y in x["reasons"]]
    return out


def test_catalog_hints_name_the_override_not_a_local_install():
    hints = _hints(json.loads(run("explain", "--device", "h100", "--json").stdout))
    assert hints["fa4"] == ["a what-if answer changes with the device, not a local install: "
                            "--device h100:flash_attn_4=4.0.0b36"]
    assert all("pip install" not in (h or "") for hs in hints.values() for h in hs)
    hints = _hints(json.loads(run("explain", "--device", "h100:FA4=none", "--json").stdout))
    assert hints["fa4"] == [None]  # the user said none: no install hint
    assert "--device h100:flash_attn_4=none,flash_attn_3=3.0.0b1" in hints["fa3"][0]


def test_no_empty_reason_cell():
    # every flash flavour refused by its own rules: the parent row says so
    p = run("explain", "--device", "a100", "--head-dim-qk", "320", "--num-heads", "4")
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("│ FlashAttention "))
    assert "refused" in row and "no flavour can run it" in row

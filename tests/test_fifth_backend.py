"""A fifth backend, registered from this test alone: no product file names it, yet explain, the
CLI, the support matrix, the policy's switches and aliases, the cache's row checks, the runner
and the plugin (TE's tuple and the FlashAttention router) all see it. Adding a backend is its
module (here: this file) plus one ``backends.register`` call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import te_fl_attention
from te_fl_attention import backends, selector
from te_fl_attention.backends import Backend
from te_fl_attention.cache import CacheKey, MemoryCache, reset_default_cache
from te_fl_attention.cache.rows import validate_row
from te_fl_attention.config import FusedAttnConfig
from te_fl_attention.device import profile
from te_fl_attention.kernels import run as runner
from te_fl_attention.plugin.router import FlashAttentionRouter
from te_fl_attention.plugin.te_backend import BackendVersion, TEBackend, set_current
from te_fl_attention.policy import Policy, env_vars
from te_fl_attention.probes import default_probes
from te_fl_attention.probes.base import RuleProbe, reject
from te_fl_attention.reasons import Reason

CFG = FusedAttnConfig(num_heads=2, num_gqa_groups=2, head_dim_qk=16, max_seqlen_q=16,
                      max_seqlen_kv=16, batch_size=2, attn_mask_type="causal")  # fmt: skip


def no_dropout(c: FusedAttnConfig, d) -> Reason | None:
    """The test backend runs without dropout (its own rule, not one of TE's)."""
    if c.dropout > 0:
        return reject("sdpa.dropout", f"dropout = {c.dropout} is not run by TorchSDPA",
                      observed=c.dropout, limit=0.0, hint="set dropout = 0")  # fmt: skip
    return None


class SdpaProbe(RuleProbe):
    name = "sdpa"
    RULES = (no_dropout,)


CALLS: list[dict] = []


def run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: dict) -> torch.Tensor:
    """torch SDPA on bshd q/k/v (what the runner is handed by kernels.run)."""
    CALLS.append(f)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal="causal" in
        f["attn_mask_type"], scale=f["softmax_scale"])  # fmt: skip
    return out.transpose(1, 2).to(q.dtype)


SDPA = Backend("sdpa", "TorchSDPA", "flash", ("TE_FL_ATTN_SDPA",), (-1, -1), SdpaProbe,
               ("torch_sdpa",), runner=run_sdpa, runs_on_cpu=True)  # fmt: skip


@pytest.fixture
def sdpa(tmp_path, monkeypatch):
    for name in (*env_vars(), "TE_FL_ATTN_SDPA", "TE_FL_ATTN_REMOTE_CACHE", "TE_FL_ATTN_AGREE",
                 "TRITON_INTERPRET"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "probes.sqlite"))
    monkeypatch.setenv("TE_FL_ATTN_CUDNN_PROBE", "0")
    monkeypatch.setattr(selector, "_DEFAULT", None)
    reset_default_cache()
    CALLS.clear()
    backends.register(SDPA)
    yield
    backends.unregister("sdpa")
    set_current(None)
    reset_default_cache()


def test_no_product_file_names_it():
    root = Path(te_fl_attention.__file__).parent
    assert not [p for p in root.rglob("*.py") if "TorchSDPA" in p.read_text()]


def test_explain_and_the_cli_see_it(sdpa, capsys):
    d = te_fl_attention.explain(CFG, "h100")
    assert d.chosen == "sdpa" and d.order[0] == "sdpa"
    assert d.result("sdpa").display_name == "TorchSDPA"
    refused = te_fl_attention.explain(CFG.replace(dropout=0.1), "h100")
    assert refused.chosen == "fused"
    assert [r.code for r in refused.result("sdpa").reasons] == ["sdpa.dropout"]
    from te_fl_attention.cli import main

    assert main(["explain", "--device", "h100", "--force", "torch_sdpa", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == "sdpa" and out["policy"]["sdpa"] is True
    assert main(["explain", "--device", "h100", "--dropout", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "TorchSDPA" in text and "dropout = 0.1 is not run by TorchSDPA" in text


def test_the_matrix_has_its_table(sdpa):
    from te_fl_attention.cli.matrix import columns, markdown

    assert columns()[-1] == "sdpa"
    assert "#### TorchSDPA" in markdown(("h100",))


def test_the_policy_reads_its_switch_and_aliases(sdpa):
    assert "TE_FL_ATTN_SDPA" in env_vars()
    off = Policy.from_env({"TE_FL_ATTN_SDPA": "0"})
    assert off.sdpa is False and Policy.from_env({}).sdpa is True
    d = selector.Selector(default_probes(graph=False)).decide(CFG, "h100", off)
    assert d.chosen == "fused"
    why = d.result("sdpa").reasons[0]
    assert why.code == "policy.sdpa_disabled" and "TE_FL_ATTN_SDPA=0" in why.message
    with pytest.raises(ValueError, match="TE_FL_ATTN_SDPA"):
        Policy.from_env({"TE_FL_ATTN_SDPA": "2"})
    assert Policy(force="Torch-SDPA".replace("-", "_")).force == "sdpa"
    assert Policy(sdpa=False).to_dict()["sdpa"] is False


def test_its_rows_are_cached_and_checked(sdpa):
    cache = MemoryCache()
    sel = selector.Selector(default_probes(graph=False), cache=cache)
    sel.decide(CFG, "h100")
    rows = [r for r in cache.iter_rows() if r.key.backend == "sdpa"]
    assert len(rows) == 1 and validate_row(rows[0].to_dict()) == rows[0]
    again = selector.Selector(default_probes(graph=False), cache=cache).decide(CFG, "h100")
    assert again.source == "cache" and again.chosen == "sdpa"
    assert CacheKey(*rows[0].key).problem() is None
    backends.unregister("sdpa")  # a process that does not know it refuses its rows
    try:
        assert "is not one of" in validate_row(rows[0].to_dict())
    finally:
        backends.register(SDPA)


def test_the_runner_and_the_plugin_run_it(sdpa):
    q, k, v = (torch.randn(2, 16, 2, 16) for _ in range(3))
    out = runner.run("sdpa", q, k, v, attn_mask_type="causal")
    assert out.shape == q.shape and len(CALLS) == 1
    assert runner.can_run_here("sdpa", CFG, profile("local"))[0]
    backend = TEBackend(selector.Selector(default_probes(graph=False)), "h100")
    set_current(backend)
    d = backend.selector.decide(CFG, backend.device, Policy())
    use_flash, fab, use_fused, _, use_unfused, available = backend.translate(d, Policy())
    assert use_flash and not use_fused and not use_unfused and available[0]
    assert isinstance(fab, BackendVersion) and fab.backend == "sdpa"
    assert str(fab).endswith("+tefl.sdpa") and "sdpa" in fab.allowed
    router = FlashAttentionRouter(16 ** -0.5, attention_type="self")
    got = router(q, k, v, qkv_layout="bshd_bshd_bshd", attn_mask_type="causal",
                 flash_attention_backend=fab, max_seqlen_q=16, max_seqlen_kv=16)  # fmt: skip
    assert got.shape == (2, 16, 32) and len(CALLS) == 2
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(got, want.reshape(2, 16, 32))

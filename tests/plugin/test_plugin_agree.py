"""TE_FL_ATTN_AGREE through the plugin: one collective, at the first selection only."""

from __future__ import annotations

from types import SimpleNamespace

from te_fl_attention import Policy, Selector, fleet
from te_fl_attention.plugin.te_backend import TEBackend
from te_fl_attention.probes import default_probes


def params(seq: int) -> SimpleNamespace:
    return SimpleNamespace(
        qkv_dtype="torch.bfloat16", qkv_layout="bshd_bshd_bshd", max_seqlen_q=seq,
        max_seqlen_kv=seq, attn_mask_type="causal",
    )  # fmt: skip


def test_agree_runs_once_then_lookups(monkeypatch):
    calls = []
    selector = Selector(default_probes(graph=False))

    def fake_agree(configs, mode, device, selector, policy):
        calls.append((mode, configs))
        return [selector.decide(configs[0], device, Policy(fused=False))]

    monkeypatch.setenv("TE_FL_ATTN_AGREE", "uniform")
    monkeypatch.setattr(fleet, "dist_ready", lambda: True)
    monkeypatch.setattr(fleet, "agree", fake_agree)
    backend = TEBackend(selector, "h100")
    first = backend(params(128))
    backend(params(256))  # a later miss: no collective
    backend(params(128))
    assert [c[0] for c in calls] == ["uniform"]
    assert first[0] and not first[2]  # the agreed decision (flash: fused was excluded) is used


def test_agree_off_by_default(monkeypatch):
    monkeypatch.delenv("TE_FL_ATTN_AGREE", raising=False)
    monkeypatch.setattr(fleet, "dist_ready", lambda: True)
    monkeypatch.setattr(fleet, "agree", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    out = TEBackend(Selector(default_probes(graph=False)), "h100")(params(128))
    assert out[2]  # fused on h100, decided locally

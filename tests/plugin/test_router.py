"""The FlashAttention router without TE: what it runs, what it passes on, what it refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from packaging.version import Version

from te_fl_attention.plugin import router as router_module
from te_fl_attention.plugin.router import FlashAttentionRouter
from te_fl_attention.plugin.te_backend import BackendVersion, TEBackend, set_current
from te_fl_attention.policy import ENV_VARS
from te_fl_attention.probes import default_probes
from te_fl_attention.selector import Selector


class NativeFlash(torch.nn.Module):
    """Stands for TE's FlashAttention: records its construction and calls."""

    built: list[dict[str, Any]] = []

    def __init__(self, softmax_scale: float, **kw: Any) -> None:
        super().__init__()
        NativeFlash.built.append({"softmax_scale": softmax_scale, **kw})
        self.calls: list[dict[str, Any]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
                ) -> torch.Tensor:  # fmt: skip
        self.calls.append({"attention_type": self.attention_type, "training": self.training,
                           **kw})  # fmt: skip
        return q.reshape(*q.shape[:-2], -1)


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> FlashAttentionRouter:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    set_current(TEBackend(Selector(default_probes(graph=False)), "h100"))
    NativeFlash.built.clear()
    r = FlashAttentionRouter(0.125, attention_dropout=0.0, attention_type="self",
                             layer_number=3, deterministic=True)  # fmt: skip
    r.native_class = NativeFlash
    yield r
    set_current(None)


def qkv(b: int = 2, s: int = 16, h: int = 2, hg: int = 2, d: int = 16,
        dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:  # fmt: skip
    return (torch.zeros(b, s, h, d, dtype=dtype), torch.zeros(b, s, hg, d, dtype=dtype),
            torch.zeros(b, s, hg, d, dtype=dtype))  # fmt: skip


def test_plain_version_runs_te_native_unchanged(router: FlashAttentionRouter) -> None:
    q, k, v = qkv()
    router.attention_type = "cross"  # TE assigns this before calling
    out = router(q, k, v, qkv_layout="bshd_bshd_bshd", attn_mask_type="causal",
                 flash_attention_backend=Version("2.8.3"), softcap=0.0,
                 load_balancing_strategy="dual")  # fmt: skip
    assert out.shape == (2, 16, 32)
    assert NativeFlash.built == [{"softmax_scale": 0.125, "attention_dropout": 0.0,
                                  "attention_dropout_ctx": NativeFlash.built[0][
                                      "attention_dropout_ctx"], "attention_type": "cross",
                                  "layer_number": 3, "deterministic": True}]  # fmt: skip
    call = router.native.calls[0]
    assert call["attention_type"] == "cross"
    assert call["flash_attention_backend"] == Version("2.8.3")
    assert call["softcap"] == 0.0 and call["load_balancing_strategy"] == "dual"
    assert {"cu_seqlens_q_padded", "pad_between_seqs", "num_splits", "fp8_output"} <= set(call)


def test_our_decision_runs_the_flash_attn_flavour_it_chose(router: FlashAttentionRouter) -> None:
    set_current(TEBackend(Selector(default_probes(graph=False)), "a100"))  # sm80: flash first
    q, k, v = qkv()
    router(q, k, v, qkv_layout="bshd_bshd_bshd", attn_mask_type="causal")  # no decision given
    fab = router.native.calls[0]["flash_attention_backend"]
    assert isinstance(fab, BackendVersion) and fab.backend == "fa2" and str(fab) == "2.8.3"


def test_refuses_what_the_decision_does_not_allow(router: FlashAttentionRouter) -> None:
    q, k, v = qkv()
    fab = set_current_answer(q)
    forged = BackendVersion("4.0.0", "fa4", fab.decision, fab.allowed)
    with pytest.raises(RuntimeError) as err:
        router(q, k, v, qkv_layout="bshd_bshd_bshd", flash_attention_backend=forged)
    text = str(err.value)
    assert "FlashAttention 4" in text and "does not allow" in text and "chosen 'fused'" in text
    assert "allowed: fa2, triton" in text and "fa4: [rule] FlashAttention 4" in text
    with pytest.raises(RuntimeError, match=r"num_heads, num_gqa_groups\) = \(4, 1\)"):
        router(*qkv(h=4, hg=1), qkv_layout="bshd_bshd_bshd", flash_attention_backend=fab)


def test_triton_refuses_features_it_lacks(router: FlashAttentionRouter) -> None:
    q, k, v = qkv(dtype=torch.float32)
    fab = set_current_answer(q)
    assert fab.backend == "triton"
    with pytest.raises(RuntimeError, match="TritonFlashAttention.*ALiBi slopes"):
        router(q, k, v, qkv_layout="bshd_bshd_bshd", flash_attention_backend=fab,
               alibi_slopes=torch.ones(2))  # fmt: skip
    with pytest.raises(RuntimeError, match="does not implement softcap"):
        router(q, k, v, qkv_layout="bshd_bshd_bshd", flash_attention_backend=fab, softcap=30.0)
    with pytest.raises(RuntimeError, match="q in thd with k/v in bshd"):
        router(q[0], k, v, qkv_layout="thd_bshd_bshd", flash_attention_backend=fab)


def test_a_decision_outside_the_flash_tier_is_refused(router: FlashAttentionRouter) -> None:
    """On sm90 the decision for bf16 causal is FusedAttention: called directly, the router
    does not second-guess it."""
    with pytest.raises(RuntimeError, match="chose FusedAttention, not a flash-tier backend"):
        router(*qkv(), qkv_layout="bshd_bshd_bshd", attn_mask_type="causal")


def test_triton_path_layouts(router: FlashAttentionRouter, monkeypatch: pytest.MonkeyPatch
                             ) -> None:  # fmt: skip
    """The arguments our kernel receives for TE's layouts (the kernel itself is replaced)."""
    seen: list[dict[str, Any]] = []

    def fake_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feats: dict[str, Any]
                 ) -> torch.Tensor:  # fmt: skip
        seen.append({"q": tuple(q.shape), **feats})
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    monkeypatch.setattr(router_module, "_run", fake_run)
    q, k, v = qkv(dtype=torch.float32)
    fab = set_current_answer(q)
    full = torch.tensor([0, 16, 32], dtype=torch.int32)
    out = router(q.transpose(0, 1), k, v, qkv_layout="sbhd_bshd_bshd", attn_mask_type="causal",
                 cu_seqlens_q=full, cu_seqlens_kv=full, flash_attention_backend=fab)
    assert out.shape == (16, 2, 32)  # back in q's sbhd: [s, b, h*d]
    assert seen[-1]["q"] == (2, 16, 2, 16) and seen[-1]["qkv_format"] == "bshd"
    assert seen[-1]["cu_seqlens_q"] is None  # dense causal: TE's full cu_seqlens dropped
    assert seen[-1]["window_size"] == (-1, 0) and seen[-1]["bottom_right_diagonal"] is False
    assert seen[-1]["softmax_scale"] == 0.125 and seen[-1]["deterministic"] is True
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    mask[1, ..., 9:] = True
    router(q, k, v, qkv_layout="bshd_bshd_bshd", attn_mask_type="padding", attention_mask=mask,
           flash_attention_backend=fab)  # fmt: skip
    assert seen[-1]["cu_seqlens_q"].tolist() == [0, 16, 25]
    mask[0, ..., 3] = True  # padding in the middle of a sequence
    with pytest.raises(RuntimeError, match="not at the end"):
        router(q, k, v, qkv_layout="bshd_bshd_bshd", attn_mask_type="padding",
               attention_mask=mask, flash_attention_backend=fab)  # fmt: skip


def set_current_answer(q: torch.Tensor) -> BackendVersion:
    """The BackendVersion our get_attention_backend gives for bshd q/k/v like ``q``."""
    from te_fl_attention.plugin.te import get_attention_backend

    @dataclasses.dataclass
    class P:
        qkv_dtype: torch.dtype
        batch_size: int
        max_seqlen_q: int
        max_seqlen_kv: int
        num_heads: int
        num_gqa_groups: int
        head_dim_qk: int
        head_dim_v: int
        qkv_layout: str = "bshd_bshd_bshd"
        attn_mask_type: str = "causal"
        window_size: tuple = (-1, 0)
        fp8: bool = False
        fp8_meta: Any = None

    b, s, h, d = q.shape
    return get_attention_backend(P(q.dtype, b, s, s, h, h, d, d))[1]

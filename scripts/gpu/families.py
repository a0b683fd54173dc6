"""The configs the GPU acceptance run asks about: TE's test families, at least 40 of them.

Each entry is ``(family, FusedAttnConfig keyword arguments)``; every checker of the acceptance
run (cuDNN real handle vs descriptor, our decision vs TE's own, TE's DotProductAttention through
the plugin) reads this one list, so their answers line up config by config. The families follow
TE 2.20.2's ``tests/pytorch/attention/test_attention.py`` groups: base shapes, MLA, masks,
sliding windows, bias and ALiBi, dropout, GQA/MQA, thd/ragged, KV cache (paged), softmax sinks,
determinism, FP8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

Family = tuple[str, dict[str, Any]]

_BASE: dict[str, Any] = dict(batch_size=2, max_seqlen_q=512, num_heads=16, head_dim_qk=128,
                             dtype="bf16", qkv_layout="bshd_bshd_bshd")  # fmt: skip


def _f(family: str, **kw: Any) -> Family:
    return family, {**_BASE, **kw}


FAMILIES: list[Family] = [
    # base shapes, both dtypes, inference and training
    _f("base", attn_mask_type="no_mask"),
    _f("base", attn_mask_type="causal"),
    _f("base", attn_mask_type="causal", dtype="fp16"),
    _f("base", attn_mask_type="causal", is_training=False),
    _f("base", attn_mask_type="no_mask", head_dim_qk=64, qkv_layout="sbhd_sbhd_sbhd"),
    _f("base", attn_mask_type="causal", head_dim_qk=256),
    _f("base", attn_mask_type="causal", max_seqlen_q=2048, batch_size=1),
    _f("base", attn_mask_type="no_mask", max_seqlen_q=128, max_seqlen_kv=512),
    # MLA (DeepSeek-V3 shapes)
    _f("mla", attn_mask_type="causal", head_dim_qk=192, head_dim_v=128),
    _f("mla", attn_mask_type="causal", head_dim_qk=192, head_dim_v=128, is_training=False),
    _f("mla", attn_mask_type="no_mask", head_dim_qk=128, head_dim_v=64),
    # masks
    _f("mask", attn_mask_type="causal_bottom_right", max_seqlen_q=128, max_seqlen_kv=512),
    _f("mask", attn_mask_type="padding"),
    _f("mask", attn_mask_type="padding_causal"),
    _f("mask", attn_mask_type="padding_causal_bottom_right", max_seqlen_q=256,
       max_seqlen_kv=512),  # fmt: skip
    # sliding windows
    _f("window", attn_mask_type="causal", window_size=(128, 0)),
    _f("window", attn_mask_type="no_mask", window_size=(64, 64)),
    _f("window", attn_mask_type="causal_bottom_right", window_size=(128, 0), max_seqlen_q=256,
       max_seqlen_kv=512),  # fmt: skip
    _f("window", attn_mask_type="padding_causal", window_size=(256, 0),
       qkv_layout="thd_thd_thd"),  # fmt: skip
    # bias and ALiBi
    _f("bias", attn_mask_type="no_mask", bias_type="post_scale_bias", bias_shape="1hss"),
    _f("bias", attn_mask_type="causal", bias_type="post_scale_bias", bias_shape="1hss"),
    _f("bias", attn_mask_type="no_mask", bias_type="post_scale_bias", bias_shape="bhss",
       is_training=False),  # fmt: skip
    _f("bias", attn_mask_type="no_mask", bias_type="post_scale_bias", bias_shape="111s"),
    _f("bias", attn_mask_type="causal", bias_type="alibi"),
    _f("bias", attn_mask_type="causal", bias_type="alibi", alibi_slopes_shape=(16,)),
    # dropout (with and without bias)
    _f("dropout", attn_mask_type="causal", dropout=0.1),
    _f("dropout", attn_mask_type="no_mask", dropout=0.1, bias_type="post_scale_bias",
       bias_shape="1hss"),  # fmt: skip
    # GQA / MQA
    _f("gqa", attn_mask_type="causal", num_heads=32, num_gqa_groups=8),
    _f("gqa", attn_mask_type="causal", num_heads=32, num_gqa_groups=1),
    _f("gqa", attn_mask_type="causal", num_heads=32, num_gqa_groups=8,
       qkv_layout="sbhd_sbhd_sbhd", max_seqlen_q=4096, batch_size=1),  # fmt: skip
    # thd (ragged)
    _f("thd", attn_mask_type="padding_causal", qkv_layout="thd_thd_thd"),
    _f("thd", attn_mask_type="padding", qkv_layout="thd_thd_thd", num_heads=32,
       num_gqa_groups=8),  # fmt: skip
    _f("thd", attn_mask_type="padding_causal", qkv_layout="thd_thd_thd",
       bias_type="post_scale_bias", bias_shape="1hss"),  # fmt: skip
    _f("thd", attn_mask_type="padding_causal", qkv_layout="thd_thd_thd", pad_between_seqs=True),
    # KV cache (inference)
    _f("kv_cache", attn_mask_type="padding_causal", is_training=False, kv_cache=True,
       qkv_layout="bshd_bshd_bshd", max_seqlen_q=1, max_seqlen_kv=1024),  # fmt: skip
    _f("kv_cache", attn_mask_type="padding_causal", is_training=False, kv_cache=True,
       paged=True, page_size=64, qkv_layout="paged_kv_bshd_bshd_bshd", max_seqlen_q=1,
       max_seqlen_kv=1024),  # fmt: skip
    # softmax sinks
    _f("softmax", attn_mask_type="causal", softmax_type="learnable"),
    _f("softmax", attn_mask_type="causal", softmax_type="off-by-one", window_size=(128, 0)),
    # determinism
    _f("deterministic", attn_mask_type="causal", deterministic=True),
    _f("deterministic", attn_mask_type="causal", deterministic=True, head_dim_qk=192,
       head_dim_v=128),  # fmt: skip
    # FP8 (delayed scaling: sm90; current scaling: sm100)
    _f("fp8", attn_mask_type="causal", fp8=True, fp8_recipe="delayed", is_training=False),
    _f("fp8", attn_mask_type="causal", fp8=True, fp8_recipe="delayed"),
    _f("fp8", attn_mask_type="causal", fp8=True, fp8_recipe="current"),
]


def configs() -> list[tuple[str, Any]]:
    """``(family, FusedAttnConfig)`` for every entry (constructed, so normalized as TE does)."""
    from te_fl_attention.config import FusedAttnConfig

    return [(family, FusedAttnConfig(**kw)) for family, kw in FAMILIES]


#: Families DotProductAttention can run forward + backward with plain tensors (no FP8 recipe,
#: no inference params): the TE comparison runs these.
RUNNABLE = ("base", "mla", "mask", "window", "bias", "gqa", "thd", "softmax", "deterministic")


def write_report(out: Path | None, name: str, data: Any) -> None:
    """Write a checker's result as ``out/<name>.json`` (nothing without ``--out``)."""
    if out is not None:
        import json

        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))

"""Attention shapes of real models, for ``te-fl-attn explain --preset NAME``.

Each preset is the attention of one transformer layer as TE sees it in training (sbhd, bf16,
causal); ``--seqlen``/``--batch`` and any config flag override it.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Llama 3 8B: 32 query heads, 8 KV heads, head dim 128, 8K context (Meta Llama 3 model card).
    "llama3-8b": dict(num_heads=32, num_gqa_groups=8, head_dim_qk=128, max_seqlen_q=8192),
    # Llama 3 70B: 64 query heads, 8 KV heads, head dim 128.
    "llama3-70b": dict(num_heads=64, num_gqa_groups=8, head_dim_qk=128, max_seqlen_q=8192),
    # Mixtral 8x7B: 32 query heads, 8 KV heads, head dim 128, 32K context.
    "mixtral-8x7b": dict(num_heads=32, num_gqa_groups=8, head_dim_qk=128, max_seqlen_q=32768),
    # DeepSeek-V3 MLA in training form: 128 heads, q/k head dim 192 (128 + 64 rope), v 128.
    "deepseek-v3": dict(num_heads=128, num_gqa_groups=128, head_dim_qk=192, head_dim_v=128,
                        max_seqlen_q=4096),
    # gpt-oss-120b sliding-window layers: 64 heads, 8 KV heads, head dim 64, window 128,
    # learnable attention sinks.
    "gpt-oss-120b-swa": dict(num_heads=64, num_gqa_groups=8, head_dim_qk=64, max_seqlen_q=4096,
                             window_size=(128, 0), softmax_type="learnable"),
}  # fmt: skip

_COMMON: dict[str, Any] = dict(
    batch_size=1, dtype="bf16", qkv_layout="sbhd_sbhd_sbhd", attn_mask_type="causal"
)


def preset(name: str, *, seqlen: int | None = None, batch: int | None = None) -> dict[str, Any]:
    """Config keyword arguments for a named model shape (the name in any case)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; allowed: {', '.join(sorted(PRESETS))}")
    kw = {**_COMMON, **PRESETS[key]}
    if seqlen is not None:
        kw["max_seqlen_q"] = seqlen
    kw["max_seqlen_kv"] = kw["max_seqlen_q"]
    if batch is not None:
        kw["batch_size"] = batch
    return kw

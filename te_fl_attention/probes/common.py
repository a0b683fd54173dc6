"""Rules TransformerEngine applies to every backend at once ("Disabling all backends ...")."""

from __future__ import annotations

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import Reason
from .base import Rule, reject


def score_mod_bprop_needs_score_mod(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling all backends because score_mod_bprop requires score_mod"."""
    if c.has_score_mod_bprop and not c.has_score_mod:
        return reject(
            "score_mod.bprop_without_fwd",
            "score_mod_bprop was given without score_mod",
            observed="score_mod_bprop only",
            limit="score_mod_bprop requires score_mod",
        )
    return None


def max_logit_with_fp8(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling all backends for max_logit with FP8 attention"."""
    if c.return_max_logit and c.fp8:
        return reject(
            "max_logit.fp8",
            "return_max_logit is not supported with FP8 attention",
            observed="return_max_logit + fp8",
            limit="no FP8 with max_logit",
        )
    return None


def kv_cache_with_cp(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling all backends for KV caching with context parallelism"."""
    if c.kv_cache and c.context_parallel:
        return reject(
            "kv_cache.context_parallel",
            "KV caching is not supported with context parallelism",
            observed=f"cp_size={c.cp_size}",
            limit="no context parallelism",
        )
    return None


def kv_cache_with_fp8_mha(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling all backends for KV caching with FP8 MHA"."""
    if c.kv_cache and c.fp8 and c.fp8_mha:
        return reject(
            "kv_cache.fp8_mha",
            "KV caching is not supported with FP8 MHA (fp8_mha)",
            observed="fp8_mha=True",
            limit="fp8_mha=False",
        )
    return None


def kv_cache_thd_padding(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling all backends for pad_between_seqs = True and KV caching" (non-FP8, thd q)."""
    if c.kv_cache and not c.fp8 and c.q_format == "thd" and c.pad_between_seqs:
        return reject(
            "kv_cache.pad_between_seqs",
            "KV caching with thd queries does not support padding between sequences",
            observed="pad_between_seqs=True",
            limit="pad_between_seqs=False",
        )
    return None


def score_mod_only_fused(backend: str) -> Rule:
    """TE: "Disabling <backend> for score_mod" (only FusedAttention runs score_mod)."""

    def score_mod(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        if c.has_score_mod:
            return reject("score_mod.unsupported", "score_mod is only supported by FusedAttention",
                          observed="score_mod", limit="no score_mod")  # fmt: skip
        return None

    score_mod.__doc__ = f'TE: "Disabling {backend} for score_mod".'
    return score_mod


ALL_BACKENDS = (
    score_mod_bprop_needs_score_mod,
    max_logit_with_fp8,
    kv_cache_with_cp,
    kv_cache_with_fp8_mha,
    kv_cache_thd_padding,
)

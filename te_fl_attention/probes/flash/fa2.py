"""FlashAttention 2 (flash-attn 2): TE 2.20's rules for the flavour."""

from __future__ import annotations

import functools

from packaging.version import Version

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import Rule, reject
from .rules import FLAVOUR_FIELDS, fa_version, flavour_version, installed_rule, simple, too_old

FA2_MIN = Version("2.1.1")
FA2_MIN_BLACKWELL = Version("2.7.3")
FA2_MAX = Version("2.8.4")  # exclusive, as in TE 2.20's FlashAttentionUtils.max_version


@functools.lru_cache(maxsize=64)
def _fa2_out_of_range(text: str | None, blackwell: bool) -> tuple[Version, Version] | None:
    """``(version, lower bound)`` when flash-attn 2 ``text`` is outside TE's range, else None."""
    v = flavour_version("fa2", text)
    lo = FA2_MIN_BLACKWELL if blackwell else FA2_MIN
    return (v, lo) if v is not None and not (lo <= v < FA2_MAX) else None


def fa2_version_range(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's backends.py: flash-attn 2 counts as installed only for 2.1.1 <= v < 2.8.4
    (2.7.3+ on sm >= 100)."""
    bad = _fa2_out_of_range(d.version(FLAVOUR_FIELDS["fa2"]), (d.sm or 0) >= 100)
    if bad is not None:
        v, lo = bad
        return reject(
            "fa2.version_range",
            f"flash-attn {v} is outside TE's supported range",
            observed=str(v),
            limit=f">= {lo}, < {FA2_MAX}",
            hint=f"pip install 'flash-attn>={lo},<{FA2_MAX}'",
        )
    return None


def fa2_head_dim(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: FA2 pads to max(head_dim_qk, head_dim_v); needs %8 == 0, <= 256, and > 192 only on
    sm80/90/100/120."""
    p = max(c.head_dim_qk, c.head_dim_v)
    if p > 256 or p % 8 or (p > 192 and d.sm not in (80, 90, 100, 120)):
        return reject("fa2.head_dim", f"padded head_dim = {p} (head_dim_qk = {c.head_dim_qk}, "
                      f"head_dim_v = {c.head_dim_v}) is not supported by FlashAttention 2 on "
                      f"sm{d.sm}", observed=p,
                      limit="%8 == 0 and <= 256 (> 192 needs sm80/90/100/120)",
                      hint="FusedAttention supports larger head dims on recent cuDNN")  # fmt: skip
    return None


def fa2_softcap(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: softcap needs flash-attn >= 2.6.0 and no dropout while training."""
    if c.softcap == 0.0:
        return None
    v = fa_version(d, "fa2")
    if v is not None and v < Version("2.6.0"):
        return reject(
            "fa2.softcap_version",
            "softcap requires flash-attn 2.6.0+",
            observed=str(v),
            limit=">= 2.6.0",
        )
    if c.dropout and c.is_training:
        return reject(
            "fa2.softcap_dropout",
            "softcap with dropout is rejected by flash-attn 2",
            observed=f"dropout={c.dropout}",
            limit="dropout = 0 with softcap",
        )
    return None


#: The "needs flash-attn X+" rules :func:`_fa2_versioned` / :func:`_fa2_paged_version` apply.
_FA2_WINDOW, _FA2_ALIBI, _FA2_DETERMINISTIC, _FA2_PAGED = (
    too_old("fa2", "2.3", "sliding window attention"), too_old("fa2", "2.4", "ALiBi"),
    too_old("fa2", "2.4.1", "deterministic execution"), too_old("fa2", "2.5", "paged attention"))


def _fa2_versioned(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: sliding window needs 2.3+, ALiBi 2.4+, deterministic 2.4.1+ (paged 2.5+ above)."""
    if c.has_window and (reason := _FA2_WINDOW(c, d)):
        return reason
    if c.bias_type == "alibi" and (reason := _FA2_ALIBI(c, d)):
        return reason
    if c.deterministic and (reason := _FA2_DETERMINISTIC(c, d)):
        return reason
    return None


def _fa2_paged_version(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention 2 as paged attention requires flash-attn 2.5+"."""
    return _FA2_PAGED(c, d) if c.paged else None


FA2: tuple[Rule, ...] = (
    installed_rule("fa2"),
    fa2_version_range,
    simple("sm", "fa2", lambda c, d: d.sm is not None and d.sm < 80,
            "FlashAttention 2 needs compute capability >= sm80 (found sm{d.sm})",
            lambda c, d: d.sm, ">= 80",
            doc="""TE: "Disabling FlashAttention 2 for compute capability < sm80"."""),
    simple("dtype", "fa2", lambda c, d: c.dtype not in ("fp16", "bf16"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 2",
            lambda c, d: c.dtype, "fp16, bf16",
            doc="""TE: "Disabling FlashAttention 2 for unsupported qkv_dtype" (bf16, fp16
    only)."""),
    simple("fp8", "fa2", lambda c, d: c.fp8, "FlashAttention 2 does not run FP8 attention",
            lambda c, d: c.fp8_recipe, "no FP8",
            doc="""TE: "Disabling FlashAttention 2 for FP8 attention"."""),
    simple("num_splits", "fa2", lambda c, d: c.num_splits != 1,
            "num_splits = {c.num_splits} is not supported by FlashAttention 2",
            lambda c, d: c.num_splits, 1, "num_splits needs FlashAttention 3/4",
            doc="""TE: "Disabling FlashAttention 2 for num_splits"."""),
    fa2_softcap,
    simple("page_size", "fa2", lambda c, d: c.paged and c.page_size % 256 != 0,
            "paged KV cache page_size = {c.page_size} is not divisible by 256",
            lambda c, d: c.page_size, "% 256 == 0",
            doc="""TE: "Disabling FlashAttention 2 for page size not divisible by 256" (paged
    KV cache)."""),
    _fa2_paged_version,
    simple("kv_seqlen", "fa2",
            lambda c, d: c.kv_cache and not c.paged and c.max_seqlen_kv % 256 != 0,
            "non-paged KV cache with max_seqlen_kv = {c.max_seqlen_kv} not divisible by 256",
            lambda c, d: c.max_seqlen_kv, "% 256 == 0",
            doc="""TE: "Disabling FlashAttention 2 for non-paged KV cache with max_seqlen_kv not
    divisible by 256" (FA2 gets a block table whose page size is max_seqlen_kv)."""),
    fa2_head_dim,
    simple("pad_between_seqs", "fa2", lambda c, d: c.pad_between_seqs,
            "thd with padding between sequences is not supported by FlashAttention 2",
            True, "pad_between_seqs=False", "FlashAttention 3/4 and FusedAttention support it",
            doc="""TE: "Disabling FlashAttention 2 for qkv_format = thd when there is padding
    between sequences" (FA3 and FA4 take seqused_q/seqused_k instead)."""),
    simple("alibi_cross", "fa2",
            lambda c, d: c.bias_type == "alibi" and not c.bottom_right_diagonal
            and c.max_seqlen_q != c.max_seqlen_kv,
            "ALiBi with top-left alignment for cross-attention is not supported",
            "bottom_right_diagonal=False", "bottom-right alignment when s_q != s_kv",
            doc="""TE: "only supports ALiBi with bottom right diagonal alignment for
    cross-attention" (flash-attn 2.4+ ALiBi path)."""),
)  # fmt: skip


FA2 = (*FA2, _fa2_versioned)

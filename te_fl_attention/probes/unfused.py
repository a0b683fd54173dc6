"""UnfusedDotProductAttention: TE's plain-PyTorch backend (rule stage mirrors TE 2.20)."""

from __future__ import annotations

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import FP8_EMULATION_CODE, Reason
from .base import RuleProbe, reject
from .common import ALL_BACKENDS, score_mod_only_fused


def fp8_attention(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling UnfusedDotProductAttention for FP8 attention" unless FP8 emulation is on."""
    if c.fp8:
        return reject(
            FP8_EMULATION_CODE,
            "UnfusedDotProductAttention does not run FP8 attention",
            observed=f"fp8_recipe={c.fp8_recipe}",
            limit="no FP8",
            hint="set NVTE_UnfusedDPA_Emulate_FP8=1 to emulate FP8 in unfused attention",
        )
    return None


def num_splits(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling UnfusedDotProductAttention for num_splits"."""
    if c.num_splits != 1:
        return reject(
            "num_splits.unsupported",
            f"num_splits = {c.num_splits} is not supported",
            observed=c.num_splits,
            limit=1,
            hint="num_splits needs FlashAttention 3/4",
        )
    return None


score_mod = score_mod_only_fused("UnfusedDotProductAttention")


def thd_padding_between_seqs(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling UnfusedDotProductAttention for pad_between_seqs = True" (thd)."""
    if c.pad_between_seqs:
        return reject(
            "thd.pad_between_seqs",
            "thd with padding between sequences is not supported",
            observed="pad_between_seqs=True",
            limit="pad_between_seqs=False",
        )
    return None


def softmax_fp8(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling UnfusedDotProductAttention for softmax_type = %s in FP8"."""
    if c.softmax_type != "vanilla" and c.fp8:
        return reject(
            "softmax.fp8",
            f"softmax_type = {c.softmax_type} is not supported in FP8",
            observed=c.softmax_type,
            limit="vanilla in FP8",
        )
    return None


def context_parallel(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling UnfusedDotProductAttention as it does not support context parallelism"."""
    if c.context_parallel:
        return reject(
            "cp.unsupported",
            "context parallelism is not supported",
            observed=f"cp_size={c.cp_size}",
            limit="no context parallelism",
        )
    return None


class UnfusedProbe(RuleProbe):
    """Unfused attention runs anywhere torch runs (also on CPU), so it has no device rule."""

    name = "unfused"
    RULES = (*ALL_BACKENDS, fp8_attention, num_splits, score_mod, thd_padding_between_seqs,
             softmax_fp8, context_parallel)  # fmt: skip

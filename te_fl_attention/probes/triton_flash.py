"""TritonFlashAttention (ours): the rule stage for the features our Triton kernel supports.

Supported: fp16/bf16/fp32, head dims up to 256 (q/k and v may differ), GQA/MQA, no_mask,
padding, causal top-left and bottom-right, sliding windows, bshd/sbhd/thd (varlen, padded
offsets). Not supported: bias, ALiBi, dropout, FP8, context parallelism, KV cache, non-vanilla
softmax, softcap, num_splits, max_logit, score_mod, arbitrary masks.
"""

from __future__ import annotations

import importlib.util

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import Reason
from .base import RuleProbe, no_gpu, reject
from .common import ALL_BACKENDS

MAX_HEAD_DIM = 256


def kernel_available(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Our kernel module must exist in this installation (it ships with the Triton issue)."""
    if importlib.util.find_spec("te_fl_attention.kernels.triton_flash") is None:
        return reject(
            "triton.kernel_missing",
            "the Triton flash kernel is not part of this te-fl-attention build yet",
            observed=None,
            limit="te_fl_attention.kernels.triton_flash",
            stage="import",
        )
    return None


def triton_installed(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Triton must be installed on the device (package metadata)."""
    if d.triton is None:
        return reject(
            "triton.not_installed",
            "triton is not installed",
            observed=None,
            limit="triton",
            stage="import" if d.source == "local" else "rule",
            hint="pip install triton",
        )
    return None


def sm(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Our kernel targets tensor-core GPUs with bf16: sm80 and newer."""
    if d.sm is not None and d.sm < 80:
        return reject(
            "triton.sm",
            f"our Triton kernel needs sm >= 80 (found sm{d.sm})",
            observed=d.sm,
            limit=">= 80",
        )
    return None


def dtype(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """fp16, bf16 and fp32 inputs (fp32 accumulation)."""
    if c.dtype not in ("fp16", "bf16", "fp32"):
        return reject(
            "triton.dtype",
            f"qkv_dtype = {c.dtype} is not supported by our Triton kernel",
            observed=c.dtype,
            limit="fp16, bf16, fp32",
        )
    return None


def head_dim(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """Head dims up to 256 (non-powers of two are padded inside the kernel)."""
    if max(c.head_dim_qk, c.head_dim_v) > MAX_HEAD_DIM:
        return reject(
            "triton.head_dim",
            f"head dims ({c.head_dim_qk}, {c.head_dim_v}) exceed {MAX_HEAD_DIM}",
            observed=(c.head_dim_qk, c.head_dim_v),
            limit=f"<= {MAX_HEAD_DIM}",
        )
    return None


def _feature(code: str, what: str, test, limit: str):
    def rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        if test(c):
            return reject(
                f"triton.{code}",
                f"{what} is not supported by our Triton kernel",
                observed=what,
                limit=limit,
            )
        return None

    rule.__name__ = f"triton_{code}"
    rule.__doc__ = f"Refuse {what}: the kernel does not implement it."
    return rule


UNSUPPORTED = (
    _feature("bias", "attention bias / ALiBi", lambda c: c.bias_type != "no_bias", "no_bias"),
    _feature("dropout", "dropout", lambda c: c.dropout != 0.0, "dropout = 0"),
    _feature("fp8", "FP8 attention", lambda c: c.fp8, "no FP8"),
    _feature("cp", "context parallelism", lambda c: c.context_parallel, "no context parallelism"),
    _feature("kv_cache", "KV cache", lambda c: c.kv_cache, "no KV cache"),
    _feature("softmax", "non-vanilla softmax", lambda c: c.softmax_type != "vanilla", "vanilla"),
    _feature("softcap", "softcap", lambda c: c.softcap != 0.0, "softcap = 0"),
    _feature("num_splits", "num_splits != 1", lambda c: c.num_splits != 1, "num_splits = 1"),
    _feature("max_logit", "return_max_logit", lambda c: c.return_max_logit, "no max_logit"),
    _feature("score_mod", "score_mod", lambda c: c.has_score_mod, "no score_mod"),
    _feature(
        "arbitrary",
        "an arbitrary mask",
        lambda c: c.attn_mask_type == "arbitrary",
        "no_mask, padding, causal variants",
    ),
)


class TritonFlashProbe(RuleProbe):
    """The ``triton`` candidate (ours); ranks after flash-attn inside the flash tier."""

    name = "triton"
    RULES = (no_gpu("TritonFlashAttention"), *ALL_BACKENDS, kernel_available, triton_installed,
             sm, dtype, head_dim, *UNSUPPORTED)  # fmt: skip

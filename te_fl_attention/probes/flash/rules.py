"""FlashAttention: the flavours' shared vocabulary (versions, precedence), TE 2.20's
rules for "FlashAttention" as a whole (``SHARED``), and the rule builders each flavour uses."""

from __future__ import annotations

import functools

from packaging.version import Version

from ... import backends
from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import Rule, no_gpu, reject, version
from ..common import ALL_BACKENDS, score_mod_only_fused

#: flash-attn's flavours in TE's precedence (FA4 > FA3 > FA2) and the DeviceProfile field that
#: holds each one's installed version: both from the registry's ``flash`` descriptor.
PRECEDENCE = backends.get("flash").flavour_names()
FLAVOUR_FIELDS = {f.name: f.version_field for f in backends.get("flash").flavours}


def fa_version(d: DeviceProfile, flavour: str) -> Version | None:
    return flavour_version(flavour, d.version(FLAVOUR_FIELDS[flavour]))


@functools.lru_cache(maxsize=256)
def version_text(flavour: str, text: str | None) -> str | None:
    """``str()`` of :func:`fa_version` (what a flavour's result records)."""
    v = flavour_version(flavour, text)
    return str(v) if v else None


@functools.lru_cache(maxsize=256)
def flavour_version(flavour: str, text: str | None) -> Version | None:
    v = version(text)
    if v is not None and flavour == "fa3":
        v = Version(v.public)
    return v


# ------------------------------------------------------------------------- shared ("FA") rules
def fp8_sm120(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention as FP8 is not supported for compute capability = sm120"."""
    if c.fp8 and d.sm == 120:
        return reject(
            "fp8.sm120",
            "FP8 attention is not supported on sm120",
            observed="sm120",
            limit="sm != 120 for FP8",
        )
    return None


def max_logit(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention for max_logit"."""
    if c.return_max_logit:
        return reject(
            "max_logit.unsupported",
            "return_max_logit is not supported by flash-attn",
            observed=True,
            limit=False,
            hint="FusedAttention returns max_logit",
        )
    return None


score_mod = score_mod_only_fused("FlashAttention")


def kv_cache_sm120(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention for KV caching for sm120"."""
    if c.kv_cache and d.sm == 120:
        return reject(
            "kv_cache.sm120",
            "KV caching is disabled on sm120",
            observed="sm120",
            limit="sm != 120 with KV cache",
        )
    return None


def softmax_type(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention for softmax_type = %s"."""
    if c.softmax_type != "vanilla":
        return reject(
            "softmax.unsupported",
            f"softmax_type = {c.softmax_type} is not supported",
            observed=c.softmax_type,
            limit="vanilla",
            hint="off-by-one/learnable softmax runs on FusedAttention or unfused",
        )
    return None


def context_parallel(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's context-parallel filter for FlashAttention: FP8, bottom-right causal, causal
    cross-attention, bias types other than no_bias/post_scale_bias, and bias with thd."""
    if not c.context_parallel:
        return None
    m = c.attn_mask_type
    why = None
    if c.fp8:
        why = ("cp.fp8", "FP8", "no FP8")
    elif "bottom_right" in m:
        why = ("cp.bottom_right", f"attn_mask_type = {m}", "no bottom-right masks")
    elif "causal" in m and c.max_seqlen_q != c.max_seqlen_kv:
        why = ("cp.causal_cross", "causal masking for cross-attention", "s_q == s_kv with causal")
    elif c.bias_type not in ("no_bias", "post_scale_bias"):
        why = ("cp.bias_type", f"bias type {c.bias_type}", "no_bias or post_scale_bias")
    elif c.qkv_format == "thd" and c.bias_type != "no_bias":
        why = ("cp.thd_bias", "attention bias with thd", "no bias with thd")
    if why is None:
        return None
    return reject(
        why[0], f"context parallelism is not supported with {why[1]}", observed=why[1], limit=why[2]
    )


def arbitrary_mask(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention for arbitrary mask"."""
    if c.attn_mask_type == "arbitrary":
        return reject(
            "mask.arbitrary",
            "arbitrary masks are only supported by unfused attention",
            observed="arbitrary",
            limit="no_mask, padding, causal variants",
        )
    return None


def causal_cross_top_left(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE (warning): flash-attn >= 2.1 only supports bottom-right causal for cross-attention."""
    if c.attn_mask_type in ("causal", "padding_causal") and c.max_seqlen_q != c.max_seqlen_kv:
        return reject(
            "mask.causal_top_left_cross",
            f"top-left {c.attn_mask_type} with s_q={c.max_seqlen_q} != "
            f"s_kv={c.max_seqlen_kv}: flash-attn only aligns causal bottom-right",
            observed=c.attn_mask_type,
            limit="bottom-right causal when s_q != s_kv",
            hint="use causal_bottom_right if that is what you mean",
        )
    return None


def window_top_left_cross(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "only supports sliding window with bottom right diagonal alignment for
    cross-attention"."""
    if c.has_window and not c.bottom_right_diagonal and c.max_seqlen_q != c.max_seqlen_kv:
        return reject(
            "window.top_left_cross",
            "sliding window with top-left alignment for cross-attention",
            observed=f"window={c.window_size}, bottom_right_diagonal=False",
            limit="bottom-right alignment when s_q != s_kv",
        )
    return None


def bias(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: "Disabling FlashAttention for pre/post_scale_bias" (also any bias tensor)."""
    if c.bias_type not in ("no_bias", "alibi") or c.bias_shape is not None:
        return reject(
            "bias.unsupported",
            f"{c.bias_type} (bias tensor {c.bias_shape}) is not supported by flash-attn",
            observed=c.bias_type,
            limit="no_bias or alibi",
            hint="FusedAttention supports post_scale_bias; unfused supports both",
        )
    return None


SHARED: tuple[Rule, ...] = (
    no_gpu("FlashAttention"), *ALL_BACKENDS, fp8_sm120, max_logit, score_mod, kv_cache_sm120,
    softmax_type, context_parallel, arbitrary_mask, causal_cross_top_left, window_top_left_cross,
    bias,
)  # fmt: skip


# ----------------------------------------------------------------------------- helpers
def installed_rule(flavour: str) -> Rule:
    name = backends.display(flavour)
    dist = {"fa2": "flash-attn", "fa3": "flash-attn-3", "fa4": "flash-attn-4"}[flavour]

    @functools.lru_cache(maxsize=4)
    def refusal(local: bool) -> Reason:
        stage, where = ("import", "installed") if local else ("rule", "assumed installed")
        return reject(f"{flavour}.not_installed", f"{name} ({dist}) is not {where}",
                      observed=None, limit=dist, stage=stage,
                      hint=f"pip install {dist}" if flavour != "fa3" else
                      "build flash-attn 3 from flash-attention/hopper")  # fmt: skip

    def installed(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        """TE drops flavours whose package is not installed (package metadata)."""
        if fa_version(d, flavour) is None:
            return refusal(d.source == "local")  # one immutable Reason, built once
        return None

    installed.__name__ = f"{flavour}_installed"
    return installed


def simple(code: str, flavour: str, test, message: str, observed, limit, hint=None, *,
            doc: str) -> Rule:  # fmt: skip
    """Build a rule from a predicate; ``message``/``observed`` may use ``{c}``/``{d}``.
    ``doc`` becomes the rule's docstring: the TE behaviour it mirrors."""

    def rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        if test(c, d):
            fmt = {"c": c, "d": d}
            obs = observed(c, d) if callable(observed) else observed
            return reject(f"{flavour}.{code}", message.format(**fmt), observed=obs, limit=limit,
                          hint=hint)  # fmt: skip
        return None

    rule.__name__ = f"{flavour}_{code.replace('.', '_')}"
    rule.__qualname__ = rule.__name__
    rule.__doc__ = doc
    return rule


def too_old(flavour: str, minimum: str, feature: str) -> Rule:
    need = Version(minimum)

    def rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        v = fa_version(d, flavour)
        if v is not None and v < need:
            return reject(f"{flavour}.version", f"{feature} requires flash-attn {minimum}+",
                          observed=str(v), limit=f">= {minimum}", hint=f"pip install "
                          f"'flash-attn>={minimum}'")  # fmt: skip
        return None

    rule.__name__ = f"{flavour}_needs_{minimum.replace('.', '_')}"
    rule.__qualname__ = rule.__name__
    rule.__doc__ = f"TE: {feature} requires flash-attn {minimum}+ (FlashAttentionUtils)."
    return rule

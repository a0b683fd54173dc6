"""FlashAttention (flash-attn 2, 3 and 4): TE 2.20's rule stage for each flavour, then, on the
local device, the real import and one tiny call.

The candidate ``flash`` has three variants. Rules TE applies to "FlashAttention" as a whole
(clearing its umbrella flag) are shared; each flavour adds its own. Precedence among supported
flavours is TE's: FA4 > FA3 > FA2. FA4's head dims are judged by flash-attn-4's own
``_validate_head_dims`` (loaded from the installed source, stage ``import``) when the device's FA4
is the installed one, else by our statement of its limits (stage ``rule``).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib
import math
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import Version

from ..config import FusedAttnConfig
from ..device import DeviceProfile
from ..reasons import DISPLAY_NAMES, ProbeResult, Reason
from .base import Rule, evaluate, no_gpu, reject, version
from .common import ALL_BACKENDS, score_mod_only_fused

FA2_MIN = Version("2.1.1")
FA2_MIN_BLACKWELL = Version("2.7.3")
FA2_MAX = Version("2.8.4")  # exclusive, as in TE 2.20's FlashAttentionUtils.max_version
FLAVOUR_FIELDS = {"fa2": "flash_attn", "fa3": "flash_attn_3", "fa4": "flash_attn_4"}
PRECEDENCE = ("fa4", "fa3", "fa2")
#: The policy lifts this refusal when FA3 is disabled (TE only prefers an enabled FA3).
FA4_PREFERS_FA3_CODE = "fa4.prefer_fa3"


def _fa_version(d: DeviceProfile, flavour: str) -> Version | None:
    return _flavour_version(flavour, d.version(FLAVOUR_FIELDS[flavour]))


@functools.lru_cache(maxsize=256)
def _version_text(flavour: str, text: str | None) -> str | None:
    """``str()`` of :func:`_fa_version` (what a flavour's result records)."""
    v = _flavour_version(flavour, text)
    return str(v) if v else None


@functools.lru_cache(maxsize=256)
def _flavour_version(flavour: str, text: str | None) -> Version | None:
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
def _installed(flavour: str) -> Rule:
    name = DISPLAY_NAMES[flavour]
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
        if _fa_version(d, flavour) is None:
            return refusal(d.source == "local")  # one immutable Reason, built once
        return None

    installed.__name__ = f"{flavour}_installed"
    return installed


def _simple(code: str, flavour: str, test, message: str, observed, limit, hint=None, *,
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


def _too_old(flavour: str, minimum: str, feature: str) -> Rule:
    need = Version(minimum)

    def rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
        v = _fa_version(d, flavour)
        if v is not None and v < need:
            return reject(f"{flavour}.version", f"{feature} requires flash-attn {minimum}+",
                          observed=str(v), limit=f">= {minimum}", hint=f"pip install "
                          f"'flash-attn>={minimum}'")  # fmt: skip
        return None

    rule.__name__ = f"{flavour}_needs_{minimum.replace('.', '_')}"
    rule.__qualname__ = rule.__name__
    rule.__doc__ = f"TE: {feature} requires flash-attn {minimum}+ (FlashAttentionUtils)."
    return rule


# ----------------------------------------------------------------------------- FlashAttention 2
@functools.lru_cache(maxsize=64)
def _fa2_out_of_range(text: str | None, blackwell: bool) -> tuple[Version, Version] | None:
    """``(version, lower bound)`` when flash-attn 2 ``text`` is outside TE's range, else None."""
    v = _flavour_version("fa2", text)
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
    v = _fa_version(d, "fa2")
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
    _too_old("fa2", "2.3", "sliding window attention"), _too_old("fa2", "2.4", "ALiBi"),
    _too_old("fa2", "2.4.1", "deterministic execution"), _too_old("fa2", "2.5", "paged attention"))


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
    _installed("fa2"),
    fa2_version_range,
    _simple("sm", "fa2", lambda c, d: d.sm is not None and d.sm < 80,
            "FlashAttention 2 needs compute capability >= sm80 (found sm{d.sm})",
            lambda c, d: d.sm, ">= 80",
            doc="""TE: "Disabling FlashAttention 2 for compute capability < sm80"."""),
    _simple("dtype", "fa2", lambda c, d: c.dtype not in ("fp16", "bf16"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 2",
            lambda c, d: c.dtype, "fp16, bf16",
            doc="""TE: "Disabling FlashAttention 2 for unsupported qkv_dtype" (bf16, fp16
    only)."""),
    _simple("fp8", "fa2", lambda c, d: c.fp8, "FlashAttention 2 does not run FP8 attention",
            lambda c, d: c.fp8_recipe, "no FP8",
            doc="""TE: "Disabling FlashAttention 2 for FP8 attention"."""),
    _simple("num_splits", "fa2", lambda c, d: c.num_splits != 1,
            "num_splits = {c.num_splits} is not supported by FlashAttention 2",
            lambda c, d: c.num_splits, 1, "num_splits needs FlashAttention 3/4",
            doc="""TE: "Disabling FlashAttention 2 for num_splits"."""),
    fa2_softcap,
    _simple("page_size", "fa2", lambda c, d: c.paged and c.page_size % 256 != 0,
            "paged KV cache page_size = {c.page_size} is not divisible by 256",
            lambda c, d: c.page_size, "% 256 == 0",
            doc="""TE: "Disabling FlashAttention 2 for page size not divisible by 256" (paged
    KV cache)."""),
    _fa2_paged_version,
    _simple("kv_seqlen", "fa2",
            lambda c, d: c.kv_cache and not c.paged and c.max_seqlen_kv % 256 != 0,
            "non-paged KV cache with max_seqlen_kv = {c.max_seqlen_kv} not divisible by 256",
            lambda c, d: c.max_seqlen_kv, "% 256 == 0",
            doc="""TE: "Disabling FlashAttention 2 for non-paged KV cache with max_seqlen_kv not
    divisible by 256" (FA2 gets a block table whose page size is max_seqlen_kv)."""),
    fa2_head_dim,
    _simple("pad_between_seqs", "fa2", lambda c, d: c.pad_between_seqs,
            "thd with padding between sequences is not supported by FlashAttention 2",
            True, "pad_between_seqs=False", "FlashAttention 3/4 and FusedAttention support it",
            doc="""TE: "Disabling FlashAttention 2 for qkv_format = thd when there is padding
    between sequences" (FA3 and FA4 take seqused_q/seqused_k instead)."""),
    _simple("alibi_cross", "fa2",
            lambda c, d: c.bias_type == "alibi" and not c.bottom_right_diagonal
            and c.max_seqlen_q != c.max_seqlen_kv,
            "ALiBi with top-left alignment for cross-attention is not supported",
            "bottom_right_diagonal=False", "bottom-right alignment when s_q != s_kv",
            doc="""TE: "only supports ALiBi with bottom right diagonal alignment for
    cross-attention" (flash-attn 2.4+ ALiBi path)."""),
)  # fmt: skip


FA2 = (*FA2, _fa2_versioned)


# ----------------------------------------------------------------------------- FlashAttention 3
def fa3_head_dims(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE's ``_is_fa3_supported``: head_dim_qk <= 256, h % hg == 0, MLA only as
    (128, 192] x (96, 128] or (<= 64) x (<= 512), and dv > 256 only in fp16/bf16."""
    dqk, dv = c.head_dim_qk, c.head_dim_v
    ok = dqk <= 256 and c.num_heads % c.num_gqa_groups == 0
    if ok and dqk != dv:
        ok = (128 < dqk <= 192 and 96 < dv <= 128) or (dqk <= 64 and dv <= 512)
        ok = ok and not (dv > 256 and c.dtype not in ("fp16", "bf16"))
    if not ok:
        return reject("fa3.head_dim", f"head dims ({dqk}, {dv}) are not supported by "
                      "FlashAttention 3", observed=(dqk, dv),
                      limit="dqk <= 256; MLA: (128,192]x(96,128] or <=64 x <=512")  # fmt: skip
    return None


FA3: tuple[Rule, ...] = (
    _installed("fa3"),
    _simple("sm", "fa3", lambda c, d: d.sm is not None and d.sm != 90,
            "FlashAttention 3 needs compute capability sm90 (found sm{d.sm})",
            lambda c, d: d.sm, "== 90",
            doc="""TE: "Disabling FlashAttention 3 for compute capability != sm90"."""),
    _simple("dtype", "fa3", lambda c, d: c.dtype not in ("fp16", "bf16", "fp8_e4m3"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 3",
            lambda c, d: c.dtype, "fp16, bf16, fp8_e4m3",
            doc="""TE: "Disabling FlashAttention 3 for unsupported qkv_dtype" (bf16, fp16,
    float8_e4m3fn)."""),
    _simple("fp8_training", "fa3", lambda c, d: c.fp8 and c.is_training,
            "FlashAttention 3 does not support FP8 training", "fp8 + is_training",
            "FP8 inference only",
            doc="""TE: "Disabling FlashAttention 3 for FP8 training"."""),
    _simple("fp8_recipe", "fa3", lambda c, d: c.fp8 and c.fp8_recipe not in ("delayed", "current"),
            "FlashAttention 3 does not support the {c.fp8_recipe} FP8 recipe",
            lambda c, d: c.fp8_recipe, "delayed, current",
            doc="""TE: "Disabling FlashAttention 3 for <recipe>" (FP8 only with delayed or current
    scaling)."""),
    _simple("softcap", "fa3", lambda c, d: c.softcap != 0.0,
            "softcap needs a softcap-capable FA3 build (not detectable from package metadata), "
            "head_dim <= 256 and no context parallelism", lambda c, d: c.softcap, 0.0,
            doc="""TE: "Disabling FlashAttention 3 for softcap (requires softcap-capable FA3 build,
    head_dim <= 256, and no context parallelism)"; TE probes the build's signature, which package
    metadata cannot show, so softcap is refused."""),
    _simple("fp8_kv_cache", "fa3", lambda c, d: c.kv_cache and c.fp8 and c.q_format != "thd",
            "FP8 KV caching with FlashAttention 3 needs thd queries",
            lambda c, d: c.q_format, "thd",
            doc="""TE: "Disabling FlashAttention 3 for FP8 KV caching and non-THD"."""),
    fa3_head_dims,
    _simple("dropout", "fa3", lambda c, d: c.dropout != 0.0,
            "FlashAttention 3 does not support dropout", lambda c, d: c.dropout, 0.0,
            doc="""TE: "Disabling FlashAttention 3 for dropout"."""),
    _simple("deterministic_d256", "fa3",
            lambda c, d: c.deterministic and c.is_training
            and max(c.head_dim_qk, c.head_dim_v) >= 256,
            "deterministic backward with max(head_dim_qk, head_dim_v) >= 256",
            lambda c, d: max(c.head_dim_qk, c.head_dim_v), "< 256 when deterministic",
            doc="""TE: "Disabling FlashAttention 3 for deterministic backward with max(head_dim_qk,
    head_dim_v) >= 256"."""),
    _simple("alibi", "fa3", lambda c, d: c.bias_type == "alibi",
            "FlashAttention 3 does not support ALiBi", "alibi", "no alibi",
            doc="""TE: "Disabling FlashAttention 3 for ALiBi"."""),
)  # fmt: skip


# ----------------------------------------------------------------------------- FlashAttention 4
def fa4_head_dims_rule(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE defers to flash-attn-4's ``_validate_head_dims`` (sm90: 8..256; sm100/110: <= 128,
    (192, 128), (64|d, 512), (256, 256); dims divisible by 16 / element size). This rule states
    those limits for when the installed validator cannot be used."""
    dqk, dv = c.head_dim_qk, c.head_dim_v
    align = 16 // (4 if c.dtype == "fp32" else 1 if c.dtype in ("fp8_e4m3", "fp8_e5m2") else 2)
    major = (d.sm or 0) // 10
    aligned = dqk % align == 0 and dv % align == 0
    if major == 9:
        ok = 8 <= dqk <= 256 and 8 <= dv <= 256 and aligned
    elif major in (10, 11):
        ok = aligned and (
            (8 <= dqk <= 128 and 8 <= dv <= 128)
            or (dqk, dv) in ((192, 128), (256, 256))
            or ((dqk == 64 or dqk == dv) and dv == 512)
        )
    else:
        ok = True
    if not ok:
        return reject("fa4.head_dim", f"head dims ({dqk}, {dv}) are not supported by "
                      f"FlashAttention 4 on sm{d.sm}", observed=(dqk, dv),
                      limit="sm90: 8..256; sm100: <=128, (192,128), (256,256), (64,512); "
                      f"divisible by {align}")  # fmt: skip
    return None


_ELEMENT_SIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


@functools.lru_cache(maxsize=1)
def fa4_validator() -> tuple[Callable[..., None] | None, str | None]:
    """flash-attn-4's own ``_validate_head_dims`` and the installed version, or ``(None, ...)``.

    Taken from the imported module when it is loaded, else compiled alone from the installed
    ``flash_attn/cute/interface.py`` (the module needs CUTLASS DSL, which a CPU machine may lack;
    the function itself is plain Python)."""
    try:
        installed = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return None, None
    mod = sys.modules.get("flash_attn.cute.interface")
    fn = getattr(mod, "_validate_head_dims", None)
    if callable(fn):
        return getattr(fn, "__wrapped__", fn), installed
    try:
        files = metadata.files("flash-attn-4") or []
        src = next(f for f in files if str(f).replace("\\", "/").endswith("cute/interface.py"))
        path = Path(str(src.locate()))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name == "_validate_head_dims")  # fmt: skip
        node.decorator_list = []  # a cache at most: it does not change the verdict
        namespace: dict[str, Any] = {"__builtins__": builtins}
        exec(compile(ast.Module([node], []), str(path), "exec"), namespace)  # noqa: S102
        return namespace["_validate_head_dims"], installed
    except (StopIteration, OSError, SyntaxError, ValueError):
        return None, installed


def fa4_head_dims(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE 2.20 calls flash-attn-4's ``_validate_head_dims(d_qk, d_v, cc_major, 16 // element
    size)`` and disables FA4 on its AssertionError. Its verdict (stage ``import``) when it loads
    and the device's FA4 is the installed version; else :func:`fa4_head_dims_rule` (``rule``)."""
    fn, installed = fa4_validator()
    want = version(d.flash_attn_4)
    if fn is None or d.sm is None or want is None or want != version(installed):
        return fa4_head_dims_rule(c, d)
    dqk, dv = c.head_dim_qk, c.head_dim_v
    try:
        fn(dqk, dv, d.sm // 10, 16 // _ELEMENT_SIZE[c.dtype])
    except AssertionError as exc:
        return reject("fa4.head_dim", f"head dims ({dqk}, {dv}) are not supported by "
                      f"FlashAttention 4 {installed} on sm{d.sm}: {exc}".rstrip(": "),
                      observed=(dqk, dv), limit=f"flash-attn-4 {installed} _validate_head_dims",
                      stage="import")  # fmt: skip
    except Exception:  # noqa: BLE001 - a validator we cannot call: our statement of it
        return fa4_head_dims_rule(c, d)
    return None


def fa4_mla_backward_bug(c: FusedAttnConfig, d: DeviceProfile) -> Reason | None:
    """TE: SM100 backward kernel bug with MLA head dims (dK_reduce_ncol misalignment for dV)."""
    if not (c.is_training and c.is_mla and c.head_dim_qk >= 128 and 100 <= (d.sm or 0) < 120):
        return None
    tile, tile_v = math.ceil(c.head_dim_qk / 16) * 16, math.ceil(c.head_dim_v / 16) * 16
    ncol = math.gcd(32, tile // 2)
    if (tile_v // 2) % ncol:
        return reject("fa4.mla_backward", "SM100 backward kernel bug for MLA head dims "
                      f"({c.head_dim_qk}, {c.head_dim_v})", observed=(c.head_dim_qk, c.head_dim_v),
                      limit=f"(ceil16(dv)/2) % {ncol} == 0")  # fmt: skip
    return None


def _sm100(d: DeviceProfile) -> bool:
    return 100 <= (d.sm or 0) < 120


FA4: tuple[Rule, ...] = (
    _installed("fa4"),
    _simple("sm", "fa4", lambda c, d: d.sm is not None and d.sm < 90,
            "FlashAttention 4 needs compute capability >= sm90 (found sm{d.sm})",
            lambda c, d: d.sm, ">= 90",
            doc="""TE: "Disabling FlashAttention 4 for compute capability < sm90"."""),
    _simple("prefer_fa3", "fa4", lambda c, d: d.sm == 90 and d.flash_attn_3 is not None,
            "on sm90 TE prefers FlashAttention 3, which is installed", "flash-attn-3 installed",
            "FA3 absent on sm90",
            doc="""TE: "Disabling FlashAttention 4 to prefer FlashAttention 3 on SM90" (both
    installed)."""),
    _simple("dtype", "fa4", lambda c, d: c.dtype not in ("fp16", "bf16"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 4",
            lambda c, d: c.dtype, "fp16, bf16",
            doc="""TE: "Disabling FlashAttention 4 for unsupported qkv_dtype" (bf16, fp16
    only)."""),
    _simple("fp8", "fa4", lambda c, d: c.fp8, "FlashAttention 4 does not run FP8 attention",
            lambda c, d: c.fp8_recipe, "no FP8",
            doc="""TE: "Disabling FlashAttention 4 for FP8 attention"."""),
    _simple("num_splits", "fa4", lambda c, d: c.num_splits != 1 and (d.sm or 0) < 100,
            "num_splits on sm < 100 is not supported by FlashAttention 4",
            lambda c, d: c.num_splits, "1 below sm100",
            doc="""TE: "Disabling FlashAttention 4 for num_splits on SM < 100" (SplitKV needs
    sm100+)."""),
    _simple("softcap", "fa4", lambda c, d: c.softcap != 0.0,
            "TE does not pass softcap to FlashAttention 4", lambda c, d: c.softcap, 0.0,
            doc="""TE: "Disabling FlashAttention 4 as TE does not pass it softcap"."""),
    _simple("kv_cache", "fa4", lambda c, d: c.kv_cache,
            "FlashAttention 4 does not support KV cache", True, "no KV cache",
            doc="""TE: "Disabling FlashAttention 4 as it does not support KV cache"."""),
    fa4_head_dims,
    _simple("d512_sm100", "fa4", lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 512,
            "symmetric head_dim = 512 is not supported on SM100/SM110", 512, "!= (512, 512)",
            doc="""TE: "Disabling FlashAttention 4 for unsupported symmetric head_dim=512 on
    SM100/SM110"."""),
    _simple("d256_cross_sm100", "fa4",
            lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 256
            and c.max_seqlen_q != c.max_seqlen_kv,
            "head_dim = 256 cross-attention (s_q != s_kv) is not supported on SM100",
            lambda c, d: (c.max_seqlen_q, c.max_seqlen_kv), "s_q == s_kv",
            doc="""TE: "Disabling FlashAttention 4 for SM100 head_dim=256 cross-attention"."""),
    fa4_mla_backward_bug,
    _simple("dropout", "fa4", lambda c, d: c.dropout != 0.0,
            "FlashAttention 4 does not support dropout", lambda c, d: c.dropout, 0.0,
            doc="""TE: "Disabling FlashAttention 4 for dropout"."""),
    _simple("cp_comm_type", "fa4",
            lambda c, d: c.context_parallel and c.cp_comm_type not in ("p2p", "all_gather", "a2a"),
            "context parallelism with cp_comm_type = {c.cp_comm_type}",
            lambda c, d: c.cp_comm_type, "p2p, all_gather, a2a",
            doc="""TE: "Disabling FlashAttention 4 for context parallelism with cp_comm_type = %s"
    (p2p, all_gather, a2a only)."""),
    _simple("window_d256_sm100", "fa4",
            lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 256 and c.has_window,
            "sliding window with head_dim = 256 is not supported on SM100",
            lambda c, d: c.window_size, "no window at head_dim 256",
            doc="""TE: "Disabling FlashAttention 4 as SM100 head_dim=256 does not support
    sliding-window/local attention yet"."""),
    _simple("alibi", "fa4", lambda c, d: c.bias_type == "alibi",
            "FlashAttention 4 does not support ALiBi", "alibi", "no alibi",
            doc="""TE: "Disabling FlashAttention 4 for ALiBi"."""),
)  # fmt: skip

FLAVOUR_RULES: dict[str, tuple[Rule, ...]] = {"fa2": FA2, "fa3": FA3, "fa4": FA4}


@functools.lru_cache(maxsize=8)
def import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (``"ImportError: ..."``), or None; once per process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken build may raise anything at import
        return f"{type(exc).__name__}: {exc}"
    return None


def combine(variants: tuple[ProbeResult, ...], elapsed_ms: float = 0.0) -> ProbeResult:
    """The ``flash`` result from its flavours: supported when one is; otherwise every reason
    once (shared ones first, as each flavour lists them first)."""
    chosen = next((v for v in variants if v.supported), None)
    merged: list[Reason] = []
    if chosen is None:
        seen: set[tuple[str, str]] = set()
        for v in variants:
            for r in v.reasons:
                if (r.code, r.message) not in seen:
                    seen.add((r.code, r.message))
                    merged.append(r)
    return ProbeResult(
        backend="flash",
        supported=chosen is not None,
        reasons=tuple(merged),
        stage="rule",
        evidence="rules",
        elapsed_ms=elapsed_ms,
        detail={
            "variant": chosen.backend if chosen else None,
            "version": chosen.detail.get("version") if chosen else None,
        },
        variants=variants,
    )


class FlashAttnProbe:
    """The ``flash`` candidate: one variant result per flavour, TE's precedence among them.

    On the local device a flavour that passes its rules is imported (stage ``import``: a failure
    is a refusal carrying the import error) and, with a CUDA GPU, runs one tiny problem of the
    config's kind (stage ``run``; FA2 gets TE's MLA head-dim padding, see
    :func:`~te_fl_attention.kernels.run.pad_head_dims`; on a GPU the run is isolated in a worker
    process, :mod:`te_fl_attention.run_worker`). ``run=False`` stops after the rules."""

    name = "flash"

    def __init__(self, run: bool = True):
        self.run = run

    def rules(self, config: FusedAttnConfig, device: DeviceProfile) -> list[Reason]:
        """The rule stage's refusals (none when a flavour passes its rules); no import, no run."""
        return list(combine(self.rule_stage(config, device)).reasons)

    @staticmethod
    def shared(config: FusedAttnConfig, device: DeviceProfile) -> tuple[Reason, ...]:
        """The refusals of the rules TE applies to FlashAttention as a whole."""
        return tuple(evaluate(SHARED, config, device))

    def rule_variant(self, flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                     shared: tuple[Reason, ...] | None = None) -> ProbeResult:  # fmt: skip
        """``flavour``'s rule-stage result (the shared rules, then its own); ``shared``: the
        shared rules' refusals, when already known."""
        if shared is None:
            shared = self.shared(config, device)
        return self._rule_variant(flavour, config, device, list(shared), FLAVOUR_RULES[flavour])

    def rule_stage(self, config: FusedAttnConfig, device: DeviceProfile
                   ) -> tuple[ProbeResult, ...]:  # fmt: skip
        """Each flavour's rule-stage result, in TE's precedence."""
        shared = self.shared(config, device)
        return tuple(self.rule_variant(f, config, device, shared) for f in PRECEDENCE)

    @staticmethod
    def _rule_variant(flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                      shared: list[Reason], rules: tuple[Rule, ...],
                      own: list[Reason] | None = None) -> ProbeResult:  # fmt: skip
        """The flavour's rule-stage result; ``own``: its rules' refusals, when already known."""
        if own is None:
            own = evaluate(rules, config, device)
        return ProbeResult(
            backend=flavour,
            supported=not shared and not own,
            reasons=tuple(shared + own),
            stage="import" if own and own[0].stage == "import" else "rule",
            evidence="rules",
            detail={"version": _version_text(flavour, device.version(FLAVOUR_FIELDS[flavour]))},
        )

    def variant(self, flavour: str, config: FusedAttnConfig, device: DeviceProfile,
                shared: list[Reason]) -> ProbeResult:  # fmt: skip
        result = self._rule_variant(flavour, config, device, shared, FLAVOUR_RULES[flavour])
        return self._after_rules(result, config, device)

    def _after_rules(self, result: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
                     ) -> ProbeResult:  # fmt: skip
        if result.supported and self.run and device.source == "local":
            return self._local(result.backend, config, result)
        return result

    def narrow(self, cached: ProbeResult, config: FusedAttnConfig, device: DeviceProfile
               ) -> ProbeResult | None:  # fmt: skip
        """A cached ``flash`` result under this process's rules, flavour by flavour: a flavour
        ``cached`` claims supported and the local rules refuse gets their refusal; the others
        keep their cached result (it may only refuse more); the candidate is supported when a
        flavour is. ``None``: ``cached`` is not a flash result as this probe writes it (one
        variant per flavour, supported when one is): probe again."""
        if cached.backend != self.name:
            return None
        variants = cached.variants
        if tuple([v.backend for v in variants]) != PRECEDENCE:
            return None  # not what this probe writes: probe again
        # a flavour refused in cache stays refused; one claimed supported must pass our rules
        out, changed, supported = [], False, False
        for v in variants:
            if v.supported:
                supported = True
                n = self._narrow_variant(v, config, device)
                changed = changed or n is not v
                v = n
            out.append(v)
        if supported != cached.supported:
            return None  # not what this probe writes (supported when a flavour is): probe again
        return combine(tuple(out), cached.elapsed_ms) if changed else cached

    def _local(self, flavour: str, config: FusedAttnConfig, result: ProbeResult) -> ProbeResult:
        """The import and tiny-run stages on this machine."""
        from ..kernels import run as runner

        dist, module = runner.FLASH_MODULES[flavour]
        name = DISPLAY_NAMES[flavour]
        err = import_error(module)
        if err is not None:
            why = reject(f"{flavour}.import_failed", f"{name} ({dist} "
                         f"{result.detail.get('version')}) is installed but {module} cannot be "
                         f"imported: {err}"[:2000], observed=err[:300], limit=f"import {module}",
                         stage="import", hint=f"reinstall {dist} for this torch/CUDA")  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(why,), stage="import")
        import torch

        if not torch.cuda.is_available():
            return dataclasses.replace(result, stage="import", evidence=f"import {module}",
                                       detail={**result.detail, "run_note": "no CUDA device: "
                                               "the tiny call was not run"})  # fmt: skip
        from .. import verify

        note, exc = verify.tiny_run(flavour, config)  # gpu-only
        if exc is not None:  # gpu-only
            error = verify.describe_error(exc)
            why = reject(f"{flavour}.run_failed", f"{name} failed on a tiny problem: {error}",
                         observed=verify.error_type(exc), limit="runs without error",
                         stage="run")  # fmt: skip
            return dataclasses.replace(result, supported=False, reasons=(why,), stage="run")
        detail = {**result.detail, **({"run_note": note} if note else {})}  # gpu-only
        return dataclasses.replace(result, stage="run" if note is None else "import",  # gpu-only
                                   evidence=f"import {module}" + ("" if note else " + tiny run"),
                                   detail=detail)  # fmt: skip

    def _narrow_variant(self, cached: ProbeResult, config: FusedAttnConfig,
                        device: DeviceProfile) -> ProbeResult:  # fmt: skip
        """``cached`` (a flavour claimed supported) when the local rules pass it, else their
        refusal (:meth:`rule_variant`'s result). The passing case builds no result."""
        flavour = cached.backend
        rules = FLAVOUR_RULES.get(flavour)
        if rules is None:  # not a flavour of ours
            return self.rule_variant(flavour, config, device)
        shared = self.shared(config, device)
        if not shared:
            own = evaluate(rules, config, device)
            if not own:
                return cached
            local = self._rule_variant(flavour, config, device, [], rules, own)
        else:
            local = self.rule_variant(flavour, config, device, shared)
        return cached if local.supported else local

    def probe(self, config: FusedAttnConfig, device: DeviceProfile) -> ProbeResult:
        t0 = time.perf_counter()
        if not self.run or device.source != "local":  # the rule stage is the verdict
            return combine(self.rule_stage(config, device), (time.perf_counter() - t0) * 1e3)
        variants = tuple(self._after_rules(r, config, device)
                         for r in self.rule_stage(config, device))  # fmt: skip
        return combine(variants, (time.perf_counter() - t0) * 1e3)


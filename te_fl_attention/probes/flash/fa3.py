"""FlashAttention 3 (flash-attn 3, hopper): TE 2.20's rules for the flavour."""

from __future__ import annotations

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import Rule, reject
from .rules import installed_rule, simple


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
    installed_rule("fa3"),
    simple("sm", "fa3", lambda c, d: d.sm is not None and d.sm != 90,
            "FlashAttention 3 needs compute capability sm90 (found sm{d.sm})",
            lambda c, d: d.sm, "== 90",
            doc="""TE: "Disabling FlashAttention 3 for compute capability != sm90"."""),
    simple("dtype", "fa3", lambda c, d: c.dtype not in ("fp16", "bf16", "fp8_e4m3"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 3",
            lambda c, d: c.dtype, "fp16, bf16, fp8_e4m3",
            doc="""TE: "Disabling FlashAttention 3 for unsupported qkv_dtype" (bf16, fp16,
    float8_e4m3fn)."""),
    simple("fp8_training", "fa3", lambda c, d: c.fp8 and c.is_training,
            "FlashAttention 3 does not support FP8 training", "fp8 + is_training",
            "FP8 inference only",
            doc="""TE: "Disabling FlashAttention 3 for FP8 training"."""),
    simple("fp8_recipe", "fa3", lambda c, d: c.fp8 and c.fp8_recipe not in ("delayed", "current"),
            "FlashAttention 3 does not support the {c.fp8_recipe} FP8 recipe",
            lambda c, d: c.fp8_recipe, "delayed, current",
            doc="""TE: "Disabling FlashAttention 3 for <recipe>" (FP8 only with delayed or current
    scaling)."""),
    simple("softcap", "fa3", lambda c, d: c.softcap != 0.0,
            "softcap needs a softcap-capable FA3 build (not detectable from package metadata), "
            "head_dim <= 256 and no context parallelism", lambda c, d: c.softcap, 0.0,
            doc="""TE: "Disabling FlashAttention 3 for softcap (requires softcap-capable FA3 build,
    head_dim <= 256, and no context parallelism)"; TE probes the build's signature, which package
    metadata cannot show, so softcap is refused."""),
    simple("fp8_kv_cache", "fa3", lambda c, d: c.kv_cache and c.fp8 and c.q_format != "thd",
            "FP8 KV caching with FlashAttention 3 needs thd queries",
            lambda c, d: c.q_format, "thd",
            doc="""TE: "Disabling FlashAttention 3 for FP8 KV caching and non-THD"."""),
    fa3_head_dims,
    simple("dropout", "fa3", lambda c, d: c.dropout != 0.0,
            "FlashAttention 3 does not support dropout", lambda c, d: c.dropout, 0.0,
            doc="""TE: "Disabling FlashAttention 3 for dropout"."""),
    simple("deterministic_d256", "fa3",
            lambda c, d: c.deterministic and c.is_training
            and max(c.head_dim_qk, c.head_dim_v) >= 256,
            "deterministic backward with max(head_dim_qk, head_dim_v) >= 256",
            lambda c, d: max(c.head_dim_qk, c.head_dim_v), "< 256 when deterministic",
            doc="""TE: "Disabling FlashAttention 3 for deterministic backward with max(head_dim_qk,
    head_dim_v) >= 256"."""),
    simple("alibi", "fa3", lambda c, d: c.bias_type == "alibi",
            "FlashAttention 3 does not support ALiBi", "alibi", "no alibi",
            doc="""TE: "Disabling FlashAttention 3 for ALiBi"."""),
)  # fmt: skip

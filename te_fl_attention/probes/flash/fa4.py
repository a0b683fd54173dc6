"""FlashAttention 4 (flash-attn 4, cute): TE 2.20's rules for the flavour; head dims judged by
flash-attn-4's own ``_validate_head_dims`` when the installed one can be loaded."""

from __future__ import annotations

import ast
import builtins
import functools
import math
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from ...config import FusedAttnConfig
from ...device import DeviceProfile
from ...reasons import Reason
from ..base import Rule, reject, version
from .rules import installed_rule, simple


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
    installed_rule("fa4"),
    simple("sm", "fa4", lambda c, d: d.sm is not None and d.sm < 90,
            "FlashAttention 4 needs compute capability >= sm90 (found sm{d.sm})",
            lambda c, d: d.sm, ">= 90",
            doc="""TE: "Disabling FlashAttention 4 for compute capability < sm90"."""),
    simple("prefer_fa3", "fa4", lambda c, d: d.sm == 90 and d.flash_attn_3 is not None,
            "on sm90 TE prefers FlashAttention 3, which is installed", "flash-attn-3 installed",
            "FA3 absent on sm90",
            doc="""TE: "Disabling FlashAttention 4 to prefer FlashAttention 3 on SM90" (both
    installed)."""),
    simple("dtype", "fa4", lambda c, d: c.dtype not in ("fp16", "bf16"),
            "qkv_dtype = {c.dtype} is not supported by FlashAttention 4",
            lambda c, d: c.dtype, "fp16, bf16",
            doc="""TE: "Disabling FlashAttention 4 for unsupported qkv_dtype" (bf16, fp16
    only)."""),
    simple("fp8", "fa4", lambda c, d: c.fp8, "FlashAttention 4 does not run FP8 attention",
            lambda c, d: c.fp8_recipe, "no FP8",
            doc="""TE: "Disabling FlashAttention 4 for FP8 attention"."""),
    simple("num_splits", "fa4", lambda c, d: c.num_splits != 1 and (d.sm or 0) < 100,
            "num_splits on sm < 100 is not supported by FlashAttention 4",
            lambda c, d: c.num_splits, "1 below sm100",
            doc="""TE: "Disabling FlashAttention 4 for num_splits on SM < 100" (SplitKV needs
    sm100+)."""),
    simple("softcap", "fa4", lambda c, d: c.softcap != 0.0,
            "TE does not pass softcap to FlashAttention 4", lambda c, d: c.softcap, 0.0,
            doc="""TE: "Disabling FlashAttention 4 as TE does not pass it softcap"."""),
    simple("kv_cache", "fa4", lambda c, d: c.kv_cache,
            "FlashAttention 4 does not support KV cache", True, "no KV cache",
            doc="""TE: "Disabling FlashAttention 4 as it does not support KV cache"."""),
    fa4_head_dims,
    simple("d512_sm100", "fa4", lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 512,
            "symmetric head_dim = 512 is not supported on SM100/SM110", 512, "!= (512, 512)",
            doc="""TE: "Disabling FlashAttention 4 for unsupported symmetric head_dim=512 on
    SM100/SM110"."""),
    simple("d256_cross_sm100", "fa4",
            lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 256
            and c.max_seqlen_q != c.max_seqlen_kv,
            "head_dim = 256 cross-attention (s_q != s_kv) is not supported on SM100",
            lambda c, d: (c.max_seqlen_q, c.max_seqlen_kv), "s_q == s_kv",
            doc="""TE: "Disabling FlashAttention 4 for SM100 head_dim=256 cross-attention"."""),
    fa4_mla_backward_bug,
    simple("dropout", "fa4", lambda c, d: c.dropout != 0.0,
            "FlashAttention 4 does not support dropout", lambda c, d: c.dropout, 0.0,
            doc="""TE: "Disabling FlashAttention 4 for dropout"."""),
    simple("cp_comm_type", "fa4",
            lambda c, d: c.context_parallel and c.cp_comm_type not in ("p2p", "all_gather", "a2a"),
            "context parallelism with cp_comm_type = {c.cp_comm_type}",
            lambda c, d: c.cp_comm_type, "p2p, all_gather, a2a",
            doc="""TE: "Disabling FlashAttention 4 for context parallelism with cp_comm_type = %s"
    (p2p, all_gather, a2a only)."""),
    simple("window_d256_sm100", "fa4",
            lambda c, d: _sm100(d) and c.head_dim_qk == c.head_dim_v == 256 and c.has_window,
            "sliding window with head_dim = 256 is not supported on SM100",
            lambda c, d: c.window_size, "no window at head_dim 256",
            doc="""TE: "Disabling FlashAttention 4 as SM100 head_dim=256 does not support
    sliding-window/local attention yet"."""),
    simple("alibi", "fa4", lambda c, d: c.bias_type == "alibi",
            "FlashAttention 4 does not support ALiBi", "alibi", "no alibi",
            doc="""TE: "Disabling FlashAttention 4 for ALiBi"."""),
)  # fmt: skip

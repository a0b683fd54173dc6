"""`FusedAttnConfig`: one attention problem, normalized the way TransformerEngine normalizes it.

The config is the single currency between TE, the CLI, the probes and the cache. Two configs that
TE would treat alike compare equal and share one :meth:`FusedAttnConfig.key`. Importing this module
never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

try:  # the canonical key's fast encoder (byte-identical to json's where it is used)
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a dependency
    _orjson = None

#: Bumped whenever the meaning of a field or the normalization changes (it is part of the key).
#: 2: ``num_tokens_q`` / ``num_tokens_kv`` (TE 2.20's token counts, bucketed) were added.
CONFIG_SCHEMA = 2

DTYPES = ("fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")

#: Every qkv_layout string TE accepts (``QKVLayout`` in TE's cpp_extensions), paged forms included.
QKV_LAYOUTS = (
    "sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
    "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd",
    "t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd",
    "sbhd_bshd_bshd", "bshd_sbhd_sbhd", "thd_bshd_bshd", "thd_sbhd_sbhd",
    "paged_kv_bshd_bshd_bshd", "paged_kv_bshd_sbhd_sbhd", "paged_kv_sbhd_bshd_bshd",
    "paged_kv_sbhd_sbhd_sbhd", "paged_kv_thd_bshd_bshd", "paged_kv_thd_sbhd_sbhd",
    "bhsd_bhsd_bhsd",
)  # fmt: skip

MASK_TYPES = (
    "no_mask", "padding", "causal", "padding_causal",
    "causal_bottom_right", "padding_causal_bottom_right", "arbitrary",
)  # fmt: skip
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
BIAS_SHAPES = ("1hss", "b1ss", "bhss", "11ss", "111s")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
FP8_RECIPES = ("none", "delayed", "current", "mxfp8", "block", "nvfp4")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")

# TE recipe class name -> our recipe name (``fp8_meta["recipe"]``).
_RECIPE_CLASSES = {
    "DelayedScaling": "delayed",
    "Float8CurrentScaling": "current",
    "MXFP8BlockScaling": "mxfp8",
    "Float8BlockScaling": "block",
    "NVFP4BlockScaling": "nvfp4",
}
# str(torch.dtype) -> our dtype name (no torch import needed).
_TORCH_DTYPES = {
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}
_MASK_ALIASES = {"causal,padding": "padding_causal", "padding,causal": "padding_causal",
                 "causal_padding": "padding_causal"}  # fmt: skip


#: TE's sizes and counts are C ``int32_t`` (``NVTETensor`` shapes, ``max_seqlen``, token counts).
INT32_MAX = 2**31 - 1

#: Every numeric field's allowed range, in one place: ``name -> (lo, hi, why)``, both ends
#: included unless ``_OPEN`` says otherwise. The README lists the same table (``ranges_table``).
RANGES: dict[str, tuple[float, float, str]] = {
    "batch_size": (1, INT32_MAX, "TE's int32"),
    "max_seqlen_q": (1, INT32_MAX, "TE's int32"),
    "max_seqlen_kv": (1, INT32_MAX, "TE's int32"),
    "num_tokens_q": (0, INT32_MAX, "TE's int32; 0: no count"),
    "num_tokens_kv": (0, INT32_MAX, "TE's int32; 0: no count"),
    "num_heads": (1, 2**16, "2^16"),
    "num_gqa_groups": (1, 2**16, "2^16; divides num_heads"),
    "head_dim_qk": (1, 1024, "each backend's rules say which it runs"),
    "head_dim_v": (1, 1024, "each backend's rules say which it runs"),
    "page_size": (0, INT32_MAX, "TE's int32; >= 1 when paged"),
    "cp_size": (1, 2**16, "ranks of the context-parallel group"),
    "num_splits": (1, 2**16, "flash-attn's split count"),
    "window_size": (-1, INT32_MAX, "each of (left, right); -1: unbounded"),
    "dropout": (0.0, 1.0, "a probability; 1 excluded"),
    "softcap": (0.0, 1e30, "0: off"),
    "softmax_scale": (0.0, 1e30, "unset: 1/sqrt(head_dim_qk)"),
}
#: Range ends excluded: ``dropout < 1``, ``softmax_scale > 0``.
_OPEN = {"dropout": "hi", "softmax_scale": "lo"}
#: Nesting allowed in a JSON config (a config is flat: lists of two numbers at most).
MAX_JSON_DEPTH = 32
#: Size of a ``--config`` file read at most.
MAX_CONFIG_BYTES = 1 << 20


def _show(value: Any, limit: int = 120) -> str:
    """``repr(value)``, shortened: an error message never carries a huge or deep input."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} chars)"


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={_show(value)} is not valid: {allowed}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; names are case-insensitive (lowercased)."""
    if isinstance(value, str):
        if value in allowed:
            return value
        low = value.lower()
        if low in allowed:
            return low
    raise _bad(name, value, "allowed: " + ", ".join(allowed))


def allowed_text(name: str) -> str:
    """What a numeric field accepts, as the errors and ``--help`` say it."""
    lo, hi, why = RANGES[name]
    if isinstance(lo, float):
        left = "(" if _OPEN.get(name) == "lo" else "["
        right = ")" if _OPEN.get(name) == "hi" else "]"
        return f"a number in {left}{lo:g}, {hi:g}{right} ({why})"
    return f"an integer in [{lo}, {hi}] ({why})"


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer within ``RANGES[name]`` (``minimum`` raises the lower end)."""
    lo, hi, _ = RANGES[name]
    lo = lo if minimum is None else max(lo, minimum)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        allowed = allowed_text(name)
        if minimum is not None and minimum > RANGES[name][0]:
            allowed += f", here >= {minimum}"
        raise _bad(name, value, f"expected {allowed}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "expected true or false")
    return value


def _float(name: str, value: Any) -> float:
    """A finite number within ``RANGES[name]`` (``dropout``: below 1)."""
    lo, hi, _ = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, f"expected {allowed_text(name)}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise _bad(name, value, f"expected {allowed_text(name)}") from None
    open_end = _OPEN.get(name)
    if (not math.isfinite(value) or value < lo or value > hi
            or (open_end == "hi" and value == hi) or (open_end == "lo" and value == lo)):
        raise _bad(name, value, f"expected {allowed_text(name)}")
    return value


#: The string fields and what each accepts (case-insensitive, stored lowercase).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES, "qkv_layout": QKV_LAYOUTS, "attn_mask_type": MASK_TYPES,
    "bias_type": BIAS_TYPES, "bias_shape": BIAS_SHAPES, "softmax_type": SOFTMAX_TYPES,
    "fp8_recipe": FP8_RECIPES, "cp_comm_type": CP_COMM_TYPES,
}  # fmt: skip
_DEFAULTS_TO = {"max_seqlen_kv": "max_seqlen_q", "num_gqa_groups": "num_heads",
                "head_dim_v": "head_dim_qk"}  # fmt: skip


def field_help(name: str) -> str:
    """What a config field accepts, for ``--help`` (every value the CLI flag takes)."""
    if name in CHOICES:
        text = "one of " + ", ".join(CHOICES[name])
        if name == "attn_mask_type":
            text += " (also causal,padding)"
        return text
    if name == "window_size":
        return f"LEFT,RIGHT, each {allowed_text(name).replace('an integer ', '')}"
    if name == "alibi_slopes_shape":
        return "NUM_HEADS or BATCH,NUM_HEADS (with bias_type alibi)"
    if name in RANGES:
        text = allowed_text(name)
        return text + (f"; default: {_DEFAULTS_TO[name]}" if name in _DEFAULTS_TO else "")
    return "true or false (--no-... for false)"


def ranges_table() -> str:
    """The README's table of numeric ranges (markdown), from :data:`RANGES`."""
    lines = ["| field | allowed |", "|---|---|"]
    for name in RANGES:
        lines.append(f"| `{name}` | {allowed_text(name)} |")
    return "\n".join(lines)


def parse_json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """Strict JSON holding one object: no NaN/Infinity, no duplicate keys, nesting at most
    :data:`MAX_JSON_DEPTH`; anything else is a ``ValueError`` naming ``what``."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"key {_show(key)} appears twice")
            out[key] = value
        return out

    try:
        data = json.loads(text, parse_constant=constant, object_pairs_hook=pairs)
    except RecursionError:
        raise ValueError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN, a duplicate key, an int past Python's digit limit
        raise ValueError(f"{what}: not valid strict JSON: {exc}") from None
    if not isinstance(data, dict):
        kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
                 int: "a number", float: "a number"}  # fmt: skip
        kind = kinds.get(type(data), type(data).__name__)
        raise ValueError(f"{what} must hold a JSON object ({{\"num_heads\": 32, ...}}), not "
                         f"{kind}: {_show(data, 60)}")  # fmt: skip
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return data


def _te_bucket(n: int, floor_log2: int, pow2_log2: int) -> int:
    """TE's size buckets (fused_attn/utils.cu): ``2**floor_log2`` up to it, the next power of two
    up to ``2**pow2_log2``, then the next multiple of ``2**pow2_log2``."""
    log2 = max(0, (int(n) - 1).bit_length())  # ceil(log2 n)
    if log2 <= floor_log2:
        return 1 << floor_log2
    if log2 <= pow2_log2:
        return 1 << log2
    step = 1 << pow2_log2
    return -(-int(n) // step) * step


def te_max_tokens(num_tokens: int) -> int:
    """TE's token bucket for a ragged (thd) tensor: ``t <= 1024`` -> 1024; up to 32768 -> the next
    power of two; above -> the next multiple of 32768. TE 2.20.2 fused_attn/utils.cu,
    ``get_max_tokens`` (used by ``FusedAttnConfig::derive()`` for ``bucketed_num_tokens_q/kv``)."""
    return _te_bucket(num_tokens, 10, 15)


def te_max_batch_size(batch_size: int) -> int:
    """TE's batch bucket for ragged graphs: ``b <= 32`` -> 32; up to 512 -> the next power of two;
    above -> the next multiple of 512. TE 2.20.2 fused_attn/utils.cu, ``get_max_batch_size``."""
    return _te_bucket(batch_size, 5, 9)


def ragged_pieces(qkv_layout: str) -> tuple[bool, bool]:
    """Whether TE's C++ sees a ragged (thd) q and a ragged k/v in this layout: its
    ``nvte_get_q_format`` / ``nvte_get_kv_format`` (``thd_bshd_bshd``: q only;
    ``paged_kv_thd_bshd_bshd``: q only; ``t3hd``: both). TE 2.20.2 config_and_params.cpp,
    ``FusedAttnConfig::derive()``: ``is_ragged_q/kv``."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    return "t" in parts[0], "t" in (parts[1] if len(parts) > 1 else parts[0])


def _tokens(value: Any) -> int | None:
    """A token count read from TE's params: an int as given (validation names a bad one)."""
    if value is None or isinstance(value, bool):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def is_causal(mask: str) -> bool:
    """True for every causal mask type (top-left and bottom-right)."""
    return "causal" in mask


def normalize_mask(mask: Any) -> str:
    """TE's mask spelling rules: ``"causal,padding"`` and friends become ``padding_causal``."""
    if isinstance(mask, str):
        mask = _MASK_ALIASES.get(mask.lower(), mask)
    return _choice("attn_mask_type", mask, MASK_TYPES)


def normalize_window(mask: str, window: Any) -> tuple[int, int]:
    """Mirror TE's ``check_set_window_size``: one canonical window per mask type.

    Causal masks: ``None``/``(-1, -1)`` -> ``(-1, 0)``; ``(l >= 0, r != 0)`` -> ``(l, 0)``.
    Other masks: ``None``/``(-1, 0)`` -> ``(-1, -1)``. Anything else negative is an error.
    """
    if window is None:
        return (-1, 0) if is_causal(mask) else (-1, -1)
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) for w in window)
    ):
        raise _bad("window_size", window, "expected None or a pair of integers (left, right)")
    left, right = int(window[0]), int(window[1])
    if not (-1 <= left <= INT32_MAX and -1 <= right <= INT32_MAX):
        raise _bad("window_size", window, f"expected {allowed_text('window_size')}")
    if is_causal(mask):
        if (left, right) in ((-1, -1), (-1, 0)):
            return (-1, 0)
        if left >= 0 and right >= -1:
            return (left, 0)
        raise _bad("window_size", window, f"attn_mask_type={mask} needs (-1, 0) or (>=0, 0)")
    if (left, right) in ((-1, 0), (-1, -1)):
        return (-1, -1)
    if left < 0 or right < 0:
        raise _bad("window_size", window, f"attn_mask_type={mask} needs (-1, -1) or (>=0, >=0)")
    return (left, right)


def layout_formats(qkv_layout: str, kv_cache: bool = False) -> tuple[str, str, str]:
    """TE's ``get_qkv_format``: ``(qkv_format, q_format, kv_format)`` of a layout string."""
    parts = qkv_layout.replace("paged_kv_", "").split("_")
    q_fmt = "".join(c for c in parts[0] if c.isalpha())
    if kv_cache:
        kv_fmt = "".join(c for c in parts[1] if c.isalpha())
        qkv_fmt = q_fmt if q_fmt == kv_fmt else f"{q_fmt}_2{kv_fmt}"
        return qkv_fmt, q_fmt, kv_fmt
    return q_fmt, q_fmt, q_fmt


def layout_group(qkv_layout: str) -> str:
    """Layout with b/s/t removed: ``hd_hd_hd`` separate, ``3hd``/``hd_2hd``... packed."""
    return qkv_layout.replace("paged_kv_", "").replace("b", "").replace("s", "").replace("t", "")


@dataclass(frozen=True)
class FusedAttnConfig:
    """One attention problem, as TE's ``AttentionParams`` describes it, normalized and validated.

    ``fp8`` means FP8 dot-product attention (TE's ``fp8 and fp8_meta["recipe"].fp8_dpa``).
    Fields that cannot change any backend's answer in a given setting are normalized to their
    default (e.g. ``cp_comm_type`` without context parallelism), so they do not split the key.
    """

    batch_size: int = 1
    max_seqlen_q: int = 128
    max_seqlen_kv: int | None = None
    num_heads: int = 16
    num_gqa_groups: int | None = None
    head_dim_qk: int = 64
    head_dim_v: int | None = None
    dtype: str = "bf16"
    qkv_layout: str = "bshd_bshd_bshd"
    attn_mask_type: str = "no_mask"
    window_size: tuple[int, int] | None = None
    bottom_right_diagonal: bool | None = None
    bias_type: str = "no_bias"
    bias_shape: str | None = None
    bias_requires_grad: bool = False
    alibi_slopes_shape: tuple[int, ...] | None = None
    dropout: float = 0.0
    softmax_type: str = "vanilla"
    softcap: float = 0.0
    is_training: bool = True
    deterministic: bool = False
    fp8: bool = False
    fp8_recipe: str = "none"
    fp8_mha: bool = False
    fp8_output: bool = False
    context_parallel: bool = False
    cp_comm_type: str = "p2p"
    cp_size: int = 1
    pad_between_seqs: bool = False
    kv_cache: bool = False
    paged: bool = False
    page_size: int = 0
    num_splits: int = 1
    return_max_logit: bool = False
    cuda_graph: bool = False
    has_score_mod: bool = False
    has_score_mod_bprop: bool = False
    checkpoint_core_attention: bool = False
    softmax_scale: float | None = None
    num_tokens_q: int | None = None
    num_tokens_kv: int | None = None

    # ------------------------------------------------------------------ normalization
    def __post_init__(self) -> None:  # noqa: C901 - one linear pass over the fields
        s = object.__setattr__
        for name in ("batch_size", "max_seqlen_q", "num_heads", "head_dim_qk"):
            _int(name, getattr(self, name))
        s(self, "max_seqlen_kv", _int("max_seqlen_kv", self.max_seqlen_kv)
          if self.max_seqlen_kv is not None else self.max_seqlen_q)  # fmt: skip
        s(self, "num_gqa_groups", _int("num_gqa_groups", self.num_gqa_groups)
          if self.num_gqa_groups is not None else self.num_heads)  # fmt: skip
        s(self, "head_dim_v", _int("head_dim_v", self.head_dim_v)
          if self.head_dim_v is not None else self.head_dim_qk)  # fmt: skip
        if self.num_heads % self.num_gqa_groups:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by "
                f"num_gqa_groups={self.num_gqa_groups}"
            )
        s(self, "dtype", _choice("dtype", self.dtype, DTYPES))
        s(self, "qkv_layout", _choice("qkv_layout", self.qkv_layout, QKV_LAYOUTS))
        for name in ("bias_requires_grad", "is_training", "deterministic", "fp8", "fp8_mha",
                     "fp8_output", "context_parallel", "pad_between_seqs", "kv_cache", "paged",
                     "return_max_logit", "cuda_graph", "has_score_mod", "has_score_mod_bprop",
                     "checkpoint_core_attention"):  # fmt: skip
            _bool(name, getattr(self, name))

        # Layout: packed layouts put q/k/v (3) or k/v (2) in one tensor, so shapes must agree.
        group = layout_group(self.qkv_layout)
        if "3" in group and (self.num_heads != self.num_gqa_groups
                             or self.head_dim_qk != self.head_dim_v):  # fmt: skip
            raise ValueError(
                f"qkv_layout={self.qkv_layout} packs q, k and v in one tensor: it needs "
                f"num_heads == num_gqa_groups and head_dim_qk == head_dim_v (got "
                f"{self.num_heads}/{self.num_gqa_groups}, {self.head_dim_qk}/{self.head_dim_v})"
            )
        if "2" in group and self.head_dim_qk != self.head_dim_v:
            raise ValueError(
                f"qkv_layout={self.qkv_layout} packs k and v in one tensor: it needs "
                f"head_dim_qk == head_dim_v (got {self.head_dim_qk}/{self.head_dim_v})"
            )

        # KV cache / paging. A paged_kv_ layout implies a paged KV cache.
        if self.qkv_layout.startswith("paged_kv_"):
            s(self, "paged", True)
        if self.kv_cache and "3" in group:
            raise _bad("qkv_layout", self.qkv_layout, "a KV cache needs separate q and k/v "
                       "tensors (e.g. bshd_bshd_bshd or a paged_kv_ layout)")  # fmt: skip
        if self.paged:
            s(self, "kv_cache", True)
            s(self, "page_size", _int("page_size", self.page_size, 1))
        else:
            _int("page_size", self.page_size)
            s(self, "page_size", 0)

        # Token counts (TE 2.20: q.shape[0] / k.shape[0] of a thd tensor, padding included). Only
        # a ragged (thd) q or kv shapes TE's graph, and only through its bucket (get_max_tokens),
        # so they are kept bucketed, defaulting to batch * max_seqlen; None for other formats.
        # An explicit 0 stays 0: TE's C++ refuses a ragged tensor without a token count.
        ragged_q, ragged_kv = ragged_pieces(self.qkv_layout)
        for name, ragged, seqlen in (("num_tokens_q", ragged_q, self.max_seqlen_q),
                                     ("num_tokens_kv", ragged_kv, self.max_seqlen_kv)):
            tokens = getattr(self, name)
            if tokens is not None:
                _int(name, tokens)
            if not ragged:
                s(self, name, None)
            elif tokens != 0:
                s(self, name, te_max_tokens(self.batch_size * seqlen if tokens is None
                                            else tokens))  # fmt: skip

        # Mask, window, diagonal alignment (TE's DotProductAttention.forward rules).
        mask = normalize_mask(self.attn_mask_type)
        if self.kv_cache:
            if "padding" not in mask:
                raise _bad("attn_mask_type", mask, "KV caching requires a padding mask type")
            if mask == "padding_causal":
                mask = "padding_causal_bottom_right"
        s(self, "attn_mask_type", mask)
        s(self, "window_size", normalize_window(mask, self.window_size))
        if mask in ("causal", "padding_causal"):
            s(self, "bottom_right_diagonal", False)
        elif mask in ("causal_bottom_right", "padding_causal_bottom_right"):
            s(self, "bottom_right_diagonal", True)
        elif self.bottom_right_diagonal is None:
            s(self, "bottom_right_diagonal", True)
        else:
            _bool("bottom_right_diagonal", self.bottom_right_diagonal)

        # Bias / ALiBi.
        s(self, "bias_type", _choice("bias_type", self.bias_type, BIAS_TYPES))
        if (
            mask not in ("causal", "padding_causal")
            and not self.has_window
            and (self.bias_type != "alibi")
        ):
            # The diagonal alignment only matters for sliding windows and ALiBi.
            s(self, "bottom_right_diagonal", True)
        if self.bias_type in ("pre_scale_bias", "post_scale_bias") or (
            self.bias_type == "alibi" and self.bias_shape is not None
        ):
            code = _choice("bias_shape", self.bias_shape or "1hss", BIAS_SHAPES)
            s(self, "bias_shape", canonical_bias_shape(
                code, self.batch_size, self.num_heads, self.max_seqlen_q))  # fmt: skip
        else:
            s(self, "bias_shape", None)
        if self.bias_type != "alibi":
            if self.alibi_slopes_shape is not None:
                raise _bad("alibi_slopes_shape", self.alibi_slopes_shape,
                           "only allowed with bias_type='alibi'")  # fmt: skip
        elif self.alibi_slopes_shape is not None:
            shp = self.alibi_slopes_shape
            ints = isinstance(shp, (tuple, list)) and all(
                isinstance(d, int) and not isinstance(d, bool) for d in shp
            )
            if not ints or len(shp) not in (1, 2):
                raise _bad("alibi_slopes_shape", shp, "expected [num_heads] or "
                           "[batch_size, num_heads]")  # fmt: skip
            shp = tuple(shp)
            if shp not in ((self.num_heads,), (self.batch_size, self.num_heads)):
                raise _bad("alibi_slopes_shape", shp, f"expected ({self.num_heads},) or "
                           f"({self.batch_size}, {self.num_heads})")  # fmt: skip
            s(self, "alibi_slopes_shape", shp)
        if self.bias_shape is None:
            s(self, "bias_requires_grad", False)

        s(self, "dropout", _float("dropout", self.dropout))
        s(self, "softmax_type", _choice("softmax_type", self.softmax_type, SOFTMAX_TYPES))
        s(self, "softcap", _float("softcap", self.softcap))

        # FP8: fp8_recipe != "none" <=> fp8; fp8_mha implies FP8 DPA; fp8 io dtypes need FP8.
        s(self, "fp8_recipe", _choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES))
        if self.fp8_recipe != "none" or self.fp8_mha:
            s(self, "fp8", True)
        if self.fp8 and self.fp8_recipe == "none":
            s(self, "fp8_recipe", "delayed")
        if self.dtype in FP8_DTYPES and not self.fp8:
            raise _bad("dtype", self.dtype, "FP8 inputs need fp8=True (FP8 dot-product attention)")
        if not self.fp8:
            s(self, "fp8_output", False)

        # Context parallelism: cp_size > 1 <=> context_parallel.
        _int("cp_size", self.cp_size)
        s(self, "cp_comm_type", _choice("cp_comm_type", self.cp_comm_type, CP_COMM_TYPES))
        if self.cp_size > 1:
            s(self, "context_parallel", True)
        if not self.context_parallel:
            s(self, "cp_comm_type", "p2p")
            s(self, "cp_size", 1)

        # pad_between_seqs only means something for thd.
        if self.pad_between_seqs and "thd" not in (self.q_format, self.kv_format):
            s(self, "pad_between_seqs", False)

        _int("num_splits", self.num_splits)
        if self.softmax_scale is not None:
            s(self, "softmax_scale", _float("softmax_scale", self.softmax_scale))

    # ------------------------------------------------------------------ derived
    @property
    def qkv_format(self) -> str:
        return layout_formats(self.qkv_layout, self.kv_cache)[0]

    @property
    def q_format(self) -> str:
        return layout_formats(self.qkv_layout, self.kv_cache)[1]

    @property
    def kv_format(self) -> str:
        return layout_formats(self.qkv_layout, self.kv_cache)[2]

    @property
    def is_mla(self) -> bool:
        """Different q/k and v head dims (multi-head latent attention style)."""
        return self.head_dim_qk != self.head_dim_v

    @property
    def has_window(self) -> bool:
        """A sliding window is active (TE: ``left != -1 or right not in (-1, 0)``)."""
        left, right = self.window_size  # type: ignore[misc]
        return left != -1 or right not in (-1, 0)

    @property
    def has_bias_tensor(self) -> bool:
        return self.bias_shape is not None

    @property
    def scale(self) -> float:
        """The softmax scale actually used: ``softmax_scale`` or ``1/sqrt(head_dim_qk)``."""
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim_qk**-0.5

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (tuples become lists)."""
        values = self.__dict__
        return {name: list(v) if isinstance(v := values[name], tuple) else v
                for name in _field_names()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusedAttnConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        if not isinstance(data, Mapping):
            raise _bad("config", data, "expected a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k if isinstance(k, str) and len(k) <= 60 else _show(k, 60)
                         for k in set(data) - names)  # fmt: skip
        if unknown:
            raise ValueError(
                f"unknown config field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}"
            )
        kw = dict(data)
        for name in ("window_size", "alibi_slopes_shape"):
            if isinstance(kw.get(name), list):
                kw[name] = tuple(kw[name])
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FusedAttnConfig:
        """From strict JSON holding one object (:func:`parse_json_object`)."""
        return cls.from_dict(parse_json_object(text, "config JSON"))

    def key(self) -> str:
        """sha256 of the canonical JSON (schema version included): stable across processes."""
        cached = self.__dict__.get("_key")
        if cached is None:
            payload = _fast_canonical(self)
            if payload is None:
                payload = self._canonical_json().encode()
            cached = hashlib.sha256(payload).hexdigest()
            object.__setattr__(self, "_key", cached)
        return cached

    def _canonical_json(self) -> str:
        """The text :meth:`key` hashes (the reference encoding: :func:`json.dumps`)."""
        return json.dumps(
            {"schema": CONFIG_SCHEMA, "config": self.to_dict()},
            sort_keys=True, separators=(",", ":"), allow_nan=False,
        )  # fmt: skip

    def replace(self, **changes: Any) -> FusedAttnConfig:
        """A copy with ``changes`` applied (normalized again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_attention_params(cls, params: Any) -> FusedAttnConfig:
        """Build from TE's ``AttentionParams`` (any TE 2.x field set; duck-typed, no TE import).

        Missing fields take TE's defaults. ``core_attention_bias_shape`` may be TE's string code
        (<= 2.19) or a ``(b, h, sq, skv)`` tuple (2.20+).
        """
        g = getattr
        fp8_meta = g(params, "fp8_meta", None) or {}
        recipe = fp8_meta.get("recipe") if isinstance(fp8_meta, Mapping) else None
        local = fp8_meta.get("local_recipes") if isinstance(fp8_meta, Mapping) else None
        if local:
            recipe = local[0]
        fp8 = (
            bool(g(params, "fp8", False))
            and recipe is not None
            and bool(
                getattr(fp8_meta.get("recipe"), "fp8_dpa", False)
                or getattr(recipe, "fp8_mha", False)
            )
        )
        fp8_recipe = "none"
        if fp8:
            rname = type(recipe).__name__
            if rname not in _RECIPE_CLASSES:
                raise _bad("fp8_meta['recipe']", rname,
                           "known recipes: " + ", ".join(_RECIPE_CLASSES))  # fmt: skip
            fp8_recipe = _RECIPE_CLASSES[rname]
        dtype = _dtype_name(g(params, "qkv_dtype", "torch.bfloat16"))
        nominal = g(params, "nominal_dtype", None)
        if dtype in FP8_DTYPES and not fp8:
            # FP8 tensors outside an FP8 DPA region: TE treats them by their nominal dtype.
            dtype = _dtype_name(nominal) if nominal is not None else dtype
        inference = g(params, "inference_params", None)
        num_heads = int(g(params, "num_heads", 16))
        batch = int(g(params, "batch_size", 1))
        bias_type = g(params, "core_attention_bias_type", "no_bias")
        bias_shape = _bias_shape_code(
            g(params, "core_attention_bias_shape", None), batch, num_heads,
            int(g(params, "max_seqlen_q", 128)),
        )  # fmt: skip
        if bias_type == "no_bias":
            bias_shape = None
        elif bias_type in ("pre_scale_bias", "post_scale_bias") and bias_shape is None:
            bias_shape = "1hss"
        alibi = g(params, "alibi_slopes_shape", None)
        window = g(params, "window_size", None)
        scale = g(params, "softmax_scale", None)
        return cls(
            batch_size=batch,
            max_seqlen_q=int(g(params, "max_seqlen_q", 128)),
            max_seqlen_kv=int(g(params, "max_seqlen_kv", 128)),
            num_heads=num_heads,
            num_gqa_groups=int(g(params, "num_gqa_groups", 16)),
            head_dim_qk=int(g(params, "head_dim_qk", 64)),
            head_dim_v=int(g(params, "head_dim_v", 64)),
            dtype=dtype,
            qkv_layout=g(params, "qkv_layout", "sbh3d"),
            attn_mask_type=g(params, "attn_mask_type", "no_mask"),
            window_size=tuple(int(w) for w in window) if window is not None else None,
            bottom_right_diagonal=g(params, "bottom_right_diagonal", True),
            bias_type=bias_type,
            bias_shape=bias_shape,
            bias_requires_grad=bool(g(params, "core_attention_bias_requires_grad", False))
            and bias_shape is not None,
            alibi_slopes_shape=tuple(int(d) for d in alibi) if alibi is not None else None,
            dropout=float(g(params, "attention_dropout", 0.0)),
            softmax_type=g(params, "softmax_type", "vanilla"),
            softcap=float(g(params, "softcap", 0.0) or 0.0),
            is_training=bool(g(params, "is_training", True)),
            deterministic=bool(g(params, "deterministic", False)),
            fp8=fp8,
            fp8_recipe=fp8_recipe,
            fp8_mha=fp8 and bool(getattr(recipe, "fp8_mha", False)),
            fp8_output=fp8 and bool(g(params, "fp8_output", False)),
            context_parallel=bool(g(params, "context_parallel", False)),
            cp_comm_type=g(params, "cp_comm_type", "p2p"),
            cp_size=int(g(params, "cp_size", 1)),
            pad_between_seqs=bool(g(params, "pad_between_seqs", False)),
            kv_cache=inference is not None,
            paged=bool(getattr(inference, "is_paged", False)),
            page_size=int(getattr(inference, "page_size", 0) or 0)
            if getattr(inference, "is_paged", False)
            else 0,
            num_splits=int(g(params, "num_splits", 1)),
            return_max_logit=bool(g(params, "return_max_logit", False)),
            cuda_graph=bool(g(params, "cuda_graph", False)),
            has_score_mod=bool(g(params, "has_score_mod", False)),
            has_score_mod_bprop=bool(g(params, "has_score_mod_bprop", False)),
            checkpoint_core_attention=bool(g(params, "checkpoint_core_attention", False)),
            # TE's AttentionParams default is 1.0 ("not given"); we keep None for "default".
            softmax_scale=float(scale) if scale not in (None, 1.0) else None,
            # TE 2.20 passes q/k.shape[0] for a thd tensor (0 otherwise: normalized away); older
            # TE has no such field ("not given": the default count).
            num_tokens_q=_tokens(g(params, "num_tokens_q", None)),
            num_tokens_kv=_tokens(g(params, "num_tokens_kv", None)),
        )

    @classmethod
    def from_tensors(cls, q: Any, k: Any, v: Any, qkv_format: str = "bshd", **kw: Any
                     ) -> FusedAttnConfig:  # fmt: skip
        """Build from q/k/v tensors in ``bshd``, ``sbhd`` or ``thd`` (needs ``cu_seqlens_q``).

        For ``thd``, pass ``cu_seqlens_q`` / ``cu_seqlens_kv`` (1-D int tensors); the batch is
        ``len(cu_seqlens_q) - 1`` and the max sequence lengths are read from them unless given;
        the token counts are ``q.shape[0]`` / ``k.shape[0]`` (as TE passes them).
        """
        fmt = _choice("qkv_format", qkv_format, ("bshd", "sbhd", "thd"))
        cu_q = kw.pop("cu_seqlens_q", None)
        cu_kv = kw.pop("cu_seqlens_kv", None)
        dtype = _dtype_name(q.dtype)
        if fmt == "thd":
            if cu_q is None:
                raise _bad("cu_seqlens_q", None, "qkv_format='thd' needs cu_seqlens_q")
            cu_kv = cu_q if cu_kv is None else cu_kv
            lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
            lens_kv = (cu_kv[1:] - cu_kv[:-1]).tolist()
            batch, sq, skv = len(lens_q), max(lens_q), max(lens_kv)
            kw.setdefault("attn_mask_type", "padding")
            kw.setdefault("num_tokens_q", int(q.shape[0]))
            kw.setdefault("num_tokens_kv", int(k.shape[0]))
        elif fmt == "bshd":
            batch, sq, skv = q.shape[0], q.shape[1], k.shape[1]
        else:
            sq, batch, skv = q.shape[0], q.shape[1], k.shape[0]
        kw.setdefault("max_seqlen_q", int(sq))
        kw.setdefault("max_seqlen_kv", int(skv))
        return cls(
            batch_size=int(batch),
            num_heads=int(q.shape[-2]),
            num_gqa_groups=int(k.shape[-2]),
            head_dim_qk=int(q.shape[-1]),
            head_dim_v=int(v.shape[-1]),
            dtype=dtype,
            qkv_layout=f"{fmt}_{fmt}_{fmt}",
            **kw,
        )


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    if text in DTYPES:
        return text
    if text.lower() in DTYPES:
        return text.lower()
    if text in _TORCH_DTYPES:
        return _TORCH_DTYPES[text]
    raise _bad("dtype", text, "allowed: " + ", ".join(DTYPES) + " (or the torch dtypes)")


def classify_bias_shape(b: Any, h: Any, s_q: Any, batch: Any, heads: Any, sq: Any) -> str | None:
    """TE's label for a ``(b, h, s_q, skv)`` bias tensor, tried in TE's order (bhss, 1hss, b1ss,
    then 111s/11ss); ``None`` when it is none of them. Uses comparisons only (traceable)."""
    if b == batch and h == heads:
        return "bhss"
    if b == 1 and h == heads:
        return "1hss"
    if b == batch and h == 1:
        return "b1ss"
    if b == 1 and h == 1:
        return "111s" if s_q == 1 and sq != 1 else "11ss"
    return None


def _bias_shape_code(shape: Any, batch: int, heads: int, sq: int) -> str | None:
    """TE's bias shape, as a string code or a (b, h, sq, skv) tuple, -> one of BIAS_SHAPES."""
    if shape is None or isinstance(shape, str):
        return shape
    b, h, s_q, _ = (int(x) for x in shape)
    code = classify_bias_shape(b, h, s_q, batch, heads, sq)
    if code is None:
        allowed = "expected one of (b|1, h|1, sq|1, skv) shapes: " + ", ".join(BIAS_SHAPES)
        raise _bad("core_attention_bias_shape", tuple(shape), allowed)
    return code


def canonical_bias_shape(code: str, batch: int, heads: int, sq: int) -> str:
    """One code per physical bias shape, labelled the way TE labels a ``(b, h, sq, skv)``
    tensor (it tries bhss, 1hss, b1ss, then 111s/11ss): e.g. with batch 1 a ``bhss`` bias is
    TE's ``bhss``, a ``1hss`` one too."""
    b = batch if code[0] == "b" else 1
    h = heads if code[1] == "h" else 1
    s_q = 1 if code == "111s" else sq
    return _bias_shape_code((b, h, s_q, 0), batch, heads, sq) or code


__all__ = ["FusedAttnConfig", "CONFIG_SCHEMA", "normalize_window", "normalize_mask",
           "layout_formats", "layout_group", "is_causal", "field", "ragged_pieces",
           "te_max_batch_size", "te_max_tokens"]  # fmt: skip


@functools.lru_cache(maxsize=1)
def _field_names() -> tuple[str, ...]:
    """:class:`FusedAttnConfig`'s field names in declaration order (``to_dict``'s key order)."""
    return tuple(f.name for f in fields(FusedAttnConfig))


@functools.lru_cache(maxsize=1)
def _sorted_fields() -> tuple[tuple[str, ...], Callable[[Mapping[str, Any]], tuple]]:
    """The field names sorted (the canonical JSON's key order) and a getter of their values."""
    names = tuple(sorted(_field_names()))
    return names, operator.itemgetter(*names)


#: The value types :func:`_fast_canonical` encodes (exactly these: subclasses fall back).
_PLAIN = frozenset({int, bool, str, float, tuple, type(None)})


def _fast_canonical(config: FusedAttnConfig) -> bytes | None:
    """``FusedAttnConfig._canonical_json().encode()`` through orjson, or ``None`` when the two
    encoders could differ (the caller then uses :mod:`json`). Byte for byte the same because:

    * keys: both dicts are built in sorted order (orjson keeps insertion order), compact
      separators in both;
    * exact types only (``None``, ``bool``, ``int``, ``str``, ``float``, tuples of ``int``, which
      both write as arrays); orjson refuses ints past 64 bits (fallback);
    * ``float``: finite and without an exponent in its ``repr`` (``json``'s ``1e-05``/``1e+16``
      are orjson's ``1e-5``/``1e16``; orjson writes NaN as ``null`` where ``json`` refuses it);
      both then write the shortest round-trip digits;
    * ``str``: the output is ASCII without a backslash or DEL, so no string held a character
      either encoder escapes (orjson escapes ``"``, ``\\`` and control characters with a
      backslash; ``json`` also escapes DEL and everything non-ASCII): both wrote it verbatim."""
    if _orjson is None:
        return None
    names, getter = _sorted_fields()
    values = getter(config.__dict__)
    kinds = set(map(type, values))
    if not kinds <= _PLAIN:
        return None
    if float in kinds or tuple in kinds:
        for v in values:
            t = type(v)
            if t is float:
                if not math.isfinite(v) or "e" in repr(v):
                    return None
            elif t is tuple:
                for x in v:
                    if type(x) is not int:
                        return None
    try:
        out = _orjson.dumps({"config": dict(zip(names, values, strict=True)),
                             "schema": CONFIG_SCHEMA})  # fmt: skip
    except (TypeError, _orjson.JSONEncodeError):  # an int past 64 bits
        return None
    if not out.isascii() or b"\\" in out or b"\x7f" in out:
        return None
    return out

"""The config's field vocabulary: the values each :class:`~te_fl_attention.config.FusedAttnConfig`
field accepts (choices, numeric :data:`RANGES`), the checks and error messages built from them,
their ``--help`` text, and strict JSON input (:func:`parse_json_object`).

:mod:`te_fl_attention.config` re-exports the public names; importing this module never imports
torch.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["BIAS_SHAPES", "BIAS_TYPES", "CHOICES", "CP_COMM_TYPES", "DTYPES", "FP8_DTYPES",
           "FP8_RECIPES", "INT32_MAX", "MASK_TYPES", "MAX_CONFIG_BYTES", "MAX_JSON_DEPTH",
           "QKV_LAYOUTS", "RANGES", "SOFTMAX_TYPES", "allowed_text", "bad_value", "check_bool",
           "check_choice", "check_float", "check_int", "field_help", "parse_json_object",
           "ranges_table", "show_value"]  # fmt: skip

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


def show_value(value: Any, limit: int = 120) -> str:
    """``repr(value)``, shortened: an error message never carries a huge or deep input."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} chars)"


def bad_value(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={show_value(value)} is not valid: {allowed}")


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; names are case-insensitive (lowercased)."""
    if isinstance(value, str):
        if value in allowed:
            return value
        low = value.lower()
        if low in allowed:
            return low
    raise bad_value(name, value, "allowed: " + ", ".join(allowed))


def allowed_text(name: str) -> str:
    """What a numeric field accepts, as the errors and ``--help`` say it."""
    lo, hi, why = RANGES[name]
    if isinstance(lo, float):
        left = "(" if _OPEN.get(name) == "lo" else "["
        right = ")" if _OPEN.get(name) == "hi" else "]"
        return f"a number in {left}{lo:g}, {hi:g}{right} ({why})"
    return f"an integer in [{lo}, {hi}] ({why})"


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer within ``RANGES[name]`` (``minimum`` raises the lower end)."""
    lo, hi, _ = RANGES[name]
    lo = lo if minimum is None else max(lo, minimum)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        allowed = allowed_text(name)
        if minimum is not None and minimum > RANGES[name][0]:
            allowed += f", here >= {minimum}"
        raise bad_value(name, value, f"expected {allowed}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(name, value, "expected true or false")
    return value


def check_float(name: str, value: Any) -> float:
    """A finite number within ``RANGES[name]`` (``dropout``: below 1)."""
    lo, hi, _ = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_value(name, value, f"expected {allowed_text(name)}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise bad_value(name, value, f"expected {allowed_text(name)}") from None
    open_end = _OPEN.get(name)
    if (not math.isfinite(value) or value < lo or value > hi
            or (open_end == "hi" and value == hi) or (open_end == "lo" and value == lo)):
        raise bad_value(name, value, f"expected {allowed_text(name)}")
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
                raise ValueError(f"key {show_value(key)} appears twice")
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
                         f"{kind}: {show_value(data, 60)}")  # fmt: skip
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return data

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

from . import config_te
from .config_fields import (
    BIAS_SHAPES,
    BIAS_TYPES,
    CHOICES,
    CP_COMM_TYPES,
    DTYPES,
    FP8_DTYPES,
    FP8_RECIPES,
    INT32_MAX,
    MASK_TYPES,
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    QKV_LAYOUTS,
    RANGES,
    SOFTMAX_TYPES,
    allowed_text,
    bad_value,
    check_bool,
    check_choice,
    check_float,
    check_int,
    field_help,
    parse_json_object,
    ranges_table,
    show_value,
)
from .config_te import (
    canonical_bias_shape,
    classify_bias_shape,
    ragged_pieces,
    te_max_batch_size,
    te_max_tokens,
)
from .frozen import hash_once

try:  # the canonical key's fast encoder (byte-identical to json's where it is used)
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a dependency
    _orjson = None

#: Bumped whenever the meaning of a field or the normalization changes (it is part of the key).
#: 2: ``num_tokens_q`` / ``num_tokens_kv`` (TE 2.20's token counts, bucketed) were added.
CONFIG_SCHEMA = 2
_MASK_ALIASES = {"causal,padding": "padding_causal", "padding,causal": "padding_causal",
                 "causal_padding": "padding_causal"}  # fmt: skip


def is_causal(mask: str) -> bool:
    """True for every causal mask type (top-left and bottom-right)."""
    return "causal" in mask


def normalize_mask(mask: Any) -> str:
    """TE's mask spelling rules: ``"causal,padding"`` and friends become ``padding_causal``."""
    if isinstance(mask, str):
        mask = _MASK_ALIASES.get(mask.lower(), mask)
    return check_choice("attn_mask_type", mask, MASK_TYPES)


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
        raise bad_value("window_size", window, "expected None or a pair of integers (left, right)")
    left, right = int(window[0]), int(window[1])
    if not (-1 <= left <= INT32_MAX and -1 <= right <= INT32_MAX):
        raise bad_value("window_size", window, f"expected {allowed_text('window_size')}")
    if is_causal(mask):
        if (left, right) in ((-1, -1), (-1, 0)):
            return (-1, 0)
        if left >= 0 and right >= -1:
            return (left, 0)
        raise bad_value("window_size", window, f"attn_mask_type={mask} needs (-1, 0) or (>=0, 0)")
    if (left, right) in ((-1, 0), (-1, -1)):
        return (-1, -1)
    if left < 0 or right < 0:
        raise bad_value("window_size", window,
                        f"attn_mask_type={mask} needs (-1, -1) or (>=0, >=0)")  # fmt: skip
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


@hash_once
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
            check_int(name, getattr(self, name))
        s(self, "max_seqlen_kv", check_int("max_seqlen_kv", self.max_seqlen_kv)
          if self.max_seqlen_kv is not None else self.max_seqlen_q)  # fmt: skip
        s(self, "num_gqa_groups", check_int("num_gqa_groups", self.num_gqa_groups)
          if self.num_gqa_groups is not None else self.num_heads)  # fmt: skip
        s(self, "head_dim_v", check_int("head_dim_v", self.head_dim_v)
          if self.head_dim_v is not None else self.head_dim_qk)  # fmt: skip
        if self.num_heads % self.num_gqa_groups:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by "
                f"num_gqa_groups={self.num_gqa_groups}"
            )
        s(self, "dtype", check_choice("dtype", self.dtype, DTYPES))
        s(self, "qkv_layout", check_choice("qkv_layout", self.qkv_layout, QKV_LAYOUTS))
        for name in ("bias_requires_grad", "is_training", "deterministic", "fp8", "fp8_mha",
                     "fp8_output", "context_parallel", "pad_between_seqs", "kv_cache", "paged",
                     "return_max_logit", "cuda_graph", "has_score_mod", "has_score_mod_bprop",
                     "checkpoint_core_attention"):  # fmt: skip
            check_bool(name, getattr(self, name))

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
            raise bad_value("qkv_layout", self.qkv_layout, "a KV cache needs separate q and k/v "
                           "tensors (e.g. bshd_bshd_bshd or a paged_kv_ layout)")  # fmt: skip
        if self.paged:
            s(self, "kv_cache", True)
            s(self, "page_size", check_int("page_size", self.page_size, 1))
        else:
            check_int("page_size", self.page_size)
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
                check_int(name, tokens)
            if not ragged:
                s(self, name, None)
            elif tokens != 0:
                s(self, name, te_max_tokens(self.batch_size * seqlen if tokens is None
                                            else tokens))  # fmt: skip

        # Mask, window, diagonal alignment (TE's DotProductAttention.forward rules).
        mask = normalize_mask(self.attn_mask_type)
        if self.kv_cache:
            if "padding" not in mask:
                raise bad_value("attn_mask_type", mask, "KV caching requires a padding mask type")
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
            check_bool("bottom_right_diagonal", self.bottom_right_diagonal)

        # Bias / ALiBi.
        s(self, "bias_type", check_choice("bias_type", self.bias_type, BIAS_TYPES))
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
            code = check_choice("bias_shape", self.bias_shape or "1hss", BIAS_SHAPES)
            s(self, "bias_shape", canonical_bias_shape(
                code, self.batch_size, self.num_heads, self.max_seqlen_q))  # fmt: skip
        else:
            s(self, "bias_shape", None)
        if self.bias_type != "alibi":
            if self.alibi_slopes_shape is not None:
                raise bad_value("alibi_slopes_shape", self.alibi_slopes_shape,
                               "only allowed with bias_type='alibi'")  # fmt: skip
        elif self.alibi_slopes_shape is not None:
            shp = self.alibi_slopes_shape
            ints = isinstance(shp, (tuple, list)) and all(
                isinstance(d, int) and not isinstance(d, bool) for d in shp
            )
            if not ints or len(shp) not in (1, 2):
                raise bad_value("alibi_slopes_shape", shp, "expected [num_heads] or "
                               "[batch_size, num_heads]")  # fmt: skip
            shp = tuple(shp)
            if shp not in ((self.num_heads,), (self.batch_size, self.num_heads)):
                raise bad_value("alibi_slopes_shape", shp, f"expected ({self.num_heads},) or "
                               f"({self.batch_size}, {self.num_heads})")  # fmt: skip
            s(self, "alibi_slopes_shape", shp)
        if self.bias_shape is None:
            s(self, "bias_requires_grad", False)

        s(self, "dropout", check_float("dropout", self.dropout))
        s(self, "softmax_type", check_choice("softmax_type", self.softmax_type, SOFTMAX_TYPES))
        s(self, "softcap", check_float("softcap", self.softcap))

        # FP8: fp8_recipe != "none" <=> fp8; fp8_mha implies FP8 DPA; fp8 io dtypes need FP8.
        s(self, "fp8_recipe", check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES))
        if self.fp8_recipe != "none" or self.fp8_mha:
            s(self, "fp8", True)
        if self.fp8 and self.fp8_recipe == "none":
            s(self, "fp8_recipe", "delayed")
        if self.dtype in FP8_DTYPES and not self.fp8:
            raise bad_value("dtype", self.dtype,
                            "FP8 inputs need fp8=True (FP8 dot-product attention)")  # fmt: skip
        if not self.fp8:
            s(self, "fp8_output", False)

        # Context parallelism: cp_size > 1 <=> context_parallel.
        check_int("cp_size", self.cp_size)
        s(self, "cp_comm_type", check_choice("cp_comm_type", self.cp_comm_type, CP_COMM_TYPES))
        if self.cp_size > 1:
            s(self, "context_parallel", True)
        if not self.context_parallel:
            s(self, "cp_comm_type", "p2p")
            s(self, "cp_size", 1)

        # pad_between_seqs only means something for thd.
        if self.pad_between_seqs and "thd" not in (self.q_format, self.kv_format):
            s(self, "pad_between_seqs", False)

        check_int("num_splits", self.num_splits)
        if self.softmax_scale is not None:
            s(self, "softmax_scale", check_float("softmax_scale", self.softmax_scale))

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
            raise bad_value("config", data, "expected a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k if isinstance(k, str) and len(k) <= 60 else show_value(k, 60)
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
        (<= 2.19) or a ``(b, h, sq, skv)`` tuple (2.20+). See
        :func:`te_fl_attention.config_te.from_attention_params`.
        """
        return config_te.from_attention_params(cls, params)

    @classmethod
    def from_tensors(cls, q: Any, k: Any, v: Any, qkv_format: str = "bshd", **kw: Any
                     ) -> FusedAttnConfig:  # fmt: skip
        """Build from q/k/v tensors in ``bshd``, ``sbhd`` or ``thd`` (needs ``cu_seqlens_q``).

        For ``thd``, pass ``cu_seqlens_q`` / ``cu_seqlens_kv`` (1-D int tensors); the batch is
        ``len(cu_seqlens_q) - 1`` and the max sequence lengths are read from them unless given;
        the token counts are ``q.shape[0]`` / ``k.shape[0]`` (as TE passes them). See
        :func:`te_fl_attention.config_te.from_tensors`.
        """
        return config_te.from_tensors(cls, q, k, v, qkv_format, **kw)


__all__ = ["FusedAttnConfig", "CONFIG_SCHEMA", "normalize_window", "normalize_mask",
           "layout_formats", "layout_group", "is_causal", "field", "ragged_pieces",
           "te_max_batch_size", "te_max_tokens",
           # re-exported from config_fields / config_te (their public home is here too)
           "BIAS_SHAPES", "BIAS_TYPES", "CHOICES", "CP_COMM_TYPES", "DTYPES", "FP8_DTYPES",
           "FP8_RECIPES", "INT32_MAX", "MASK_TYPES", "MAX_CONFIG_BYTES", "MAX_JSON_DEPTH",
           "QKV_LAYOUTS", "RANGES", "SOFTMAX_TYPES", "allowed_text", "canonical_bias_shape",
           "classify_bias_shape", "field_help", "parse_json_object", "ranges_table"]  # fmt: skip


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

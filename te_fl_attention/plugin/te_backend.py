"""TE's ``get_attention_backend`` answered by our :class:`~te_fl_attention.selector.Selector`.

:class:`TEBackend` turns a TE ``AttentionParams`` (any 2.x field set) into TE's 6-tuple
``(use_flash, flash_attention_backend, use_fused, fused_attention_backend, use_unfused,
available_backends)``. Three paths:

* **eager, repeated params**: a memo keyed on the params' field values (read with one
  ``operator.itemgetter`` over the instance ``__dict__``; the thd token counts
  ``num_tokens_q/kv`` by TE's bucket, :func:`token_bucket`, since only the bucket shapes TE's
  graph) and a snapshot of the policy's environment variables; no ``FusedAttnConfig`` is built
  on a hit.
* **eager, new params**: ``FusedAttnConfig.from_attention_params`` -> ``Selector.decide`` on the
  plugin's device -> translation (below); the result is memoized.
* **torch.compile**: the environment is read with ``os.environ.get`` (dynamo guards keys present
  at trace time) and the selection runs behind ``torch.compiler.assume_constant_result`` with
  constant inputs only. Batch size and sequence lengths enter only as the shape predicates a rule
  can react to (:func:`shape_predicates`: ``s_q == 1``, ``s_q <= s_kv``, divisibility, ranges;
  for thd also ``s == `` its token bucket and a bucketed batch, where a bias meets the ragged
  graph),
  each a guard on the predicate, never on a size; the decision is made for the smallest
  representative sizes with the same predicates (:func:`representative`). So a new batch size or
  sequence length recompiles only when a predicate flips. The thd token counts enter as their
  bucket (a guard on the bucket's bounds, :func:`traced_token_bucket`). Head counts and head dims
  are specialized (a change can change any verdict).

Translation: ``flash_attention_backend`` is a :class:`BackendVersion` (a ``packaging`` Version)
naming the flash-tier backend that runs: the installed flash-attn flavour's version, or
:data:`TRITON_VERSION` (our package version with the local label ``tefl.triton``) when our Triton
kernel runs; it carries the decision so the FlashAttention router can check it.
``fused_attention_backend`` is the cuDNN sub-backend in the type the installed TE expects: a
plain ``int`` (TE >= 2.20), a ``FusedAttnBackend`` IntEnum member (2.19) or the pybind enum
member (<= 2.18). ``available_backends`` is ``[flash or triton, fused, unfused]`` after the
support filters and the environment switches, before the preference order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import logging
import operator
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from packaging.version import Version
from torch.fx.experimental.symbolic_shapes import guard_scalar

from .. import __version__, backends
from ..config import FusedAttnConfig, classify_bias_shape, te_max_tokens
from ..device import DeviceProfile, profile
from ..policy import Policy, env_vars, snapshot
from ..reasons import Decision, NoBackendError
from ..selector import Selector
from ..switches import check_switches
from .ops import configure_logging

logger = logging.getLogger("te_fl_attention.plugin")
#: Where each new decision is logged (INFO): ``TEFL_LOG_LEVEL=INFO`` shows it.
decision_logger = logging.getLogger("te_fl_attention")

DPA_UTILS = "transformer_engine.pytorch.attention.dot_product_attention.utils"


def decision_line(decision: Decision) -> str:
    """One log line: the config, the device, the chosen backend and the first reason of each
    refused candidate (flash flavours included)."""
    c = decision.config
    shape = (f"b={c.batch_size} s_q={c.max_seqlen_q} s_kv={c.max_seqlen_kv} "
             f"h={c.num_heads}/{c.num_gqa_groups} d={c.head_dim_qk}/{c.head_dim_v} {c.dtype} "
             f"{c.qkv_layout} {c.attn_mask_type}")  # fmt: skip
    if decision.chosen is None:
        chosen = "none"
    else:
        chosen = decision.chosen_result.display_name  # type: ignore[union-attr]
        if decision.flash_variant:
            chosen += f" ({decision.flash_variant})"
    refused, seen = [], set()
    for r in decision.results:
        for x in (*r.variants, r):  # flavours first: the parent's reason is often theirs
            if not x.supported and x.reasons and x.reasons[0].message not in seen:
                seen.add(x.reasons[0].message)
                refused.append(f"{x.display_name}: {x.reasons[0].message}")
    text = (f"attention decision on {decision.device.name}: {chosen} for {shape} "
            f"(config {c.key()[:12]}, source {decision.source})")
    if refused:
        text += "; refused: " + "; ".join(refused)
    return text

def our_version(name: str) -> str:
    """The version string TE sees when our kernel ``name`` runs in TE's flash path: our package
    version with the candidate's local label (``0.1.0+tefl.triton``)."""
    desc = backends.find(name)
    label = desc.version_label if desc is not None and desc.version_label else f"tefl.{name}"
    return f"{__version__}+{label}"


#: The version string TE sees when our Triton kernel runs in TE's flash path.
TRITON_VERSION = our_version("triton")


def flash_tier() -> tuple[str, ...]:
    """What the FlashAttention router can run: every flavour of a candidate in TE's flash slot
    (flash-attn 2/3/4), and each flavour-less one (our Triton kernel, any registered since)."""
    out: list[str] = []
    for name in backends.in_slot("flash"):
        out += reversed(backends.precedence(name)) or [name]
    return tuple(out)
#: Fields the traced path passes through as constants (sizes and tensors are handled apart).
TRACED_FIELDS = (
    "qkv_type", "qkv_dtype", "nominal_dtype", "qkv_layout", "num_heads", "num_gqa_groups",
    "head_dim_qk", "head_dim_v", "attn_mask_type", "window_size", "bottom_right_diagonal",
    "core_attention_bias_type", "core_attention_bias_requires_grad", "attention_dropout",
    "softmax_type", "softcap", "is_training", "deterministic", "fp8", "fp8_output",
    "context_parallel", "cp_comm_type", "cp_size", "pad_between_seqs", "num_splits",
    "return_max_logit", "cuda_graph", "has_score_mod", "has_score_mod_bprop",
    "checkpoint_core_attention", "softmax_scale",
)  # fmt: skip


#: Integer fields that may arrive symbolic under dynamic=True and are specialized (any change of
#: them can change a verdict, so a recompile is right).
_SPECIALIZED = frozenset({"num_heads", "num_gqa_groups", "head_dim_qk", "head_dim_v", "cp_size",
                          "num_splits"})


class BackendVersion(Version):
    """A flash-tier backend as TE's ``flash_attention_backend``: compares, hashes and prints as
    the plain version (``2.8.3``, ``0.1.0+tefl.triton``); ``backend`` names it (``fa2``,
    ``fa3``, ``fa4``, ``triton``), ``allowed`` lists every flash-tier backend the decision
    accepts, ``heads`` the (num_heads, num_gqa_groups) it was made for, ``bottom_right`` its
    diagonal alignment, ``decision`` the :class:`~te_fl_attention.reasons.Decision` itself."""

    def __init__(self, version: str, backend: str, decision: Decision,
                 allowed: tuple[str, ...]) -> None:  # fmt: skip
        super().__init__(version)
        cfg = decision.config
        self.backend = backend
        self.allowed = allowed
        self.decision = decision
        self.heads = (cfg.num_heads, cfg.num_gqa_groups)
        self.bottom_right = bool(cfg.bottom_right_diagonal)


# ------------------------------------------------------------------------------- shapes
def _truth(cond: Any) -> bool:
    """``cond`` as a Python bool. Under torch.compile this guards on ``cond`` (``bool()`` of a
    symbolic comparison stays symbolic there)."""
    return True if cond else False  # noqa: SIM210


def shape_predicates(b: Any, h: int, sq: Any, skv: Any, tq: int = 0, tkv: int = 0
                     ) -> tuple[bool, ...]:  # fmt: skip
    """Every property of (batch, s_q, s_kv) that a rule can react to, given the thd token
    buckets ``tq``/``tkv`` (0: none): on TE's ragged graph a bias broadcasts only where its
    s_q/s_kv is 1 or the bucket and its batch 1 or a batch bucket (thd only: other layouts build
    no ragged graph, and their batch is never compared for equality). Under torch.compile each one
    becomes a guard on that predicate, never on a size."""
    t = _truth
    return (
        t(b == 1), t(sq == 1), t(skv == 1), t(sq == skv), t(sq < skv), t(sq % 64 == 0),
        t(skv % 64 == 0), t(skv % 128 == 0), t(skv % 256 == 0), t(skv > 1024),
        t(b * h * sq * skv >= 1 << 30), bool(tq or tkv) and _is_batch_bucket(b),
        bool(tq) and t(sq == tq), bool(tkv) and t(skv == tkv),
    )  # fmt: skip


def _is_batch_bucket(b: Any) -> bool:
    """Whether ``b`` is one of TE's batch buckets (``te_max_batch_size``: 32 ... 512, then
    multiples of 512), from comparisons only (traceable)."""
    t = _truth
    if t(b > 512):
        return t(b % 512 == 0)
    return any(t(b == x) for x in (32, 64, 128, 256, 512))


@functools.lru_cache(maxsize=4096)
def token_bucket(tokens: int) -> int:
    """A thd token count as TE's C++ sees it: its bucket (``te_max_tokens``); 0 (what TE passes
    for a non-thd tensor) stays 0. Cached: it runs on the memo's hot path."""
    return te_max_tokens(tokens) if tokens else 0


def traced_token_bucket(tokens: Any) -> int:
    """:func:`token_bucket` of a possibly symbolic count: under torch.compile it guards on the
    bucket's bounds only (``t <= 1024``, ``t <= 2^k``), never on the count (above 32768 on its
    multiple of 32768)."""
    if isinstance(tokens, int):
        return token_bucket(tokens)
    if not _truth(tokens > 0):
        return 0
    for bound in (1024, 2048, 4096, 8192, 16384, 32768):
        if _truth(tokens <= bound):
            return bound
    return te_max_tokens(guard_scalar(tokens))


_SEQS = (1, 2, 3, *sorted({x for k in range(6, 24) for x in (1 << k, (1 << k) + 64,
                                                             (1 << k) + 128, (1 << k) + 1)}))
_BATCHES = (1, 2, 3, *(1 << k for k in range(2, 31)))


@functools.lru_cache(maxsize=1024)
def representative(h: int, preds: tuple[bool, ...], tq: int = 0, tkv: int = 0
                   ) -> tuple[int, int, int]:  # fmt: skip
    """The smallest (batch, s_q, s_kv) in a fixed grid (plus sizes at and around the token
    buckets) with these predicates (:func:`shape_predicates` with the same ``tq``/``tkv``)."""
    near = {y for x in (tq, tkv) if x for y in (x, x // 2, x // 2 + 256, x - 256, x + 256,
                                                 x - 64, x + 64, x - 1, x + 1, 2 * x) if y > 0}
    seqs = sorted({*_SEQS, *near})
    for sq, skv, b in itertools.product(seqs, seqs, _BATCHES):
        if shape_predicates(b, h, sq, skv, tq, tkv) == preds:
            return b, sq, skv
    raise RuntimeError(f"no representative size for num_heads={h}, predicates={preds}")


def _bias_code(shape: Any, batch: Any, heads: Any, sq: Any) -> str | None:
    """TE's bias shape (a code, or a (b, h, sq, skv) tuple in TE >= 2.20) as its code, from
    relations only (traceable: no raw sizes leave this function)."""
    if shape is None or isinstance(shape, str):
        return shape
    return classify_bias_shape(shape[0], shape[1], shape[2], batch, heads, sq) or "invalid"


def _bias_tuple(code: str | None, b: int, h: int, sq: int, skv: int) -> Any:
    if code is None or code == "invalid":
        return None if code is None else (0, 0, 0, 0)
    return (b if code[0] == "b" else 1, h if code[1] == "h" else 1,
            1 if code == "111s" else sq, skv)  # fmt: skip


def _recipe_key(fp8_meta: Any) -> tuple | None:
    """What ``from_attention_params`` reads of an FP8 recipe: class names and the dpa/mha flags."""
    if not isinstance(fp8_meta, Mapping):
        return None
    recipe = fp8_meta.get("recipe")
    local = fp8_meta.get("local_recipes")
    first = local[0] if local else None
    return (type(recipe).__name__, bool(getattr(recipe, "fp8_dpa", False)),
            bool(getattr(recipe, "fp8_mha", False)),
            None if first is None else type(first).__name__,
            bool(getattr(first, "fp8_mha", False)))  # fmt: skip


def _fake_fp8_meta(key: tuple | None) -> dict[str, Any] | None:
    if key is None:
        return None
    name, dpa, mha, local, local_mha = key
    meta: dict[str, Any] = {"recipe": type(name, (), {"fp8_dpa": dpa, "fp8_mha": mha})()}
    if local is not None:
        meta["local_recipes"] = [type(local, (), {"fp8_dpa": dpa, "fp8_mha": local_mha})()]
    return meta


# ------------------------------------------------------------------------------- environment
_ENVIRON = os.environ
#: The policy's environment (raw) and the active ``prefer()`` context, read as the policy reads
#: it (:func:`te_fl_attention.policy.snapshot`): the memo key's third part.
env_key = snapshot


def env_defaults() -> dict[str, str]:
    """For each policy variable, a value that means the same as leaving it unset (what
    the plugin writes at load time). Variables without such a value are left out."""
    base = Policy.from_env(environ={})
    out = {}
    for name in env_vars():
        for candidate in ("1", "0", ""):
            try:
                same = Policy.from_env(environ={name: candidate}) == base
            except ValueError:
                continue
            if same:
                out[name] = candidate
                break
    return out


# ------------------------------------------------------------------------------- TE types
@functools.lru_cache(maxsize=1)
def te_version() -> Version | None:
    """The installed TransformerEngine version (package metadata), or None."""
    from importlib import metadata

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return Version(metadata.version(dist))
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


_SUB_BACKEND_NAMES = {-1: "No_Backend", 0: "F16_max512_seqlen", 1: "F16_arbitrary_seqlen",
                      2: "FP8"}  # fmt: skip


def fused_backend_translator() -> Callable[[int], Any]:
    """int sub-backend -> the value the installed TE's ``get_attention_backend`` returns."""
    version = te_version()
    if version is None or version.release >= (2, 20):
        return int
    fa = sys.modules.get("transformer_engine.pytorch.cpp_extensions.fused_attn")
    table = getattr(fa, "FusedAttnBackend", None)
    if isinstance(table, type) and issubclass(table, enum.Enum):
        return table  # 2.19: FusedAttnBackend(1) is the member
    if isinstance(table, Mapping):  # <= 2.18: names -> pybind members
        return lambda value: table[_SUB_BACKEND_NAMES[value]]
    return int


# ------------------------------------------------------------------------------- the backend
TETuple = tuple[bool, Any, bool, Any, bool, list]


class TEBackend:
    """Our selection as TE's ``get_attention_backend``, for one device and one selector."""

    def __init__(self, selector: Selector, device: DeviceProfile | str | None = None,
                 memo_size: int = 4096) -> None:  # fmt: skip
        self.selector = selector
        self.device = profile(device)
        self.epoch = next(_EPOCHS)
        self._memo: dict[tuple, tuple] = {}
        self._memo_size = memo_size
        self._getters: dict[type, Callable[[dict], tuple] | None] = {}
        self._translate: Callable[[int], Any] | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._logged: set[tuple] = set()
        self.stats = {"hits": 0, "misses": 0, "traced": 0}
        self._agree_pending = True

    # -- eager ------------------------------------------------------------------------------
    def __call__(self, attention_params: Any = None) -> TETuple:
        """TE's ``get_attention_backend(attention_params)``."""
        if _is_compiling():
            return self.traced(attention_params)
        try:  # the hot path: one itemgetter over the params, the env snapshot, a dict lookup
            d = attention_params.__dict__
            if os.environ is not _ENVIRON:
                raise TypeError
            key = (self._getters[type(attention_params)](d),
                   _recipe_key(d["fp8_meta"]) if d["fp8"] else None,
                   snapshot())
            hit = self._memo[key]
        except (AttributeError, KeyError, TypeError):
            return self._slow(attention_params)
        return (hit[0], hit[1], hit[2], hit[3], hit[4], [*hit[5]])

    def _slow(self, params: Any) -> TETuple:
        """A memo miss, or params the fast key cannot read (not a dataclass, a list field)."""
        key = None
        d = getattr(params, "__dict__", None)
        cls = type(params)
        if d is not None and cls not in self._getters:
            self._getters[cls] = _field_getter(cls)
        getter = self._getters.get(cls)
        if d is not None and getter is not None:
            try:
                key = _frozen((getter(d), _recipe_key(d.get("fp8_meta")) if d.get("fp8")
                               else None, env_key()))  # fmt: skip
            except KeyError:
                key = None
            hit = self._memo.get(key) if key is not None else None
            if hit is not None:
                return (hit[0], hit[1], hit[2], hit[3], hit[4], [*hit[5]])
        return self._miss(params, key)

    def _miss(self, params: Any, key: tuple | None) -> TETuple:
        self.stats["misses"] += 1
        env = key[2] if key is not None else env_key()
        policy = Policy.from_snapshot(env)
        config = FusedAttnConfig.from_attention_params(params)
        decision = self._decide(config, policy)
        value = self.translate(decision, policy)
        self._log_decision(decision)
        if key is not None:
            with self._lock:
                if len(self._memo) >= self._memo_size:
                    self._memo.clear()
                self._memo[key] = value
        return (*value[:5], list(value[5]))  # type: ignore[return-value]

    def _decide(self, config: FusedAttnConfig, policy: Policy) -> Decision:
        """An agreed decision when ``TE_FL_ATTN_AGREE`` asks for one, else our own.

        The only collective is :func:`~te_fl_attention.fleet.agree` on the first selection of
        the process, which every rank of a data/tensor-parallel job reaches together. Later
        configs use what an explicit ``fleet.agree(configs)`` agreed, else the local decision:
        a collective on a later memo miss could deadlock ranks whose misses differ."""
        from .. import fleet

        if self._agree_pending:
            self._agree_pending = False
            mode = fleet.agree_from_env()
            if mode is not None and fleet.dist_ready():
                return fleet.agree([config], mode=mode, device=self.device,
                                   selector=self.selector, policy=policy)[0]  # fmt: skip
        return fleet.agreed(config, self.device) or self.selector.decide(config, self.device,
                                                                          policy)  # fmt: skip

    def decide(self, attention_params: Any) -> Decision:
        """The full :class:`Decision` (every candidate's reasons) for TE's params."""
        config = FusedAttnConfig.from_attention_params(attention_params)
        return self.selector.decide(config, self.device, Policy.from_env())

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()

    # -- translation --------------------------------------------------------------------------
    def translate(self, decision: Decision, policy: Policy) -> tuple:
        """A decision as TE's tuple (``available_backends`` as a tuple: callers copy it). Each
        candidate rides the TE slot its descriptor names (``Backend.te_slot``): our Triton
        kernel, and any flavour-less candidate in the flash slot, is ``use_flash_attention``
        with a :class:`BackendVersion` that names it (the router runs it)."""
        res = {r.backend: r for r in decision.results}
        ok = {name: bool(r.supported) for name, r in res.items()}
        chosen = decision.chosen
        slot = {name: backends.get(name).te_slot for name in res if backends.find(name)}
        flash = [n for n in backends.in_slot("flash") if ok.get(n)]
        allowed: tuple[str, ...] = ()
        for name in flash:
            r = res[name]
            allowed += tuple(v.backend for v in r.variants if v.supported) if r.variants \
                else (name,)  # fmt: skip
        tier = chosen if chosen in flash else flash[0] if flash else None
        fab = None
        if tier is not None and res[tier].variants:
            flavour = (decision.detail.get(f"{tier}_variant") or policy.flavour(res[tier])
                       or backends.precedence(tier)[-1])  # fmt: skip
            fab = BackendVersion(self._flavour_version(flavour), flavour, decision, allowed)
        elif tier is not None:
            fab = BackendVersion(our_version(tier), tier, decision, allowed)
        fused_ok = [n for n in backends.in_slot("fused") if ok.get(n)]
        fused = None
        if fused_ok:
            if self._translate is None:
                self._translate = fused_backend_translator()
            sub = res[chosen if chosen in fused_ok else fused_ok[0]].detail.get("sub_backend") or 1
            fused = self._translate(int(sub))
        if chosen is None:
            self._warn_none(decision)
        use = slot.get(chosen or "")
        return (use == "flash", fab, use == "fused", fused, use == "unfused",
                (bool(flash), bool(fused_ok),
                 any(ok.get(n) for n in backends.in_slot("unfused"))))  # fmt: skip

    def _flavour_version(self, flavour: str) -> str:
        field = backends.flavours()[flavour].version_field
        text = getattr(self.device, field, None) if field else None
        try:
            return str(Version(text)) if text else f"{flavour[-1]}"
        except ValueError:
            return f"{flavour[-1]}"

    def _log_decision(self, decision: Decision) -> None:
        """Each new decision once, at INFO on the ``te_fl_attention`` logger: the chosen
        backend and the first reason of each refused candidate (memo misses only)."""
        if not decision_logger.isEnabledFor(logging.INFO) or _is_compiling():
            return
        key = (decision.config.key(), decision.chosen, decision.flash_variant,
               tuple(sorted(decision.policy.items())) if decision.policy else ())
        if key in self._logged:
            return
        if len(self._logged) >= 4096:
            self._logged.clear()
        self._logged.add(key)
        decision_logger.info("%s", decision_line(decision))

    def _warn_none(self, decision: Decision) -> None:
        if _is_compiling():
            return
        key = decision.config.key()
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", NoBackendError(decision))

    # -- torch.compile ---------------------------------------------------------------------------
    def traced(self, p: Any) -> TETuple:
        """The selection inside a torch.compile trace (see the module docstring)."""
        b, sq, skv, h = p.batch_size, p.max_seqlen_q, p.max_seqlen_kv, guard_scalar(p.num_heads)
        buckets = {name: traced_token_bucket(getattr(p, name)) for name in _TOKEN_FIELDS
                   if hasattr(p, name)}  # fmt: skip
        preds = shape_predicates(b, h, sq, skv, buckets.get("num_tokens_q", 0),
                                 buckets.get("num_tokens_kv", 0))  # fmt: skip
        fields = []
        for name in TRACED_FIELDS:
            if hasattr(p, name):
                value = getattr(p, name)
                if name in _SPECIALIZED:  # a symbolic head count or dim: guard on its value
                    value = guard_scalar(value)
                fields.append((name, tuple(value) if isinstance(value, list) else value))
        bias = _bias_code(getattr(p, "core_attention_bias_shape", None), b, h, sq)
        alibi = getattr(p, "alibi_slopes_shape", None)
        alibi_rank = None if alibi is None else len(alibi)
        fp8 = _recipe_key(getattr(p, "fp8_meta", None)) if getattr(p, "fp8", False) else None
        inf = getattr(p, "inference_params", None)
        kv = None if inf is None else (bool(getattr(inf, "is_paged", False)),
                                       guard_scalar(getattr(inf, "page_size", 0) or 0))
        fields += buckets.items()
        env = tuple(os.environ.get(name) for name in _traced_env_vars())
        return _constant_select(self.epoch, preds, tuple(fields), bias, alibi_rank, fp8, kv, env)

    def traced_select(self, preds: tuple, fields: tuple, bias: str | None,
                      alibi_rank: int | None, fp8: tuple | None, kv: tuple | None,
                      env: tuple) -> TETuple:  # fmt: skip
        """What :meth:`traced` evaluates at trace time, with constants only."""
        self.stats["traced"] += 1
        values = dict(fields)
        h = int(values.get("num_heads", 16))
        b, sq, skv = representative(h, preds, int(values.get("num_tokens_q") or 0),
                                    int(values.get("num_tokens_kv") or 0))  # fmt: skip
        inference = None if kv is None else SimpleNamespace(is_paged=kv[0], page_size=kv[1])
        alibi = None if alibi_rank is None else ((h,) if alibi_rank == 1 else (b, h))
        params = SimpleNamespace(
            **values, batch_size=b, max_seqlen_q=sq, max_seqlen_kv=skv,
            core_attention_bias_shape=_bias_tuple(bias, b, h, sq, skv), alibi_slopes_shape=alibi,
            fp8_meta=_fake_fp8_meta(fp8), inference_params=inference,
        )  # fmt: skip
        policy = Policy.from_env(environ={k: v for k, v in zip(env_vars(), env, strict=True)
                                          if v is not None})  # fmt: skip
        config = FusedAttnConfig.from_attention_params(params)
        value = self.translate(self.selector.decide(config, self.device, policy), policy)
        return (*value[:5], list(value[5]))  # type: ignore[return-value]


_is_compiling = torch.compiler.is_compiling
#: :func:`~te_fl_attention.policy.env_vars` as a constant to dynamo (it reads the registry's
#: memo, which tracing must not guard on); its ``os.environ.get`` reads are still guarded.
_traced_env_vars = torch.compiler.assume_constant_result(env_vars)
_EPOCHS = itertools.count(1)
#: The backend the traced path reads (set by :func:`set_current`; one per process).
_CURRENT: list[TEBackend] = []


def set_current(backend: TEBackend | None) -> None:
    _CURRENT[:] = [] if backend is None else [backend]


def current() -> TEBackend | None:
    return _CURRENT[0] if _CURRENT else None


@torch.compiler.assume_constant_result
def _constant_select(epoch: int, preds: tuple, fields: tuple, bias: Any, alibi_rank: Any,
                     fp8: Any, kv: Any, env: tuple) -> TETuple:  # fmt: skip
    backend = next((b for b in _CURRENT if b.epoch == epoch), None)
    if backend is None:
        raise RuntimeError("the te-fl-attention backend was reconfigured during tracing")
    return backend.traced_select(preds, fields, bias, alibi_rank, fp8, kv, env)


def _frozen(key: tuple) -> tuple | None:
    """The key with list values as tuples (None if still unhashable)."""
    values, fp8, env = key
    out = (tuple(tuple(v) if isinstance(v, list) else v for v in values), fp8, env)
    try:
        hash(out)
    except TypeError:
        return None
    return out


#: TE's thd token counts (q.shape[0] / k.shape[0]; 0 for other formats): keyed by their bucket.
_TOKEN_FIELDS = ("num_tokens_q", "num_tokens_kv")
#: AttentionParams fields the key leaves out as they are: ``fp8_meta`` (keyed by its recipe
#: instead) and the token counts (they change every batch; keyed by their bucket instead).
_UNKEYED = ("fp8_meta", *_TOKEN_FIELDS)


def _field_getter(cls: type) -> Callable[[dict], tuple] | None:
    """Reads every keyed field from an instance ``__dict__`` (one C call), then the token
    counts' buckets: two calls whose counts share a bucket share a key, others do not."""
    if not dataclasses.is_dataclass(cls):
        return None
    every = [f.name for f in dataclasses.fields(cls)]
    names = [n for n in every if n not in _UNKEYED]
    if len(names) < 2:
        return None
    fields_of = operator.itemgetter(*names)
    tokens = tuple(n for n in _TOKEN_FIELDS if n in every)
    if not tokens:
        return fields_of

    if tokens == _TOKEN_FIELDS:  # TE's AttentionParams: the hot path, unrolled

        def getter(d: dict) -> tuple:
            nq, nkv = d["num_tokens_q"], d["num_tokens_kv"]
            return fields_of(d) + (nq and token_bucket(nq), nkv and token_bucket(nkv))

        return getter

    def getter_any(d: dict) -> tuple:
        return fields_of(d) + tuple(token_bucket(d[n]) for n in tokens)

    return getter_any


# ------------------------------------------------------------------------------- TE's function
_WARNED: set[str] = set()


def get_attention_backend(attention_params: Any = None) -> tuple:
    """TE's ``get_attention_backend``: ``(use_flash_attention, flash_attention_backend,
    use_fused_attention, fused_attention_backend, use_unfused_attention, available_backends)``
    from our Selector (see :class:`TEBackend`). If our selection raises outside torch.compile,
    TE's own function answers (one warning per error)."""
    backend = _CURRENT[0] if _CURRENT else _default_backend()
    try:
        return backend(attention_params)
    except Exception as exc:  # noqa: BLE001 - TE must keep working
        original = _original_selector()
        if original is None or torch.compiler.is_compiling():
            raise
        _warn_once(f"{type(exc).__name__}: {exc}", "te-fl-attention could not select a backend "
                   "(%s); TransformerEngine's own get_attention_backend answers instead", exc)
        return original(attention_params)


def make_backend(device: DeviceProfile | str | None, selector: Selector | None) -> TEBackend:
    """The backend for ``device`` (``TE_FL_ATTN_DEVICE`` when not given). A malformed switch
    (``TE_FL_ATTN_*`` not exactly 0/1) raises ``ValueError`` here, naming it: TE raises on
    an ``NVTE_*`` it cannot read too, and plugin loading then fails with TE's own warning."""
    check_switches()
    configure_logging()
    if device is None:
        device = os.environ.get("TE_FL_ATTN_DEVICE") or None
    if selector is None:
        from ..selector import default_selector

        selector = default_selector()
    return TEBackend(selector, profile(device))


_DEFAULT_LOCK = threading.Lock()


def _default_backend() -> TEBackend:
    """Used when get_attention_backend is called without load_plugins/install."""
    with _DEFAULT_LOCK:
        backend = current()
        if backend is None:
            backend = make_backend(None, None)
            set_current(backend)
        return backend


def _original_selector() -> Callable[[Any], Any] | None:
    utils = sys.modules.get(DPA_UTILS)
    original = getattr(utils, "_original_get_attention_backend", None)
    return None if original is get_attention_backend else original


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg, *args)


__all__ = ["TEBackend", "BackendVersion", "TRITON_VERSION", "flash_tier", "our_version",
           "shape_predicates", "representative", "env_key", "env_defaults", "token_bucket",
           "traced_token_bucket",
           "fused_backend_translator", "te_version", "current", "set_current",
           "get_attention_backend", "make_backend"]  # fmt: skip

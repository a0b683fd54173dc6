"""Op registry and dispatch for the TransformerEngine plugin, API-compatible with TE-FL.

Every ``transformer_engine_torch`` attribute that te-fl-attention does not define itself is an
*op*: a name with one or more implementations (``OpImpl``) of three kinds, ``flagos``,
``vendor`` and ``reference``. ``OpRegistry`` holds them, ``SelectionPolicy`` says which to try
first, ``OpManager`` orders the eligible ones, calls them and falls back on failure. TE's compiled
extension (``transformer_engine_torch_nv``) is registered with ``register_native`` as a lazy
source of ``vendor.cuda`` implementations: any public function of it is an op, looked up by name
on first use, never enumerated.

Plugins add implementations with a ``register(registry)`` function, found through the
``te_fl.plugin`` entry-point group and the modules listed in ``TE_FL_PLUGIN_MODULES``
(``discover_plugins``). This module imports only the standard library.

Environment
-----------
Read by ``SelectionPolicy.from_env`` (once per policy, not per call):

- ``TE_FL_PREFER``: ``flagos`` (default), ``vendor`` or ``reference``, the kind tried first.
- ``TE_FL_PREFER_VENDOR``: comma list of vendor names tried first among vendor implementations.
- ``TE_FL_STRICT``: ``1``/``true``/``yes``/``on`` = no fallback; ``0``/``false``/``no``/``off``/
  unset = fall back to the next candidate when an implementation raises.
- ``TE_FL_ALLOW_VENDORS`` / ``TE_FL_DENY_VENDORS``: comma lists; a non-empty allow list admits
  only the named vendors; deny wins over allow. Only ``vendor`` implementations are filtered.
- ``TE_FL_PER_OP``: ``op=tok|tok;op2=tok`` with tokens ``flagos``, ``vendor``, ``reference``,
  ``vendor:NAME``, ``impl:ID``. The list replaces the default order for that op: implementations
  no token matches are not candidates, not even for fallback (as in TE-FL).
- ``TE_FL_PLUGIN_MODULES``: comma list of modules to import (read by ``discover_plugins``).
- ``TEFL_LOG_LEVEL``: level name for the ``te_fl_attention`` loggers (registry, plugin, and
  each new attention decision at INFO).

Ordering
--------
Per-op tokens if the op has any, else the preferred kind then the others (``flagos``: flagos,
vendor, reference; ``vendor``: vendor, flagos, reference; ``reference``: reference, flagos,
vendor). Implementations that are unavailable, or vendor implementations that the allow/deny lists
exclude, are dropped first. Within one token: vendors named in ``TE_FL_PREFER_VENDOR`` (in that
order) first, then higher ``priority``, then ``impl_id`` ascending. Priority never beats the token
order. An implementation appears once however many tokens match it.

Differences from TE-FL
----------------------
1. ``TE_FL_STRICT=1`` means strict, no fallback, as TE-FL documents: the first eligible
   implementation runs and its exception propagates unchanged. (TE-FL's code falls back unless
   the value is exactly ``0``.) Unset or ``0`` falls back, TE-FL's effective default.
2. Vendor names match case-insensitively everywhere: ``TE_FL_ALLOW_VENDORS``,
   ``TE_FL_DENY_VENDORS``, ``TE_FL_PREFER_VENDOR``, ``vendor:NAME`` tokens and ``OpImpl.vendor``.
   (TE-FL compares exactly, so its documented ``vendor:cuda`` never matched its ``"CUDA"``
   backend.)
3. ``TE_FL_PER_OP`` is validated. An unknown token (e.g. ``default``, ``cuda``, ``vendor:``), an
   entry without ``=``, an empty op name, an op without tokens or an op listed twice raises
   ``ValueError`` naming it (and listing the allowed tokens) when the policy is built. An op
   name that neither the registry nor the native module knows raises ``ValueError`` at the
   manager's first resolve/call/chosen or at an explicit ``OpManager.validate()``, that is after
   plugins have registered their ops, so plugin-defined ops can be configured too. TE-FL ignores
   all of these silently.
4. Fallback is per call: when an implementation fails, the next candidate serves that call only,
   and the next call starts again from the preferred implementation. (TE-FL caches the fallback
   for the rest of the process, so one unsupported input demoted the op for good.)
5. A failing implementation runs once per call. (TE-FL ran a cached implementation that had just
   failed a second time, as the first fallback candidate.)
6. Other invalid values raise ``ValueError`` naming the variable, the value and what is allowed
   (``TE_FL_PREFER=gpu``, ``TE_FL_STRICT=maybe``, ``TEFL_LOG_LEVEL=loud``). TE-FL printed a
   warning and used a default.
7. ``TE_FL_PREFER_VENDOR`` is a comma list of vendor names tried first among vendors. TE-FL's
   legacy values ``1`` (prefer the vendor kind) and ``0`` (no effect) are still understood when
   ``TE_FL_PREFER`` is unset.
8. The native extension is a lazy ``vendor.cuda`` source: functions TE adds in new versions
   resolve without being registered, and non-op attributes (classes, enums, constants) pass
   through unchanged. (TE-FL's stub exposes only the ops its backends registered at load time.)
9. Registrations made after the first call are seen on the next call (no epoch bump), and the
   environment is read once, when the policy is built (TE-FL re-reads ``TE_FL_STRICT`` on every
   call but caches the rest).
10. When every candidate fails, an op with one candidate re-raises the original exception; an op
    with several raises ``AllImplsFailedError`` (a ``RuntimeError``) listing each failure, chained
    to the last one. No eligible candidate raises ``NoImplementationError`` (a
    ``RuntimeError``) saying why each implementation was excluded; an unknown op raises
    ``UnknownOpError`` (an ``AttributeError``).
11. Equal priorities within a token are ordered by ``impl_id`` ascending (TE-FL: descending).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

LOGGER_NAME = "te_fl_attention.registry"
ENTRY_POINT_GROUP = "te_fl.plugin"
KINDS = ("flagos", "vendor", "reference")
TOKEN_FORMS = ("flagos", "vendor", "reference", "vendor:NAME", "impl:ID")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_DEFAULT_ORDERS = {
    "flagos": ("flagos", "vendor", "reference"),
    "vendor": ("vendor", "flagos", "reference"),
    "reference": ("reference", "flagos", "vendor"),
}

logger = logging.getLogger(LOGGER_NAME)

__all__ = [
    "AllImplsFailedError", "BackendImplKind", "NoImplementationError", "OpImpl", "OpManager",
    "OpRegistry", "PluginRecord", "SelectionPolicy", "UnknownOpError", "configure_logging",
    "discover_plugins", "match_token", "register_native",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Errors


class UnknownOpError(AttributeError):
    """Neither the registry nor the native module knows this op."""

    def __init__(self, op_name: str) -> None:
        super().__init__(f"op {op_name!r} is not registered and no native module defines it")
        self.op_name = op_name


class NoImplementationError(RuntimeError):
    """The op is known but policy, allow/deny lists or availability exclude every implementation."""


class AllImplsFailedError(RuntimeError):
    """Every candidate implementation raised (only without ``TE_FL_STRICT``)."""

    def __init__(self, op_name: str, failures: list[tuple[str, BaseException]]) -> None:
        detail = "; ".join(f"{impl_id!r}: {exc!r}" for impl_id, exc in failures)
        count = len(failures)
        super().__init__(f"All {count} implementation(s) failed for op {op_name!r}: {detail}")
        self.op_name = op_name
        self.failures = tuple(failures)


# --------------------------------------------------------------------------------------------
# Types


class BackendImplKind(str, Enum):
    """Kind of implementation; the value is the token used in env vars and logs."""

    FLAGOS = "flagos"
    DEFAULT = "flagos"  # TE-FL's member name for the same kind
    VENDOR = "vendor"
    REFERENCE = "reference"

    def __str__(self) -> str:
        return self.value


def _as_kind(kind: Any) -> BackendImplKind:
    value = str(getattr(kind, "value", kind)).strip().lower()
    try:
        return BackendImplKind(value)
    except ValueError:
        allowed = ", ".join(KINDS)
        raise ValueError(f"kind={kind!r} is not valid: expected one of {allowed}") from None


def _vendor_key(name: str) -> str:
    return name.strip().lower()


def _vendor_keys(names: Iterable[str]) -> list[str]:
    return [_vendor_key(name) for name in names if name.strip()]


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op. ``available()`` (or TE-FL's ``fn._is_available()``) gates it."""

    op_name: str
    impl_id: str
    kind: BackendImplKind
    fn: Callable[..., Any]
    vendor: str | None = None
    priority: int = 0
    available: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _as_kind(self.kind))
        if not self.op_name or not self.impl_id:
            raise ValueError(f"OpImpl needs op_name and impl_id, got {self.op_name!r}, "
                             f"{self.impl_id!r}")
        if not callable(self.fn):
            raise TypeError(f"OpImpl {self.impl_id!r} for {self.op_name!r}: fn is not callable")
        if self.kind is BackendImplKind.VENDOR and not (self.vendor and self.vendor.strip()):
            raise ValueError(f"vendor OpImpl {self.impl_id!r} for {self.op_name!r} needs a vendor")

    @property
    def vendor_key(self) -> str | None:
        """Lower-cased vendor name (what allow/deny/prefer lists compare against)."""
        return _vendor_key(self.vendor) if self.vendor else None

    def is_available(self) -> bool:
        """True unless the availability check returns false or raises."""
        check = self.available or getattr(self.fn, "_is_available", None)
        if not callable(check):
            return True
        try:
            return bool(check())
        except Exception as exc:  # an availability probe must never break dispatch
            logger.debug("Availability check of %r raised %r", self.impl_id, exc)
            return False

    @classmethod
    def coerce(cls, obj: Any) -> OpImpl:
        """Accept an ``OpImpl`` or any object with the same attributes (e.g. TE-FL's)."""
        if isinstance(obj, cls):
            return obj
        return cls(op_name=obj.op_name, impl_id=obj.impl_id, kind=obj.kind, fn=obj.fn,
                   vendor=getattr(obj, "vendor", None), priority=getattr(obj, "priority", 0),
                   available=getattr(obj, "available", None))


# --------------------------------------------------------------------------------------------
# Tokens and policy


def _bad_token(token: str, where: str) -> ValueError:
    hint = " ('default' is TE-FL's old name for 'flagos')" if token == "default" else ""
    return ValueError(f"{where}: unknown token {token!r}{hint}; allowed: {', '.join(TOKEN_FORMS)}")


def _normalize_token(token: str, where: str = "per-op order") -> str:
    """Canonical token (kinds and vendor names lower-cased); unknown tokens raise."""
    tok = token.strip()
    if tok.lower() in KINDS:
        return tok.lower()
    prefix, sep, arg = tok.partition(":")
    prefix, arg = prefix.strip().lower(), arg.strip()
    if sep and arg and prefix == "vendor":
        return f"vendor:{_vendor_key(arg)}"
    if sep and arg and prefix == "impl":
        return f"impl:{arg}"
    raise _bad_token(tok, where)


def _matches(impl: OpImpl, token: str) -> bool:
    if token in KINDS:
        return impl.kind.value == token
    prefix, _, arg = token.partition(":")
    if prefix == "vendor":
        return impl.kind is BackendImplKind.VENDOR and impl.vendor_key == arg
    return impl.impl_id == arg


def match_token(impl: OpImpl, token: str) -> bool:
    """Whether ``token`` (``flagos``, ``vendor:NAME``, ``impl:ID``, ...) selects ``impl``."""
    return _matches(impl, _normalize_token(token))


def _choice(where: str, value: str, allowed: Iterable[str]) -> str:
    norm = value.strip().lower()
    allowed = tuple(allowed)
    if norm not in allowed:
        raise ValueError(f"{where}={value!r} is not valid: expected one of {', '.join(allowed)}")
    return norm


def _split(text: str, sep: str = ",") -> list[str]:
    return [part.strip() for part in text.split(sep) if part.strip()]


def _normalize_per_op(
    per_op: Mapping[str, Iterable[str]] | Iterable[tuple[str, Iterable[str]]], where: str
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    items = per_op.items() if isinstance(per_op, Mapping) else per_op
    out: dict[str, tuple[str, ...]] = {}
    for op, tokens in items:
        op = op.strip()
        if not op:
            raise ValueError(f"{where}: empty op name")
        if op in out:
            raise ValueError(f"{where}: op {op!r} is listed twice")
        tokens = tuple(_normalize_token(t, f"{where} (op {op!r})") for t in tokens if t.strip())
        if not tokens:
            raise ValueError(f"{where}: op {op!r} has no tokens; allowed: {', '.join(TOKEN_FORMS)}")
        out[op] = tuple(dict.fromkeys(tokens))
    return tuple(sorted(out.items()))


def _parse_per_op(text: str, var: str = "TE_FL_PER_OP") -> dict[str, list[str]]:
    """Parse ``op=tok|tok;op2=tok`` (syntax errors raise, naming ``var``)."""
    entries: list[tuple[str, list[str]]] = []
    for entry in _split(text, ";"):
        op, sep, order = entry.partition("=")
        if not sep:
            raise ValueError(f"{var}: entry {entry!r} is not of the form op=token|token; "
                             f"allowed tokens: {', '.join(TOKEN_FORMS)}")
        entries.append((op, order.split("|")))
    return {op: list(toks) for op, toks in _normalize_per_op(entries, var)}


def _parse_bool(environ: Mapping[str, str], var: str) -> bool:
    raw = environ.get(var, "")
    norm = raw.strip().lower()
    if norm in _TRUE or norm in _FALSE:
        return norm in _TRUE
    raise ValueError(f"{var}={raw!r} is not valid: expected one of {', '.join(_TRUE + _FALSE[1:])}")


def _parse_prefer(environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """(prefer kind, preferred vendors) from TE_FL_PREFER / TE_FL_PREFER_VENDOR."""
    raw = environ.get("TE_FL_PREFER", "")
    vendors = environ.get("TE_FL_PREFER_VENDOR", "").strip()
    legacy = vendors in ("0", "1")
    if raw.strip():
        prefer = _choice("TE_FL_PREFER", raw, KINDS)
    else:
        prefer = "vendor" if vendors == "1" else "flagos"
    return prefer, () if legacy else tuple(_split(vendors))


@dataclass(frozen=True)
class SelectionPolicy:
    """What to try first; immutable, validated on construction (see the module docstring)."""

    prefer: str = "flagos"
    strict: bool = False
    per_op_order: tuple[tuple[str, tuple[str, ...]], ...] = ()
    deny_vendors: frozenset[str] = frozenset()
    allow_vendors: frozenset[str] | None = None
    prefer_vendors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        norm = {
            "prefer": _choice("prefer", str(self.prefer), KINDS),
            "strict": bool(self.strict),
            "per_op_order": _normalize_per_op(self.per_op_order, "per_op_order"),
            "deny_vendors": frozenset(_vendor_keys(self.deny_vendors)),
            "allow_vendors": frozenset(_vendor_keys(self.allow_vendors or ())) or None,
            "prefer_vendors": tuple(dict.fromkeys(_vendor_keys(self.prefer_vendors))),
        }
        for name, value in norm.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SelectionPolicy:
        """Build from ``TE_FL_*`` (and apply ``TEFL_LOG_LEVEL``); invalid values raise."""
        env = os.environ if environ is None else environ
        configure_logging(env)
        prefer, prefer_vendors = _parse_prefer(env)
        return cls(
            prefer=prefer,
            strict=_parse_bool(env, "TE_FL_STRICT"),
            per_op_order=tuple(_parse_per_op(env.get("TE_FL_PER_OP", "")).items()),
            deny_vendors=frozenset(_split(env.get("TE_FL_DENY_VENDORS", ""))),
            allow_vendors=frozenset(_split(env.get("TE_FL_ALLOW_VENDORS", ""))) or None,
            prefer_vendors=prefer_vendors,
        )

    @classmethod
    def from_dict(
        cls,
        prefer: str = "flagos",
        strict: bool = False,
        per_op_order: Mapping[str, Iterable[str]] | None = None,
        deny_vendors: Iterable[str] = (),
        allow_vendors: Iterable[str] | None = None,
        prefer_vendors: Iterable[str] = (),
    ) -> SelectionPolicy:
        """TE-FL-style constructor taking plain dicts and lists."""
        return cls(prefer=prefer, strict=strict, per_op_order=tuple((per_op_order or {}).items()),
                   deny_vendors=frozenset(deny_vendors),
                   allow_vendors=frozenset(allow_vendors) if allow_vendors else None,
                   prefer_vendors=tuple(prefer_vendors))

    @property
    def per_op_order_dict(self) -> dict[str, list[str]]:
        """Per-op token lists as a dict."""
        return {op: list(tokens) for op, tokens in self.per_op_order}

    def get_default_order(self) -> list[str]:
        """Kind tokens in the order tried when an op has no per-op order."""
        return list(_DEFAULT_ORDERS[self.prefer])

    def get_per_op_order(self, op_name: str) -> list[str] | None:
        """The op's own token list, or None."""
        tokens = dict(self.per_op_order).get(op_name)
        return list(tokens) if tokens else None

    def order_for(self, op_name: str) -> tuple[str, ...]:
        """Tokens tried for ``op_name``: its per-op order, else the default order."""
        return dict(self.per_op_order).get(op_name) or _DEFAULT_ORDERS[self.prefer]

    def is_vendor_allowed(self, vendor: str) -> bool:
        """Deny wins over allow; a non-empty allow list admits only its vendors."""
        key = _vendor_key(vendor)
        if key in self.deny_vendors:
            return False
        return self.allow_vendors is None or key in self.allow_vendors

    def vendor_rank(self, vendor: str | None) -> int:
        """Position in ``prefer_vendors`` (unlisted vendors after all listed ones)."""
        key = _vendor_key(vendor) if vendor else None
        if key in self.prefer_vendors:
            return self.prefer_vendors.index(key)
        return len(self.prefer_vendors)

    def vendor_names(self) -> frozenset[str]:
        """Every vendor name the policy mentions (lists and ``vendor:NAME`` tokens)."""
        tokens = (t for _, toks in self.per_op_order for t in toks if t.startswith("vendor:"))
        return frozenset({*self.deny_vendors, *(self.allow_vendors or ()), *self.prefer_vendors,
                          *(t.partition(":")[2] for t in tokens)})


# --------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class _NativeSource:
    module: ModuleType
    vendor: str
    priority: int

    @property
    def impl_id(self) -> str:
        return f"vendor.{_vendor_key(self.vendor)}"

    def impl(self, op_name: str) -> OpImpl | None:
        if op_name.startswith("_"):
            return None
        attr = getattr(self.module, op_name, None)
        if not callable(attr) or isinstance(attr, type):
            return None
        return OpImpl(op_name, self.impl_id, BackendImplKind.VENDOR, attr, vendor=self.vendor,
                      priority=self.priority)


class OpRegistry:
    """Thread-safe store ``{op_name: {impl_id: OpImpl}}`` plus lazy native sources."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._impls: dict[str, dict[str, OpImpl]] = {}
        self._natives: list[_NativeSource] = []
        self._native_cache: dict[str, tuple[OpImpl, ...]] = {}
        self._version = 0

    @property
    def version(self) -> int:
        """Bumped on every change; managers use it to refresh their cached orders."""
        return self._version

    def register(self, impl: OpImpl, *, replace: bool = False) -> OpImpl:
        """Add ``impl``; a second impl with the same id for one op raises unless ``replace``."""
        impl = OpImpl.coerce(impl)
        with self._lock:
            by_id = self._impls.setdefault(impl.op_name, {})
            if impl.impl_id in by_id and not replace:
                raise ValueError(f"op {impl.op_name!r} already has an implementation "
                                 f"{impl.impl_id!r} (pass replace=True to override)")
            by_id[impl.impl_id] = impl
            self._version += 1
        return impl

    register_impl = register  # TE-FL name

    def register_many(self, impls: Iterable[OpImpl], *, replace: bool = False) -> None:
        """Register each of ``impls``."""
        for impl in impls:
            self.register(impl, replace=replace)

    def add_native(self, module: ModuleType, vendor: str = "cuda", priority: int = 0) -> None:
        """Use ``module``'s public functions as ``vendor.<vendor>`` impls (see register_native)."""
        source = _NativeSource(module, vendor, priority)
        with self._lock:
            for old in self._natives:
                if old.module is module and old.impl_id == source.impl_id:
                    return
                if old.impl_id == source.impl_id:
                    raise ValueError(f"native vendor {vendor!r} is already registered")
            self._natives.append(source)
            self._native_cache.clear()
            self._version += 1

    def native_attr(self, name: str) -> Any:
        """Attribute ``name`` of the first native module that has it (else AttributeError)."""
        for source in list(self._natives):
            if hasattr(source.module, name):
                return getattr(source.module, name)
        raise AttributeError(name)

    def native_names(self) -> list[str]:
        """Public function names of the native modules (enumerates; meant for error messages)."""
        names = {n for s in list(self._natives) for n in dir(s.module) if s.impl(n) is not None}
        return sorted(names)

    def _native_impls(self, op_name: str) -> tuple[OpImpl, ...]:
        cached = self._native_cache.get(op_name)
        if cached is None:
            found = (source.impl(op_name) for source in list(self._natives))
            cached = tuple(impl for impl in found if impl is not None)
            if not op_name.startswith("_"):
                self._native_cache[op_name] = cached
        return cached

    def impls(self, op_name: str) -> tuple[OpImpl, ...]:
        """Registered impls (registration order), then native ones whose id is not taken."""
        with self._lock:
            own = dict(self._impls.get(op_name, {}))
        native = tuple(n for n in self._native_impls(op_name) if n.impl_id not in own)
        return (*own.values(), *native)

    get_implementations = impls  # TE-FL name

    def get_implementation(self, op_name: str, impl_id: str) -> OpImpl | None:
        """One impl by id, or None."""
        return next((i for i in self.impls(op_name) if i.impl_id == impl_id), None)

    def ops(self) -> list[str]:
        """Explicitly registered op names (native functions are not enumerated)."""
        with self._lock:
            return sorted(self._impls)

    list_operators = ops  # TE-FL name

    def has_op(self, op_name: str) -> bool:
        """Registered, or a public function of a native module."""
        return op_name in self._impls or bool(self._native_impls(op_name))

    __contains__ = has_op

    def vendors(self) -> frozenset[str]:
        """Lower-cased vendor names of registered impls and native sources."""
        with self._lock:
            own = {i.vendor_key for by_id in self._impls.values() for i in by_id.values()}
            native = {_vendor_key(source.vendor) for source in self._natives}
            return frozenset({*(v for v in own if v), *native})

    def clear(self) -> None:
        """Forget every impl and native source."""
        with self._lock:
            self._impls.clear()
            self._natives.clear()
            self._native_cache.clear()
            self._version += 1


def register_native(
    registry: OpRegistry, module: ModuleType, vendor: str = "cuda", *, priority: int = 0
) -> None:
    """Make every public function of ``module`` a ``vendor.<vendor>`` impl, looked up lazily.

    Classes, enums and constants are not ops; ``OpManager.resolve`` returns them unchanged.
    """
    registry.add_native(module, vendor=vendor, priority=priority)


# --------------------------------------------------------------------------------------------
# Manager


class OpManager:
    """Orders eligible impls per op by policy, calls them, falls back per call (unless strict)."""

    def __init__(
        self,
        registry: OpRegistry | None = None,
        policy: SelectionPolicy | None = None,
        native: ModuleType | None = None,
        *,
        native_vendor: str = "cuda",
    ) -> None:
        self._registry = OpRegistry() if registry is None else registry
        self._policy = SelectionPolicy.from_env() if policy is None else policy
        if native is not None:
            register_native(self._registry, native, vendor=native_vendor)
        self._lock = threading.RLock()
        self._plans: dict[str, tuple[int, tuple[OpImpl, ...]]] = {}
        self._dispatchers: dict[str, Callable[..., Any]] = {}
        self._validated = False
        self._logged: set[tuple[str, str]] = set()
        self._warned: set[tuple[str, str, str]] = set()

    @property
    def registry(self) -> OpRegistry:
        """The registry this manager dispatches over."""
        return self._registry

    @property
    def policy(self) -> SelectionPolicy:
        """The current policy; assigning a new one takes effect on the next call."""
        return self._policy

    @policy.setter
    def policy(self, policy: SelectionPolicy) -> None:
        with self._lock:
            self._policy = policy
            self._validated = False
            self._plans.clear()

    def refresh(self) -> None:
        """Drop cached orders (availability is re-checked on the next call)."""
        with self._lock:
            self._plans.clear()

    # -- validation ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError for per-op entries naming unknown ops; warn about unknown vendors."""
        unknown = [op for op, _ in self._policy.per_op_order if not self._registry.has_op(op)]
        if unknown:
            raise ValueError(self._unknown_ops_message(unknown))
        stray = sorted(self._policy.vendor_names() - self._registry.vendors())
        if stray:
            logger.warning("TE_FL_* names vendor(s) %s that no implementation has; known: %s",
                           ", ".join(stray), ", ".join(sorted(self._registry.vendors())) or "none")
        self._validated = True

    def _unknown_ops_message(self, unknown: list[str]) -> str:
        import difflib

        known = [*self._registry.ops(), *self._registry.native_names()]
        parts = []
        for op in unknown:
            close = difflib.get_close_matches(op, known, n=3)
            parts.append(f"{op!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        listed = ", ".join(self._registry.ops()) or "none"
        return (f"TE_FL_PER_OP names unknown op(s) {'; '.join(parts)}; registered ops: {listed}"
                " (or any function of the native module)")

    # -- ordering -----------------------------------------------------------------------------

    def _eligible(self, impl: OpImpl) -> bool:
        if impl.kind is BackendImplKind.VENDOR and not self._policy.is_vendor_allowed(impl.vendor):
            return False
        return impl.is_available()

    def _rank(self, impl: OpImpl) -> tuple[int, int, str]:
        vendor = self._policy.vendor_rank(impl.vendor) if impl.kind is BackendImplKind.VENDOR else 0
        return vendor, -impl.priority, impl.impl_id

    def _build_plan(self, op_name: str) -> tuple[OpImpl, ...]:
        eligible = [impl for impl in self._registry.impls(op_name) if self._eligible(impl)]
        plan: dict[str, OpImpl] = {}
        for token in self._policy.order_for(op_name):
            for impl in sorted((i for i in eligible if _matches(i, token)), key=self._rank):
                plan.setdefault(impl.impl_id, impl)
        return tuple(plan.values())

    def _plan(self, op_name: str) -> tuple[OpImpl, ...]:
        version = self._registry.version
        entry = self._plans.get(op_name)
        if entry is not None and entry[0] == version:
            return entry[1]
        if not self._validated:
            self.validate()
        plan = self._build_plan(op_name)
        with self._lock:
            self._plans[op_name] = (version, plan)
        return plan

    def candidates(self, op_name: str) -> tuple[OpImpl, ...]:
        """Eligible impls in the order they are tried."""
        return self._plan(op_name)

    resolve_candidates = candidates  # TE-FL name

    def _why_excluded(self, impl: OpImpl, tokens: tuple[str, ...]) -> str:
        if impl.kind is BackendImplKind.VENDOR and not self._policy.is_vendor_allowed(impl.vendor):
            return "excluded by TE_FL_ALLOW_VENDORS/TE_FL_DENY_VENDORS"
        if not impl.is_available():
            return "unavailable"
        return f"matched by no token of {'|'.join(tokens)}"

    def _no_impl_error(self, op_name: str) -> Exception:
        impls = self._registry.impls(op_name)
        if not impls:
            return UnknownOpError(op_name)
        tokens = self._policy.order_for(op_name)
        why = "; ".join(f"{i.impl_id!r} {self._why_excluded(i, tokens)}" for i in impls)
        return NoImplementationError(f"No eligible implementation for op {op_name!r}: {why}")

    def chosen(self, op_name: str) -> str:
        """impl_id tried first for ``op_name`` (fallbacks are per call and not reflected)."""
        plan = self._plan(op_name)
        if not plan:
            raise self._no_impl_error(op_name)
        return plan[0].impl_id

    get_selected_impl_id = chosen  # TE-FL name

    # -- dispatch -----------------------------------------------------------------------------

    def _note_used(self, op_name: str, impl: OpImpl) -> None:
        key = (op_name, impl.impl_id)
        if key in self._logged:
            return
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.info("Op '%s' using '%s' (kind=%s, vendor=%s)", op_name, impl.impl_id,
                    impl.kind.value, impl.vendor)

    def _note_failure(self, op_name: str, impl: OpImpl, exc: Exception, last: bool) -> None:
        key = (op_name, impl.impl_id, type(exc).__name__)
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        level = logging.WARNING if first else logging.DEBUG
        then = "no candidate left" if last else "trying the next one for this call"
        logger.log(level, "Implementation '%s' failed for op '%s': %r; %s", impl.impl_id, op_name,
                   exc, then)

    def _call_with_fallback(
        self, op_name: str, plan: tuple[OpImpl, ...], args: tuple, kwargs: dict
    ) -> Any:
        failures: list[tuple[str, BaseException]] = []
        for index, impl in enumerate(plan):
            try:
                result = impl.fn(*args, **kwargs)
            except Exception as exc:
                failures.append((impl.impl_id, exc))
                self._note_failure(op_name, impl, exc, last=index == len(plan) - 1)
                continue
            self._note_used(op_name, impl)
            return result
        raise AllImplsFailedError(op_name, failures) from failures[-1][1]

    def call(self, op_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``op_name`` with the first eligible impl; fall back per call unless strict."""
        plan = self._plan(op_name)
        if not plan:
            raise self._no_impl_error(op_name)
        if self._policy.strict or len(plan) == 1:
            result = plan[0].fn(*args, **kwargs)
            self._note_used(op_name, plan[0])
            return result
        return self._call_with_fallback(op_name, plan, args, kwargs)

    def _dispatcher(self, op_name: str) -> Callable[..., Any]:
        call = self.call

        def dispatcher(*args: Any, **kwargs: Any) -> Any:
            return call(op_name, *args, **kwargs)

        dispatcher.__name__ = dispatcher.__qualname__ = op_name
        dispatcher.__module__ = "transformer_engine_torch"
        dispatcher.__doc__ = f"Dispatch {op_name!r} through te_fl_attention's OpManager."
        return dispatcher

    def resolve(self, op_name: str) -> Any:
        """A dispatcher for an op; a native non-op attribute as is; else UnknownOpError.

        The dispatcher is cached per op and re-reads the order on each call, so later
        registrations and policy changes apply to it.
        """
        found = self._dispatchers.get(op_name)
        if found is not None:
            return found
        if not self._registry.has_op(op_name):
            try:
                return self._registry.native_attr(op_name)
            except AttributeError:
                raise UnknownOpError(op_name) from None
        if not self._validated:
            self.validate()
        with self._lock:
            return self._dispatchers.setdefault(op_name, self._dispatcher(op_name))


# --------------------------------------------------------------------------------------------
# Discovery and logging


@dataclass(frozen=True)
class PluginRecord:
    """Outcome of loading one plugin."""

    name: str
    source: str  # "entry_point" or "env"
    ok: bool
    error: str | None = None


def _register_fn(obj: Any) -> Callable[[OpRegistry], Any]:
    if callable(obj) and not isinstance(obj, type):
        return obj
    for attr in ("te_fl_register", "register"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn
    raise TypeError(f"{obj!r} is not callable and has no register(registry) function")


def _run_plugin(
    name: str, source: str, load: Callable[[], Any], registry: OpRegistry
) -> PluginRecord:
    try:
        _register_fn(load())(registry)
    except Exception as exc:  # a broken plugin must not abort plugin loading
        logger.warning("Plugin %r (%s) failed to register: %r", name, source, exc)
        return PluginRecord(name, source, False, repr(exc))
    logger.debug("Plugin %r (%s) registered", name, source)
    return PluginRecord(name, source, True)


def _entry_points() -> list[Any]:
    import importlib.metadata

    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def discover_plugins(
    registry: OpRegistry, environ: Mapping[str, str] | None = None
) -> list[PluginRecord]:
    """Call ``register(registry)`` of each ``te_fl.plugin`` entry point, then of each module in
    ``TE_FL_PLUGIN_MODULES`` (in order). Failures are logged and recorded, not raised."""
    env = os.environ if environ is None else environ
    records = [_run_plugin(ep.name, "entry_point", ep.load, registry) for ep in _entry_points()]
    for name in _split(env.get("TE_FL_PLUGIN_MODULES", "")):
        load = lambda n=name: importlib.import_module(n)  # noqa: E731 (binds the loop value)
        records.append(_run_plugin(name, "env", load, registry))
    return records


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """Apply ``TEFL_LOG_LEVEL`` to the package logger ``te_fl_attention`` (the registry's, the
    plugin's and each new attention decision's at INFO) and the registry logger; a stderr
    handler on ``te_fl_attention`` if nothing logs yet."""
    env = os.environ if environ is None else environ
    raw = env.get("TEFL_LOG_LEVEL", "")
    if not raw.strip():
        return
    name = _choice("TEFL_LOG_LEVEL", raw, (n.lower() for n in LOG_LEVELS)).upper()
    logger.setLevel(name)
    package = logging.getLogger("te_fl_attention")
    package.setLevel(name)
    if not logger.handlers and not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        package.addHandler(handler)

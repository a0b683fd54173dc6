"""``TE_FL_*`` tokens and :class:`SelectionPolicy`: what to try first (see the package docs)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .env import choice, parse_bool, split
from .impl import KINDS, BackendImplKind, OpImpl, normalize_vendor
from .log import configure_logging

TOKEN_FORMS = ("flagos", "vendor", "reference", "vendor:NAME", "impl:ID")
_DEFAULT_ORDERS = {
    "flagos": ("flagos", "vendor", "reference"),
    "vendor": ("vendor", "flagos", "reference"),
    "reference": ("reference", "flagos", "vendor"),
}


def _vendor_keys(names: Iterable[str]) -> list[str]:
    return [normalize_vendor(name) for name in names if name.strip()]


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
        return f"vendor:{normalize_vendor(arg)}"
    if sep and arg and prefix == "impl":
        return f"impl:{arg}"
    raise _bad_token(tok, where)


def matches(impl: OpImpl, token: str) -> bool:
    if token in KINDS:
        return impl.kind.value == token
    prefix, _, arg = token.partition(":")
    if prefix == "vendor":
        return impl.kind is BackendImplKind.VENDOR and impl.vendor_key == arg
    return impl.impl_id == arg


def match_token(impl: OpImpl, token: str) -> bool:
    """Whether ``token`` (``flagos``, ``vendor:NAME``, ``impl:ID``, ...) selects ``impl``."""
    return matches(impl, _normalize_token(token))


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
    for entry in split(text, ";"):
        op, sep, order = entry.partition("=")
        if not sep:
            raise ValueError(f"{var}: entry {entry!r} is not of the form op=token|token; "
                             f"allowed tokens: {', '.join(TOKEN_FORMS)}")
        entries.append((op, order.split("|")))
    return {op: list(toks) for op, toks in _normalize_per_op(entries, var)}


def _parse_prefer(environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """(prefer kind, preferred vendors) from TE_FL_PREFER / TE_FL_PREFER_VENDOR."""
    raw = environ.get("TE_FL_PREFER", "")
    vendors = environ.get("TE_FL_PREFER_VENDOR", "").strip()
    legacy = vendors in ("0", "1")
    if raw.strip():
        prefer = choice("TE_FL_PREFER", raw, KINDS)
    else:
        prefer = "vendor" if vendors == "1" else "flagos"
    return prefer, () if legacy else tuple(split(vendors))


@dataclass(frozen=True)
class SelectionPolicy:
    """What to try first; immutable, validated on construction (see the package docstring)."""

    prefer: str = "flagos"
    strict: bool = False
    per_op_order: tuple[tuple[str, tuple[str, ...]], ...] = ()
    deny_vendors: frozenset[str] = frozenset()
    allow_vendors: frozenset[str] | None = None
    prefer_vendors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        norm = {
            "prefer": choice("prefer", str(self.prefer), KINDS),
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
            strict=parse_bool(env, "TE_FL_STRICT"),
            per_op_order=tuple(_parse_per_op(env.get("TE_FL_PER_OP", "")).items()),
            deny_vendors=frozenset(split(env.get("TE_FL_DENY_VENDORS", ""))),
            allow_vendors=frozenset(split(env.get("TE_FL_ALLOW_VENDORS", ""))) or None,
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
        key = normalize_vendor(vendor)
        if key in self.deny_vendors:
            return False
        return self.allow_vendors is None or key in self.allow_vendors

    def vendor_rank(self, vendor: str | None) -> int:
        """Position in ``prefer_vendors`` (unlisted vendors after all listed ones)."""
        key = normalize_vendor(vendor) if vendor else None
        if key in self.prefer_vendors:
            return self.prefer_vendors.index(key)
        return len(self.prefer_vendors)

    def vendor_names(self) -> frozenset[str]:
        """Every vendor name the policy mentions (lists and ``vendor:NAME`` tokens)."""
        tokens = (t for _, toks in self.per_op_order for t in toks if t.startswith("vendor:"))
        return frozenset({*self.deny_vendors, *(self.allow_vendors or ()), *self.prefer_vendors,
                          *(t.partition(":")[2] for t in tokens)})

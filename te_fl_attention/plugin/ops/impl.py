"""Ops' implementations: ``OpImpl``, its kinds, and the dispatch errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .log import logger

KINDS = ("flagos", "vendor", "reference")


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


def normalize_vendor(name: str) -> str:
    return name.strip().lower()


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
        return normalize_vendor(self.vendor) if self.vendor else None

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

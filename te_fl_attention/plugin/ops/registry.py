"""``OpRegistry``: the ops' implementations, and native modules as lazy ``vendor`` sources."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .impl import BackendImplKind, OpImpl, normalize_vendor


@dataclass(frozen=True)
class _NativeSource:
    module: ModuleType
    vendor: str
    priority: int

    @property
    def impl_id(self) -> str:
        return f"vendor.{normalize_vendor(self.vendor)}"

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
            native = {normalize_vendor(source.vendor) for source in self._natives}
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

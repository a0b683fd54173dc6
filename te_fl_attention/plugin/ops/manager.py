"""``OpManager``: orders the eligible implementations of an op, calls them, falls back."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .impl import (
    AllImplsFailedError,
    BackendImplKind,
    NoImplementationError,
    OpImpl,
    UnknownOpError,
)
from .log import logger
from .policy import SelectionPolicy, matches
from .registry import OpRegistry, register_native


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
            for impl in sorted((i for i in eligible if matches(i, token)), key=self._rank):
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

"""Helpers for the op-registry tests (``tests/plugin/test_ops_*.py``)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from te_fl_attention.plugin.ops import (
    OpImpl,
    OpManager,
    OpRegistry,
    SelectionPolicy,
)


def make_impl(
    op: str,
    impl_id: str,
    fn: Callable[..., Any] | None = None,
    *,
    vendor: str | None = None,
    priority: int = 0,
    available: Callable[[], bool] | None = None,
) -> OpImpl:
    """An impl whose kind is the impl_id prefix and whose fn returns the impl_id."""
    kind = impl_id.split(".")[0]
    if vendor is None and kind == "vendor":
        vendor = impl_id.split(".")[1]
    return OpImpl(op, impl_id, kind, fn or (lambda *a, **k: impl_id), vendor=vendor,
                  priority=priority, available=available)


def full_registry(op: str = "rmsnorm_fwd") -> OpRegistry:
    """One impl of each kind plus two more vendors, for ``op``."""
    reg = OpRegistry()
    reg.register_many([
        make_impl(op, "reference.torch"),
        make_impl(op, "vendor.cuda", vendor="CUDA", priority=100),
        make_impl(op, "vendor.metax", vendor="METAX", priority=100),
        make_impl(op, "vendor.hygon", vendor="Hygon", priority=50),
        make_impl(op, "flagos.triton", priority=150),
    ])
    return reg


def manager(reg: OpRegistry, native: types.ModuleType | None = None, **env: str) -> OpManager:
    return OpManager(reg, SelectionPolicy.from_env(env), native=native)


def order(mgr: OpManager, op: str = "rmsnorm_fwd") -> list[str]:
    return [impl.impl_id for impl in mgr.candidates(op)]


class Counter:
    """Callable that raises for its first ``fail`` calls, then returns ``value``."""

    def __init__(self, value: str, fail: int = 0, exc: type[Exception] = RuntimeError) -> None:
        self.value, self.fail, self.exc, self.calls = value, fail, exc, 0

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls += 1
        if self.calls <= self.fail:
            raise self.exc(f"{self.value} failed (call {self.calls})")
        return self.value


def fake_native() -> types.ModuleType:
    mod = types.ModuleType("transformer_engine_torch_nv")

    class DType:
        kFloat32 = 4

    mod.DType = DType
    mod.NVTE_VERSION = 2
    mod.rmsnorm_fwd = lambda x: ("native", x)
    mod.get_cudnn_version = lambda: 91000
    mod._private = lambda: "private"
    return mod


def two_impls(first: Callable[..., Any], second: Callable[..., Any]) -> OpRegistry:
    reg = OpRegistry()
    reg.register(make_impl("op", "flagos.first", first))
    reg.register(make_impl("op", "reference.second", second))
    return reg

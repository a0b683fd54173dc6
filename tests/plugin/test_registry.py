"""Op registry: policy parsing, ordering, fallback, native fall-through, discovery, logging."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from te_fl_attention.plugin.registry import (
    LOGGER_NAME,
    AllImplsFailedError,
    BackendImplKind,
    NoImplementationError,
    OpImpl,
    OpManager,
    OpRegistry,
    SelectionPolicy,
    UnknownOpError,
    configure_logging,
    discover_plugins,
    match_token,
    register_native,
)

HERE = Path(__file__).parent
FIXTURE = "tefl_fixture_plugin"


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


# --- types ----------------------------------------------------------------------------------


def test_kind_values_and_te_fl_alias() -> None:
    assert BackendImplKind.DEFAULT is BackendImplKind.FLAGOS
    assert [str(k) for k in BackendImplKind] == ["flagos", "vendor", "reference"]
    assert make_impl("op", "flagos.x").kind is BackendImplKind.FLAGOS


def test_opimpl_validation() -> None:
    with pytest.raises(ValueError, match="needs a vendor"):
        OpImpl("op", "vendor.x", BackendImplKind.VENDOR, print)
    with pytest.raises(ValueError, match="kind='gpu'"):
        OpImpl("op", "gpu.x", "gpu", print)
    with pytest.raises(TypeError, match="not callable"):
        OpImpl("op", "flagos.x", "flagos", 3)  # type: ignore[arg-type]


def test_availability_sources() -> None:
    def te_fl_style() -> None: ...

    te_fl_style._is_available = lambda: False  # type: ignore[attr-defined]
    assert not make_impl("op", "flagos.a", te_fl_style).is_available()
    assert not make_impl("op", "flagos.b", available=lambda: 1 / 0).is_available()
    assert make_impl("op", "flagos.c", available=lambda: True).is_available()
    assert make_impl("op", "flagos.d").is_available()


def test_match_token() -> None:
    cuda = make_impl("op", "vendor.cuda", vendor="CUDA")
    assert match_token(cuda, "vendor") and match_token(cuda, "VENDOR:cuda")
    assert match_token(cuda, "impl:vendor.cuda")
    assert not match_token(cuda, "flagos") and not match_token(cuda, "vendor:metax")
    with pytest.raises(ValueError, match="unknown token 'cuda'"):
        match_token(cuda, "cuda")


def test_registry_duplicates_replace_and_foreign_impls() -> None:
    reg = OpRegistry()
    reg.register(make_impl("op", "flagos.a"))
    with pytest.raises(ValueError, match="already has an implementation 'flagos.a'"):
        reg.register(make_impl("op", "flagos.a"))
    reg.register(make_impl("op", "flagos.a", lambda: "new"), replace=True)
    foreign = types.SimpleNamespace(op_name="op2", impl_id="reference.t", kind="reference",
                                    fn=lambda: "ref", vendor=None, priority=50)
    reg.register_impl(foreign)  # TE-FL spelling, duck-typed impl
    assert reg.ops() == reg.list_operators() == ["op", "op2"]
    assert reg.get_implementation("op", "flagos.a").fn() == "new"
    assert reg.get_implementations("op2")[0].priority == 50


# --- ordering -------------------------------------------------------------------------------


def test_default_order_is_flagos_vendor_reference() -> None:
    mgr = manager(full_registry())
    assert order(mgr) == ["flagos.triton", "vendor.cuda", "vendor.metax", "vendor.hygon",
                          "reference.torch"]
    assert mgr.chosen("rmsnorm_fwd") == mgr.get_selected_impl_id("rmsnorm_fwd") == "flagos.triton"


@pytest.mark.parametrize(
    ("prefer", "first_kinds"),
    [("flagos", ["flagos", "vendor", "reference"]),
     ("Vendor", ["vendor", "flagos", "reference"]),
     ("reference", ["reference", "flagos", "vendor"])],
)
def test_prefer_each_kind(prefer: str, first_kinds: list[str]) -> None:
    mgr = manager(full_registry(), TE_FL_PREFER=prefer)
    kinds = list(dict.fromkeys(impl_id.split(".")[0] for impl_id in order(mgr)))
    assert kinds == first_kinds
    assert mgr.policy.get_default_order() == first_kinds


def test_priority_ranks_within_a_kind_only() -> None:
    reg = OpRegistry()
    reg.register_many([make_impl("op", "vendor.big", priority=999), make_impl("op", "flagos.b"),
                       make_impl("op", "flagos.a"), make_impl("op", "flagos.c", priority=1)])
    assert order(manager(reg), "op") == ["flagos.c", "flagos.a", "flagos.b", "vendor.big"]


def test_prefer_vendor_orders_vendors_case_insensitively() -> None:
    mgr = manager(full_registry(), TE_FL_PREFER_VENDOR="hygon, Metax")
    assert order(mgr)[1:4] == ["vendor.hygon", "vendor.metax", "vendor.cuda"]
    assert mgr.chosen("rmsnorm_fwd") == "flagos.triton"  # kinds still come first


def test_prefer_vendor_legacy_values() -> None:
    assert SelectionPolicy.from_env({"TE_FL_PREFER_VENDOR": "1"}).prefer == "vendor"
    legacy_off = SelectionPolicy.from_env({"TE_FL_PREFER_VENDOR": "0"})
    assert legacy_off.prefer == "flagos" and legacy_off.prefer_vendors == ()
    explicit = SelectionPolicy.from_env({"TE_FL_PREFER": "reference", "TE_FL_PREFER_VENDOR": "1"})
    assert explicit.prefer == "reference"


def test_allow_and_deny_are_case_insensitive() -> None:
    allowed = manager(full_registry(), TE_FL_ALLOW_VENDORS="cuda,HYGON")
    assert order(allowed) == ["flagos.triton", "vendor.cuda", "vendor.hygon", "reference.torch"]
    denied = manager(full_registry(), TE_FL_DENY_VENDORS="Cuda")
    assert "vendor.cuda" not in order(denied) and "vendor.metax" in order(denied)
    both = manager(full_registry(), TE_FL_ALLOW_VENDORS="cuda,metax", TE_FL_DENY_VENDORS="CUDA")
    assert order(both) == ["flagos.triton", "vendor.metax", "reference.torch"]


def test_allow_list_naming_no_vendor_warns(caplog: pytest.LogCaptureFixture) -> None:
    mgr = manager(full_registry(), TE_FL_ALLOW_VENDORS="vendor_a")
    with caplog.at_level(logging.WARNING, LOGGER_NAME):
        assert order(mgr) == ["flagos.triton", "reference.torch"]
    assert "vendor_a" in caplog.text


def test_unavailable_impls_are_skipped() -> None:
    reg = full_registry()
    reg.register(make_impl("rmsnorm_fwd", "flagos.gems", priority=999, available=lambda: False))
    assert manager(reg).chosen("rmsnorm_fwd") == "flagos.triton"


def test_per_op_tokens() -> None:
    reg = full_registry()
    reg.register(make_impl("other", "reference.torch"))
    reg.register(make_impl("other", "flagos.triton"))
    mgr = manager(reg, TE_FL_PER_OP="rmsnorm_fwd=vendor:HYGON|reference|vendor:hygon")
    assert order(mgr) == ["vendor.hygon", "reference.torch"]
    assert order(mgr, "other") == ["flagos.triton", "reference.torch"]
    pinned = manager(reg, TE_FL_PER_OP=" rmsnorm_fwd = impl:vendor.metax | flagos ;")
    assert order(pinned) == ["vendor.metax", "flagos.triton"]
    assert pinned.policy.per_op_order_dict == {"rmsnorm_fwd": ["impl:vendor.metax", "flagos"]}


def test_per_op_matching_nothing_raises_on_call() -> None:
    mgr = manager(full_registry(), TE_FL_PER_OP="rmsnorm_fwd=vendor:ascend")
    with pytest.raises(NoImplementationError, match="matched by no token of vendor:ascend"):
        mgr.call("rmsnorm_fwd")


@pytest.mark.parametrize(
    ("value", "message"),
    [("rmsnorm_fwd=cuda", "unknown token 'cuda'"),
     ("rmsnorm_fwd=vendor:cuda|default", "old name for 'flagos'"),
     ("rmsnorm_fwd=vendor:", "unknown token 'vendor:'"),
     ("rmsnorm_fwd=impl:", "unknown token 'impl:'"),
     ("rmsnorm_fwd", "not of the form op=token"),
     ("rmsnorm_fwd=", "has no tokens"),
     ("=flagos", "empty op name"),
     ("a=flagos;a=vendor", "listed twice")],
)
def test_per_op_syntax_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        SelectionPolicy.from_env({"TE_FL_PER_OP": value})
    assert "TE_FL_PER_OP" in str(info.value)
    if "token" in message:
        assert "vendor:NAME, impl:ID" in str(info.value)


def test_unknown_op_in_per_op_raises_at_first_resolve() -> None:
    mgr = manager(full_registry(), fake_native(), TE_FL_PER_OP="rmsnorm_fwdd=flagos")
    with pytest.raises(ValueError, match="unknown op.*'rmsnorm_fwdd'.*did you mean rmsnorm_fwd"):
        mgr.resolve("rmsnorm_fwd")
    with pytest.raises(ValueError, match="rmsnorm_fwdd"):
        mgr.call("rmsnorm_fwd")


def test_per_op_may_name_native_and_plugin_ops() -> None:
    reg = OpRegistry()
    mgr = manager(reg, fake_native(), TE_FL_PER_OP="get_cudnn_version=vendor;late_op=reference")
    reg.register(make_impl("late_op", "reference.torch"))  # after construction, before first use
    assert mgr.resolve("get_cudnn_version")() == 91000
    assert mgr.call("late_op") == "reference.torch"


@pytest.mark.parametrize(
    ("var", "value"),
    [("TE_FL_PREFER", "gpu"), ("TE_FL_STRICT", "maybe"), ("TEFL_LOG_LEVEL", "loud")],
)
def test_invalid_env_values(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{var}='{value}' is not valid: expected one of"):
        SelectionPolicy.from_env({var: value})


@pytest.mark.parametrize(("value", "strict"), [("", False), ("0", False), ("off", False),
                                                ("1", True), ("TRUE", True), ("yes", True)])
def test_strict_values(value: str, strict: bool) -> None:
    assert SelectionPolicy.from_env({"TE_FL_STRICT": value}).strict is strict


# --- dispatch and fallback ------------------------------------------------------------------


def two_impls(first: Callable[..., Any], second: Callable[..., Any]) -> OpRegistry:
    reg = OpRegistry()
    reg.register(make_impl("op", "flagos.first", first))
    reg.register(make_impl("op", "reference.second", second))
    return reg


def test_non_strict_falls_back_and_passes_arguments() -> None:
    seen = []
    mgr = manager(two_impls(Counter("a", fail=99), lambda *a, **k: seen.append((a, k)) or "b"))
    assert mgr.call("op", 1, x=2) == "b"
    assert seen == [((1,), {"x": 2})]


def test_strict_does_not_fall_back() -> None:
    second = Counter("b")
    mgr = manager(two_impls(Counter("a", fail=99, exc=KeyError), second), TE_FL_STRICT="1")
    with pytest.raises(KeyError, match="a failed"):
        mgr.call("op")
    assert second.calls == 0


def test_fallback_is_per_call() -> None:
    flaky, backup = Counter("flaky", fail=1), Counter("backup")
    mgr = manager(two_impls(flaky, backup))
    assert [mgr.call("op") for _ in range(3)] == ["backup", "flaky", "flaky"]
    assert (flaky.calls, backup.calls) == (3, 1)
    assert mgr.chosen("op") == "flagos.first"


def test_failing_impl_runs_once_per_call() -> None:
    bad, good = Counter("bad", fail=99), Counter("good")
    reg = two_impls(bad, good)
    reg.register(make_impl("op", "vendor.cuda", Counter("cuda", fail=99)))
    mgr = manager(reg, TE_FL_PER_OP="op=impl:flagos.first|flagos|vendor|reference")
    for calls in (1, 2, 3):
        assert mgr.call("op") == "good"
        assert bad.calls == calls


def test_all_failing_candidates() -> None:
    mgr = manager(two_impls(Counter("a", fail=9, exc=ValueError), Counter("b", fail=9)))
    with pytest.raises(AllImplsFailedError, match="All 2 implementation") as info:
        mgr.call("op")
    assert [impl_id for impl_id, _ in info.value.failures] == ["flagos.first", "reference.second"]
    assert isinstance(info.value.__cause__, RuntimeError)
    single = OpRegistry()
    single.register(make_impl("op", "flagos.only", Counter("only", fail=9, exc=IndexError)))
    with pytest.raises(IndexError):  # one candidate: the original exception, unwrapped
        manager(single).call("op")


def test_registration_after_first_call_is_seen() -> None:
    reg = OpRegistry()
    reg.register(make_impl("op", "reference.torch"))
    mgr = manager(reg)
    assert mgr.call("op") == "reference.torch"
    reg.register(make_impl("op", "flagos.late"))
    assert mgr.call("op") == "flagos.late"


def test_policy_swap_applies_to_existing_dispatcher() -> None:
    mgr = manager(full_registry())
    dispatch = mgr.resolve("rmsnorm_fwd")
    assert dispatch() == "flagos.triton"
    mgr.policy = SelectionPolicy(prefer="reference")
    assert dispatch() == "reference.torch"
    assert mgr.resolve("rmsnorm_fwd") is dispatch


# --- native fall-through --------------------------------------------------------------------


def test_native_fall_through_for_unregistered_names() -> None:
    native = fake_native()
    mgr = manager(OpRegistry(), native)
    dispatch = mgr.resolve("rmsnorm_fwd")
    assert dispatch(3) == ("native", 3)
    assert (dispatch.__name__, dispatch.__module__) == ("rmsnorm_fwd", "transformer_engine_torch")
    assert mgr.chosen("rmsnorm_fwd") == "vendor.cuda"
    assert mgr.resolve("DType") is native.DType and mgr.resolve("NVTE_VERSION") == 2
    assert mgr.resolve("_private") is native._private  # passed through, not an op
    assert "rmsnorm_fwd" in mgr.registry and "DType" not in mgr.registry
    assert mgr.registry.ops() == []  # native functions are never enumerated
    with pytest.raises(UnknownOpError, match="'nope'"):
        mgr.resolve("nope")
    with pytest.raises(AttributeError):
        mgr.call("nope")


def test_registered_impl_wins_and_native_is_the_fallback() -> None:
    reg = OpRegistry()
    reg.register(make_impl("rmsnorm_fwd", "flagos.triton", Counter("flagos", fail=1)))
    mgr = manager(reg, fake_native())
    assert order(mgr) == ["flagos.triton", "vendor.cuda"]
    assert mgr.call("rmsnorm_fwd", 1) == ("native", 1)
    assert mgr.call("rmsnorm_fwd", 1) == "flagos"


def test_native_obeys_deny_list_and_registered_id_shadows_it() -> None:
    denied = manager(OpRegistry(), fake_native(), TE_FL_DENY_VENDORS="CUDA")
    with pytest.raises(NoImplementationError, match="'vendor.cuda' excluded by TE_FL_ALLOW"):
        denied.call("rmsnorm_fwd", 1)
    reg = OpRegistry()
    register_native(reg, fake_native())
    reg.register(make_impl("rmsnorm_fwd", "vendor.cuda", vendor="cuda"))
    assert [i.fn for i in reg.impls("rmsnorm_fwd")][0]() == "vendor.cuda"
    assert len(reg.impls("rmsnorm_fwd")) == 1


# --- discovery ------------------------------------------------------------------------------


@pytest.fixture
def fixture_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.delitem(sys.modules, FIXTURE, raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])


def test_discovery_from_env_modules(fixture_on_path: None) -> None:
    reg = OpRegistry()
    records = discover_plugins(reg, {"TE_FL_PLUGIN_MODULES": f"{FIXTURE}, no_such_tefl_mod"})
    assert [(r.name, r.source, r.ok) for r in records] == [
        (FIXTURE, "env", True), ("no_such_tefl_mod", "env", False)]
    assert "ModuleNotFoundError" in records[1].error
    assert manager(reg).call("fixture_op") == "from fixture"


def test_discovery_from_entry_points(
    fixture_on_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = []
    ep = importlib.metadata.EntryPoint("fixture", f"{FIXTURE}:register", "te_fl.plugin")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: groups.append(kw) or [ep])
    reg = OpRegistry()
    records = discover_plugins(reg, {})
    assert groups == [{"group": "te_fl.plugin"}]
    assert [(r.name, r.source, r.ok) for r in records] == [("fixture", "entry_point", True)]
    assert reg.ops() == ["fixture_op"]


# --- logging --------------------------------------------------------------------------------


def test_log_line_once_per_op_and_impl(caplog: pytest.LogCaptureFixture) -> None:
    reg = OpRegistry()
    reg.register(make_impl("rmsnorm_fwd", "flagos.triton", Counter("flagos", fail=1)))
    mgr = manager(reg, fake_native())
    with caplog.at_level(logging.INFO, LOGGER_NAME):
        for _ in range(3):
            mgr.call("rmsnorm_fwd", 0)
    using = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
    assert using == [
        "Op 'rmsnorm_fwd' using 'vendor.cuda' (kind=vendor, vendor=cuda)",
        "Op 'rmsnorm_fwd' using 'flagos.triton' (kind=flagos, vendor=None)",
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'flagos.triton' failed for op 'rmsnorm_fwd'" in warnings[0].getMessage()


def test_tefl_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    log = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(log, "level", log.level)
    monkeypatch.setattr(log, "handlers", list(log.handlers))
    configure_logging({"TEFL_LOG_LEVEL": "debug"})
    assert log.level == logging.DEBUG
    SelectionPolicy.from_env({"TEFL_LOG_LEVEL": "Warning"})
    assert log.level == logging.WARNING


# --- threads and import cost ----------------------------------------------------------------


def test_concurrent_registration_and_calls(caplog: pytest.LogCaptureFixture) -> None:
    reg = OpRegistry()
    mgr = manager(reg)
    reg.register(make_impl("op", "reference.torch"))

    def work(n: int) -> None:
        reg.register(make_impl(f"op{n}", "flagos.x"))
        for _ in range(50):
            mgr.call("op")

    with caplog.at_level(logging.INFO, LOGGER_NAME):
        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(reg.ops()) == 9
    assert sum("using" in r.getMessage() for r in caplog.records) == 1


def test_import_is_light() -> None:
    code = ("import sys, te_fl_attention.plugin.registry; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parents[1])


def test_programmatic_policy_is_validated_and_normalized() -> None:
    policy = SelectionPolicy.from_dict(prefer="VENDOR", per_op_order={"op": ["Vendor:ACME"]},
                                       allow_vendors=[], deny_vendors=[" Foo "],
                                       prefer_vendors=["B", "b", "a"])
    assert policy == SelectionPolicy(prefer="vendor", per_op_order=(("op", ("vendor:acme",)),),
                                     deny_vendors=frozenset({"foo"}), prefer_vendors=("b", "a"))
    assert policy.allow_vendors is None and policy.vendor_names() == {"acme", "foo", "a", "b"}
    with pytest.raises(ValueError, match="prefer='gpu'"):
        SelectionPolicy(prefer="gpu")
    with pytest.raises(ValueError, match="per_op_order.*unknown token 'cuda'"):
        SelectionPolicy(per_op_order=(("op", ("cuda",)),))

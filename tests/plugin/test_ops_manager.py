"""``OpManager`` (``plugin/ops/manager.py``): ordering, dispatch, fallback, native ops, threads."""

from __future__ import annotations

import logging
import threading

import pytest
from ops_testutil import Counter, fake_native, full_registry, make_impl, manager, order, two_impls

from te_fl_attention.plugin.ops import (
    LOGGER_NAME,
    AllImplsFailedError,
    NoImplementationError,
    OpRegistry,
    SelectionPolicy,
    UnknownOpError,
)


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
